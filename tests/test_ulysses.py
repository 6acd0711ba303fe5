"""``autopar::ulysses_attention``: heads exchanged for sequence over cp ranks equals attention over the whole
sequence, forward and backward, in float64."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autopar
import models
from autopar import Mesh
from autopar.core.collectives import Binding, bind
from autopar.core.errors import UnsupportedError
from autopar.core.ring_attention import positions
from autopar.core.ulysses import ulysses_attention
from autopar.testing import assert_equivalent

B, H, S, D = 2, 4, 16, 8


def _rank(causal: bool) -> float:
    cp, me = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, S, D, dtype=torch.float64, generator=gen) for _ in range(4))
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*full, is_causal=causal, scale=0.3)
    want.backward(dout)
    mine = positions(S // cp, cp, me)  # the rank's tokens, balanced chunks
    local = [x[:, :, mine].clone().requires_grad_() for x in (q, k, v)]
    with bind(Binding({"cp": dist.group.WORLD})):
        out = ulysses_attention(*local, 0.3, causal, "cp", cp)[0]
        out.backward(dout[:, :, mine])
    errors = [(out - want[:, :, mine]).abs().max()]
    errors += [(x.grad - f.grad[:, :, mine]).abs().max() for x, f in zip(local, full)]
    return float(max(errors))


@pytest.mark.parametrize("cp, causal", [(2, True), (2, False), pytest.param(4, True, marks=pytest.mark.slow)])
def test_ulysses_equals_whole_sequence_attention(launcher, cp: int, causal: bool) -> None:
    assert max(launcher(_rank, cp, causal)) < 1e-13


IDS = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
TARGET = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("name, mesh", [("llama", Mesh(cp=2)), pytest.param("gpt2", Mesh(cp=4), marks=pytest.mark.slow),
                                        pytest.param("llama", Mesh(dp=2, cp=2), marks=pytest.mark.slow)])
def test_all_to_all_attention_equals_one_device(launcher, name: str, mesh: Mesh) -> None:
    """``cp_attention="all_to_all"``: every attention exchanges heads for sequence; AdamW, float64."""
    assert_equivalent(models.factory(getattr(models, name)), mesh, (IDS,), TARGET, models.lm_loss, models.adamw,
                      steps=2, rtol=1e-9, atol=1e-10, launcher=launcher, cp_attention="all_to_all")


def _exchanges() -> tuple[dict[str, int], dict[str, int], list[tuple[int, int]], str]:
    pm = autopar.parallelize(models.llama(), Mesh(cp=2), loss_fn=models.lm_loss, optimizer=models.adamw,
                             cp_attention="all_to_all")
    pm.step(IDS, target=TARGET)
    return (pm.communication(calls=True), pm.communication(),
            [(c.count, c.bytes) for c in pm.plan.collectives if c.axis == "cp"], pm.graph(0).code)


def test_all_to_alls_run_as_planned(launcher) -> None:
    """The plan's all-to-alls (4 per attention forward, 4 backward) are the calls and bytes a step runs."""
    for calls, sent, planned, code in launcher(_exchanges, 2):
        assert (calls["all_to_all@cp"], sent["all_to_all@cp"]) == tuple(map(sum, zip(*planned)))
        assert [c for c, _ in planned] == [8, 8]  # 2 layers
        assert code.count("torch.ops.autopar.ulysses_attention.default(") == 2


def test_heads_not_dividing_by_cp_are_refused() -> None:
    pm = autopar.parallelize(models.llama(heads=2, kv_heads=2), Mesh(cp=4), loss_fn=models.lm_loss,
                             optimizer=models.adamw, cp_attention="all_to_all")
    with pytest.raises(UnsupportedError, match=r"heads \[2, 2, 2\] do not divide by cp=4.*cp_attention='ring'"):
        pm.compile((IDS,), {}, TARGET)


def test_tp_is_refused() -> None:
    """tp shards the ring's heads, not the all-to-all's (mask tensors run: tests/test_ulysses_masks.py)."""
    with pytest.raises(UnsupportedError, match=r"cp_attention='all_to_all'.*use cp_attention='ring' with tp=2"):
        autopar.parallelize(models.llama(), Mesh(cp=2, tp=2), cp_attention="all_to_all")


def test_planner_weighs_the_all_to_all_against_the_ring() -> None:
    """The planner offers each cp configuration at tp = 1 with the ring and, where cp divides the heads, with
    the all-to-all; its all-to-all bytes are the runtime's plan's (the log-sum-exp column apart), and the
    chosen form travels to ``parallelize`` with the configuration."""
    from autopar.planner import plan
    from autopar.planner.config import Config

    result = plan(models.llama(), 2, cluster="cpu", global_batch=2, seq_len=16, precision="fp64", optimizer="adam",
                  tp=(1,), pp=(1,), zero=(0,), recompute=("none",), cp=(2,), top=None,
                  example_inputs=(IDS,))
    ring, a2a = (result.candidate(Config(dp=1, cp=2, microbatch_size=2, cp_attention=how))
                 for how in ("ring", "all_to_all"))
    assert a2a.parallelism.cp_attention == "all_to_all" and ring.parallelism.cp_attention == "ring"
    attentions, calls, nbytes = result.cost.ring_exchanges(a2a.config)
    assert (attentions, calls) == (2, 16)
    runtime = autopar.parallelize(models.llama(), Mesh(cp=2), loss_fn=models.lm_loss, optimizer=models.adamw,
                                  cp_attention="all_to_all")
    runtime.compile((IDS,), {}, TARGET)
    planned = sum(c.bytes for c in runtime.plan.collectives if c.axis == "cp")
    assert nbytes == pytest.approx(planned, rel=0.05)  # the output's log-sum-exp column: 1 / (D + 1) of a tensor
    assert result.cost.ring_exchanges(ring.config)[2] == nbytes  # cp = 2: as many bytes as the ring


def test_pp_ranks_plan_the_all_to_alls_of_their_stages() -> None:
    """Under a pipeline the plan counts the all-to-alls of the pp rank whose stages hold the most attentions."""
    pm = autopar.parallelize(models.llama(), Mesh(pp=2, cp=2), loss_fn=models.lm_loss, optimizer=models.adamw,
                             cp_attention="all_to_all", microbatches=2)
    pm.compile((IDS,), {}, TARGET)
    assert [c.count for c in pm.plan.collectives if c.axis == "cp"] == [4 * 2, 4 * 2]  # 1 attention, 2 microbatches


@pytest.mark.slow
@pytest.mark.parametrize("mesh, kw", [(Mesh(pp=2, cp=2), dict(microbatches=2)), (Mesh(dp=2, cp=2), dict(zero=3)),
                                      (Mesh(cp=2), dict(recompute="full"))], ids=["pp2-cp2", "zero3", "full"])
def test_all_to_all_composes(launcher, mesh: Mesh, kw: dict) -> None:
    ids, target = torch.cat([IDS, IDS.flip(0)]), torch.cat([TARGET, TARGET.flip(1)])
    assert_equivalent(models.factory(models.llama), mesh, (ids,), target, models.lm_loss, models.adamw, steps=2,
                      rtol=1e-9, atol=1e-10, launcher=launcher, cp_attention="all_to_all", **kw)
