"""Context parallelism composed with ZeRO, mixed precision, recomputation, tp and pp: float64, exact.

Each run trains LLaMA with AdamW for two steps on balanced chunks of every sequence (ring attention
over cp) and compares the loss of each step, the outputs and every parameter with one device
(``assert_equivalent``). Under ZeRO the parameters' state is sharded over dp x cp (``Mesh.zero_axis``):
parameters are replicated over cp, so the ``dp * cp`` ranks share one copy (docs/decisions.md).
"""
from __future__ import annotations

import pytest
import torch

import models
from autopar import Mesh, parallelize
from autopar.core.errors import UnsupportedError
from autopar.passes.context_parallel import RING
from autopar.testing import assert_equivalent
from harness.mixed import assert_mixed

IDS = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(5))
TARGET = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(6))
LLAMA = models.factory(models.llama)


def _exact(make: object, mesh: Mesh, launcher: object, **options: object) -> None:
    assert_equivalent(make, mesh, (IDS,), TARGET, models.lm_loss, models.adamw, steps=2, rtol=1e-9, atol=1e-10,
                      launcher=launcher, **options)


@pytest.mark.parametrize("zero", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3])
def test_zero_over_dp_and_cp(launcher, zero: int) -> None:
    """dp=2, cp=2: parameters, gradients (stages 2-3) and AdamW state sharded over the four ranks."""
    _exact(LLAMA, Mesh(dp=2, cp=2), launcher, zero=zero)


@pytest.mark.parametrize("mesh, zero", [(Mesh(dp=(2, 1), cp=2), 3),
                                        pytest.param(Mesh(dp=(2, 2), cp=2), 2, marks=pytest.mark.slow)],
                         ids=["dp(2,1)-cp2-zero3", "dp(2,2)-cp2-zero2"])
def test_hybrid_sharding_shards_over_dp_shard_and_cp(launcher, mesh: Mesh, zero: int) -> None:
    """Hybrid sharding: ZeRO over each replica's dp_shard x cp ranks (``dp_shard_cp``), replicas averaged."""
    _exact(LLAMA, mesh, launcher, zero=zero)


def _memory(mesh: Mesh, zero: int) -> tuple[dict, dict, int]:
    model = LLAMA()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    pm = parallelize(model, mesh, loss_fn=models.lm_loss, optimizer=models.adamw, zero=zero,
                     example_inputs=(IDS,), example_target=TARGET)
    pm.step(IDS, target=TARGET)
    return pm.memory(), dict(pm.plan.memory), total


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_memory_divides_by_dp_times_cp(launcher, zero: int) -> None:
    """Measured on every rank after a step, within 5% of ZeRO's formula over n = dp x cp = 4 ranks and of the
    plan (the flat groups' padding): stage 1 shards AdamW's two states, 2 the gradients too, 3 the parameters."""
    mesh = Mesh(dp=2, cp=2)
    n = mesh.dp * mesh.cp
    for measured, planned, total in launcher(_memory, mesh.size, mesh, zero):
        formula = {"parameters": total if zero < 3 else total / n, "gradients": total if zero == 1 else total / n,
                   "optimizer": 2 * total / n}
        for key, want in formula.items():
            assert measured[key] == pytest.approx(want, rel=0.05), (key, measured, formula)
            assert planned[key] == pytest.approx(want, rel=0.05), (key, planned, formula)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_replays_the_ring(launcher, mode: str) -> None:
    """cp=2: each layer's region recomputed in backward (full: with its ring, whose exchanges run again)."""
    _exact(LLAMA, Mesh(cp=2), launcher, recompute=mode)


@pytest.mark.parametrize("mesh, options", [(Mesh(tp=2, cp=2), {}),
                                           pytest.param(Mesh(tp=2, cp=2), {"sequence_parallel": True},
                                                        marks=pytest.mark.slow),
                                           (Mesh(pp=2, cp=2), {"microbatches": 2})],
                         ids=["tp2-cp2", "tp2-cp2-sp", "pp2-cp2"])
def test_tp_and_pp_with_cp(launcher, mesh: Mesh, options: dict) -> None:
    """tp=2 x cp=2 (the rings hold a tp rank's heads), with sequence parallelism (the sp shards are shards of
    the local chunk), and pp=2 x cp=2 (the stages pass the local chunks)."""
    _exact(LLAMA, mesh, launcher, **options)


@pytest.mark.parametrize("precision", [pytest.param("bf16", marks=pytest.mark.slow), "mixed"])
def test_precision_with_cp(launcher, precision: str) -> None:
    """bf16 compute (the rings in bf16) with fp32 masters, ZeRO-3 over dp x cp: within the mixed-precision
    bounds of one device running the same policy (SGD, so a gradient off by a factor shows per parameter)."""
    assert_mixed(models.factory(models.llama, dtype=torch.float32), Mesh(dp=2, cp=2), (IDS,), TARGET, models.lm_loss,
                 models.sgd, 3, launcher, precision, zero=3)


@pytest.mark.parametrize("mesh, options, named", [
    (Mesh(dp=2, cp=2, ep=2), {}, "ep"), (Mesh(dp=2, cp=2), {"batch": "local"}, "batch='local'"),
])
def test_compositions_not_supported_are_refused(mesh: Mesh, options: dict, named: str) -> None:
    """ep and local batches under cp: refused at compile time, naming each."""
    with pytest.raises(UnsupportedError, match=rf"with {named}: context parallelism \(cp=2\) does not compose"):
        pm = parallelize(models.gpt2(), mesh, loss_fn=models.lm_loss, optimizer=models.adamw, **options)
        pm.compile((IDS,), {}, TARGET)


def _ring_traffic(mesh: Mesh, options: dict) -> tuple[dict, dict, list, list]:
    """One LLaMA step: ring exchanges run (calls, bytes), planned, and the q shapes of the rank's rings."""
    pm = parallelize(LLAMA(), mesh, loss_fn=models.lm_loss, optimizer=models.adamw, **options)
    pm.step(IDS, target=TARGET)
    own = pm.compile((IDS,), {}, TARGET).own_stages(torch.distributed.get_rank())  # (the program the step ran)
    rings = [tuple(nd.args[0].meta["val"].shape) for st in own for nd in st.gm.graph.nodes if nd.target is RING]
    return (pm.communication(calls=True), pm.communication(),
            [(c.count, c.bytes) for c in pm.plan.collectives if c.axis == "cp"], rings)


@pytest.mark.parametrize("sequence_parallel", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_tp_shards_the_heads_and_the_ring_passes_them(launcher, sequence_parallel: bool) -> None:
    """LLaMA's 4 heads: 2 per tp rank in every ring (batch 4, 4 tokens per cp rank, head dim 8), and each ring
    passes those heads' K and V: the exchanges run are the plan's, calls and bytes."""
    for calls, sent, planned, rings in launcher(_ring_traffic, 4, Mesh(tp=2, cp=2),
                                                {"sequence_parallel": sequence_parallel}):
        assert rings == [(4, 2, 4, 8)] * 2
        assert (calls["ring_send_recv@cp"], sent["ring_send_recv@cp"]) == tuple(map(sum, zip(*planned)))


def test_pp_ranks_plan_the_rings_of_their_stages(launcher) -> None:
    """pp=2 x cp=2, two microbatches: each pp rank holds one of LLaMA's two attentions (whole heads, 2 sequences
    of 4 tokens per microbatch), and the plan counts that rank's exchanges, not the whole model's."""
    for calls, sent, planned, rings in launcher(_ring_traffic, 4, Mesh(pp=2, cp=2), {"microbatches": 2}):
        assert rings == [(2, 4, 4, 8)]
        assert (calls["ring_send_recv@cp"], sent["ring_send_recv@cp"]) == tuple(map(sum, zip(*planned)))


def _ring_calls(mode: str) -> int:
    """Ring exchanges of one LLaMA step (2 attentions) at cp=2 under recompute ``mode``."""
    pm = parallelize(LLAMA(), Mesh(cp=2), loss_fn=models.lm_loss, optimizer=models.adamw, recompute=mode)
    pm.step(IDS, target=TARGET)
    return pm.communication(calls=True)["ring_send_recv@cp"]


def test_full_recomputation_replays_the_ring_and_selective_keeps_it(launcher) -> None:
    """At cp=2 an attention exchanges K/V once forward and three times backward: 8 calls for two attentions.
    "full" runs each ring's forward again in backward (2 more); "selective" keeps the ring's output as it keeps
    an attention's, and exchanges no more than without recomputation."""
    calls = {mode: launcher(_ring_calls, 2, mode) for mode in ("none", "selective", "full")}
    assert calls == {"none": [8, 8], "selective": [8, 8], "full": [10, 10]}, calls


@pytest.mark.slow  # three legs on up to 4 ranks
def test_zero_checkpoints_move_between_cp_and_other_meshes(launcher, tmp_path) -> None:
    """LLaMA saved on dp=2 x cp=2 at ZeRO-3 (state sharded over the four ranks), resumed on dp=2 at ZeRO-1, then
    on cp=2 at ZeRO-2: equal to one uninterrupted device."""
    from test_checkpoint_reshard import _assert_chain_equals_one_device

    _assert_chain_equals_one_device(launcher, str(tmp_path / "ckpt"), models.factory(models.llama),
                                    [(dict(dp=2, cp=2), 3, 2), (dict(dp=2), 1, 1), (dict(cp=2), 2, 1)])


@pytest.mark.slow  # eight ranks
def test_cp_with_pp_tp_and_zero3(launcher) -> None:
    """Every axis at once: cp=2 x pp=2 x tp=2, ZeRO-3 over the cp ranks, two microbatches."""
    _exact(LLAMA, Mesh(cp=2, pp=2, tp=2), launcher, zero=3, microbatches=2)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, options", [
    (Mesh(dp=2, cp=2), {"zero": 3, "recompute": "selective"}), (Mesh(dp=2, cp=2), {"zero": 3, "recompute": "full"}),
    (Mesh(tp=2, cp=2), {"recompute": "full"}), (Mesh(pp=2, cp=2), {"microbatches": 2, "recompute": "selective"}),
], ids=["dp2-cp2-zero3-selective", "dp2-cp2-zero3-full", "tp2-cp2-full", "pp2-cp2-selective"])
def test_recomputation_with_other_axes(launcher, mesh: Mesh, options: dict) -> None:
    _exact(LLAMA, mesh, launcher, **options)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "mixed"])
def test_precision_with_tp_and_cp(launcher, precision: str) -> None:
    assert_mixed(models.factory(models.llama, dtype=torch.float32), Mesh(tp=2, cp=2), (IDS,), TARGET,
                 models.lm_loss, models.sgd, 3, launcher, precision)


def test_zero_groups_under_cp() -> None:
    """ZeRO's axis under cp: all dp x cp ranks, or each replica's dp_shard x cp ranks under hybrid sharding."""
    assert Mesh(dp=2, cp=2).zero_axis == "dp_cp" and Mesh(dp=2, cp=2, tp=2).groups("dp_cp") == [[0, 2, 4, 6],
                                                                                              [1, 3, 5, 7]]
    hybrid = Mesh(dp=(2, 2), cp=2)
    assert hybrid.zero_axis == "dp_shard_cp" and hybrid["dp_shard_cp"] == 4
    assert hybrid.groups("dp_shard_cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [hybrid.coord(r, "dp_shard_cp") for r in range(8)] == [0, 1, 2, 3] * 2
    assert hybrid.groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "bert", "mistral"])
@pytest.mark.parametrize("mesh, options", [(Mesh(tp=2, cp=2), {}), (Mesh(pp=2, cp=2), {"microbatches": 2})],
                         ids=["tp2-cp2", "pp2-cp2"])
def test_the_other_models_with_tp_and_pp(launcher, name: str, mesh: Mesh, options: dict) -> None:
    """GPT-2 (tied embeddings across the stages), BERT (bidirectional) and Mistral (a window of 4 of 8 tokens)
    on tp=2 x cp=2 and pp=2 x cp=2, as LLaMA above (Gemma-2: tests/test_context_masks.py)."""
    _exact(models.factory(getattr(models, name)), mesh, launcher, **options)
