"""Expert parallelism composed with ZeRO (and the data-parallel traffic it leaves): float64, exact.

Each run trains the loop MoE (one ``nn.ModuleList`` expert per tensor) or Mixtral's eager experts (stacked
``(E, ...)`` weights) with AdamW for several steps and compares loss, output and every parameter with one
device within 1e-12 relative (``assert_equivalent``). Under ZeRO the routed experts' parameters, gradients and
optimizer state are sharded over the ranks holding the same experts (``ep_replicate``), the others over dp.
"""
from __future__ import annotations

import functools

import pytest
import torch

import models
from autopar import Mesh, parallelize
from autopar.testing import assert_equivalent
from harness.mixed import assert_mixed
from harness.training import assert_resumes_like_one_run, scheduled_steps

IDS8 = torch.randint(3, 96, (8, 8), generator=torch.Generator().manual_seed(3))
TARGET8 = torch.randint(3, 96, (8, 8), generator=torch.Generator().manual_seed(4))
LOOP = models.factory(models.loop_moe, aux=False)
MIXTRAL = models.factory(models.mixtral_eager, layers=1, aux=False)


def _exact(make, mesh: Mesh, launcher, **options) -> None:
    assert_equivalent(make, mesh, (IDS8,), TARGET8, models.lm_loss, models.adamw, steps=2, rtol=1e-9, atol=1e-10,
                      launcher=launcher, **options)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_shards_expert_state_over_the_ranks_holding_each_expert(launcher, zero: int) -> None:
    """dp=4, ep=2: every expert has two replicas, whose gradients and AdamW state are split between them."""
    _exact(LOOP, Mesh(dp=4, ep=2), launcher, zero=zero)


@pytest.mark.parametrize("zero", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3])
def test_zero_with_stacked_experts(launcher, zero: int) -> None:
    _exact(MIXTRAL, Mesh(dp=4, ep=2), launcher, zero=zero)


@pytest.mark.parametrize("make, mesh, zero", [
    (LOOP, Mesh(dp=(2, 2), ep=2), 2),
    pytest.param(LOOP, Mesh(dp=(2, 2), ep=2), 1, marks=pytest.mark.slow),
    pytest.param(LOOP, Mesh(dp=(2, 2), ep=2), 3, marks=pytest.mark.slow),
    pytest.param(LOOP, Mesh(dp=(2, 4), ep=2), 3, marks=pytest.mark.slow),
    pytest.param(MIXTRAL, Mesh(dp=(2, 4), ep=2), 2, marks=pytest.mark.slow),
], ids=["loop-2x2-zero2", "loop-2x2-zero1", "loop-2x2-zero3", "loop-2x4-zero3", "mixtral-2x4-zero2"])
def test_hybrid_sharding_shards_expert_state_inside_each_replica(launcher, make, mesh: Mesh, zero: int) -> None:
    """dp=(replicate, shard) with ep dividing the shard size: each ep group exchanges tokens inside one replica;
    the routed experts' state is sharded over the ranks of a replica holding the same experts (``ep_shard``) and
    averaged over the replicas like the rest (docs/decisions.md)."""
    _exact(make, mesh, launcher, zero=zero)



def _formula(dense: int, experts: int, mesh: Mesh, zero: int) -> dict[str, int]:
    """ZeRO's bytes per rank with the routed experts split over ep first: dense state over dp, this rank's
    experts (``experts / ep``) over their ``dp / ep`` replicas; AdamW keeps two elements per parameter."""
    held, replicas = experts // mesh.ep, mesh.dp // mesh.ep
    sharded = dense // mesh.dp + held // replicas
    return {"parameters": dense + held if zero < 3 else sharded, "gradients": dense + held if zero == 1 else sharded,
            "optimizer": 2 * sharded}


def _memory(make, mesh: Mesh, zero: int) -> tuple[dict, dict, dict]:
    model = make()
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() * p.element_size() for p in model.parameters()) - experts
    pm = parallelize(model, mesh, loss_fn=models.lm_loss, optimizer=models.adamw, zero=zero,
                     example_inputs=(IDS8,), example_target=TARGET8)
    pm.step(IDS8, target=TARGET8)
    return pm.memory(), dict(pm.plan.memory), _formula(dense, experts, mesh, zero)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_memory_per_rank_divides_expert_state_by_ep_then_by_its_replicas(launcher, zero: int) -> None:
    """Measured on every rank after a step, within 5% of the formula and of the plan (the flat groups' padding);
    every expert on every rank would hold 49% more parameter bytes (148,992 against 99,840)."""
    mesh = Mesh(dp=4, ep=2)
    for measured, planned, formula in launcher(_memory, mesh.size, LOOP, mesh, zero):
        for key, want in formula.items():
            assert measured[key] == pytest.approx(want, rel=0.05), (key, measured, formula)
            assert planned[key] == pytest.approx(want, rel=0.05), (key, planned, formula)


def _gradient_traffic(mesh: Mesh, zero: int, calls: bool) -> tuple[dict, dict]:
    """Bytes (or calls) per op@axis of the gradient and ZeRO collectives on dp and ep_replicate: (planned, measured
    in one step)."""
    pm = parallelize(LOOP(), mesh, loss_fn=models.lm_loss, optimizer=models.adamw, zero=zero,
                     example_inputs=(IDS8,), example_target=TARGET8)
    pm.step(IDS8, target=TARGET8)
    planned: dict[str, int] = {}
    for c in pm.plan.collectives:
        if c.axis in ("dp", "ep_replicate"):
            key = f"{'zero_' if zero else ''}{c.op}@{c.axis}"
            planned[key] = planned.get(key, 0) + (c.count if calls else c.bytes)
    measured = {k: v for k, v in pm.communication(calls=calls).items() if k.split("@")[1] in ("dp", "ep_replicate")}
    return planned, measured


@pytest.mark.parametrize("mesh, zero", [(Mesh(dp=4, ep=2), 0), (Mesh(dp=2, ep=2), 0), (Mesh(dp=4, ep=2), 2)],
                         ids=["dp4-ep2", "dp2-ep2", "dp4-ep2-zero2"])
def test_expert_gradients_travel_over_ep_replicate_not_dp(launcher, mesh: Mesh, zero: int) -> None:
    """The plan's data-parallel bytes leave the routed experts out: they are reduced among the ranks holding the
    same experts (none at dp=ep), and one step runs what the plan counts on each axis (bytes; under ZeRO, whose
    all-gathers count their input shard at run time, calls, and the reduce-scatters' bytes)."""
    model = LOOP()
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() * p.element_size() for p in model.parameters()) - experts
    for planned, measured in launcher(_gradient_traffic, mesh.size, mesh, zero, bool(zero)):
        assert planned == measured
        if not zero:
            want = {"all_reduce@dp": dense} | ({"all_reduce@ep_replicate": experts // mesh.ep} if mesh.dp > mesh.ep
                                               else {})
            assert measured == want
    if zero:
        planned, measured = launcher(_gradient_traffic, mesh.size, mesh, zero, False)[0]
        assert measured["zero_reduce_scatter@ep_replicate"] == planned["zero_reduce_scatter@ep_replicate"] \
            == experts // mesh.ep
        assert measured["zero_reduce_scatter@dp"] == planned["zero_reduce_scatter@dp"] == -(-dense // 4) * 4


def test_pipeline_stages_hold_their_layers_experts(launcher) -> None:
    """Mesh(dp=2, pp=2, ep=2): each stage's MoE layer splits its experts over the stage's ep ranks; two
    microbatches, the token all-to-alls inside the stage programs."""
    _exact(LOOP, Mesh(dp=2, pp=2, ep=2), launcher, microbatches=2)


def _ep_calls(mesh: Mesh, **options) -> tuple[dict, dict, dict]:
    """Calls per step of the ep collectives, (planned, measured), and the layers' recomputation modes."""
    pm = parallelize(LOOP(), mesh, loss_fn=models.lm_loss, optimizer=models.adamw, example_inputs=(IDS8,),
                     example_target=TARGET8, **options)
    pm.step(IDS8, target=TARGET8)
    planned: dict[str, int] = {}
    for c in pm.plan.collectives:
        if c.axis == "ep":
            planned[f"{c.op}@ep"] = planned.get(f"{c.op}@ep", 0) + c.count
    measured = {k: v for k, v in pm.communication(calls=True).items() if k.endswith("@ep")}
    return planned, measured, dict(pm.plan.recompute.modes) if pm.plan.recompute else {}


def test_each_pp_rank_exchanges_the_tokens_of_its_own_layers(launcher) -> None:
    """Two MoE layers on two pp ranks, two microbatches: each rank runs one layer's exchanges per microbatch
    (2 counts exchanges, 8 token all-to-alls per step), as the plan counts."""
    for planned, measured, _ in launcher(functools.partial(_ep_calls, Mesh(dp=2, pp=2, ep=2), microbatches=2), 4):
        assert planned == measured == {"all_to_all@ep": 2, "all_to_all_v@ep": 8}


@pytest.mark.slow
def test_pipeline_stages_hold_their_layers_stacked_experts(launcher) -> None:
    _exact(models.factory(models.mixtral_eager, layers=2, aux=False), Mesh(dp=2, pp=2, ep=2), launcher,
           microbatches=2)


@pytest.mark.parametrize("make", [pytest.param(MIXTRAL, id="mixtral"), pytest.param(
    models.factory(models.loop_moe, aux=False, shared=False), id="loop", marks=pytest.mark.slow)])
def test_tensor_parallel_keeps_each_ranks_experts_whole(launcher, make) -> None:
    """Mesh(dp=2, tp=2, ep=2): attention and the rest split over tp, each rank's experts whole (docs/decisions.md).
    (The loop MoE's shared expert is left out: its tp-sharded AdamW update is 2.3e-12 off one device with tp
    alone, Mesh(dp=2, tp=2), the order of tp's partial sums, not expert parallelism's.)"""
    _exact(make, Mesh(dp=2, tp=2, ep=2), launcher)


def test_the_plan_keeps_experts_whole_on_tp_and_shards_the_rest() -> None:
    pm = parallelize(MIXTRAL(), Mesh(dp=2, tp=2, ep=2), example_inputs=(IDS8,), example_target=TARGET8,
                     loss_fn=models.lm_loss)
    text = str(pm.plan)
    assert "model.layers.0.mlp.experts.down_proj            [4, 32, 64]      (dp: Replicate(), tp: R); experts" in text
    assert "model.layers.0.self_attn.q_proj.weight          [32, 32]         (dp: Replicate(), tp: S(0))" in text
    assert "ranks [0, 1]: experts 0-1; ranks [2, 3]: experts 2-3" in text  # tp peers hold the same experts


@pytest.mark.parametrize("mode", ["full", pytest.param("selective", marks=pytest.mark.slow)])
def test_recomputation_replays_the_exchanges_with_the_same_routing(launcher, mode: str) -> None:
    """Each MoE layer recomputed in backward, its token exchanges included: the same inputs give the same
    routing and splits on every rank (docs/decisions.md)."""
    _exact(LOOP, Mesh(dp=2, ep=2), launcher, recompute=mode)


def test_recomputation_repeats_the_exchanges_of_the_layers_it_replays(launcher) -> None:
    """Both MoE layers replayed in backward: per layer one more counts exchange and two more token all-to-alls
    per step than without (2 + 2 and 8 + 4 in all), as the plan counts."""
    none = launcher(functools.partial(_ep_calls, Mesh(dp=2, ep=2), recompute="none"), 2)[0]
    assert none[0] == none[1] == {"all_to_all@ep": 2, "all_to_all_v@ep": 8}
    for planned, measured, modes in launcher(functools.partial(_ep_calls, Mesh(dp=2, ep=2), recompute="full"), 2):
        assert modes["moes.0"] == modes["moes.1"] == "full"
        assert planned == measured == {"all_to_all@ep": 4, "all_to_all_v@ep": 12}


@pytest.mark.parametrize("precision", ["bf16", pytest.param("mixed", marks=pytest.mark.slow)])
def test_mixed_precision_with_experts_over_ep(launcher, precision: str) -> None:
    """bf16 compute (float32 masters under "mixed") against the same policy run eagerly on one device; SGD, so each
    parameter's own update is bounded too (``harness/mixed.py``: a gradient off by a factor fails)."""
    assert_mixed(models.factory(models.loop_moe, aux=False, dtype=torch.float32), Mesh(dp=2, ep=2), (IDS8,), TARGET8,
                 models.lm_loss, models.sgd, 3, launcher, precision)


def _leg(make, mesh: Mesh, zero: int, path: str, *, load: bool, save: bool) -> dict:
    """One step on ``mesh`` under ``zero``, after loading ``path`` into a model of other weights when asked."""
    pm = parallelize(make(seed=7 if load else 0), mesh, loss_fn=models.lm_loss, optimizer=models.adamw, zero=zero,
                     example_inputs=(IDS8,), example_target=TARGET8)
    losses = scheduled_steps(pm, (IDS8,), TARGET8, 1, path=path, load=load, save=save)
    state = pm.state_dict()
    return {"losses": losses, "state": state if torch.distributed.get_rank() == 0 else None}


@pytest.mark.parametrize("make", [pytest.param(LOOP, id="loop"), pytest.param(MIXTRAL, id="mixtral",
                                                                               marks=pytest.mark.slow)])
def test_zero_checkpoints_with_experts_move_between_meshes(launcher, tmp_path, make) -> None:
    """Saved under ZeRO-2 with ep=2 (each rank writes its shard of its experts, AdamW state included), resumed
    under ZeRO-3 at dp=2, ep=2 and then on one device: losses and final state equal one uninterrupted run."""
    legs = [(Mesh(dp=4, ep=2), (2,)), (Mesh(dp=2, ep=2), (3,)), (Mesh(dp=1), (0,))]
    assert_resumes_like_one_run(launcher, _leg, legs, make, (IDS8,), TARGET8, models.lm_loss, models.adamw,
                                str(tmp_path / "ckpt"))


@pytest.mark.slow
@pytest.mark.parametrize("mesh, zero", [(Mesh(dp=2, tp=2, ep=2), 2), (Mesh(dp=2, tp=2, ep=2), 3),
                                        (Mesh(dp=2, pp=2, ep=2), 2), (Mesh(dp=2, pp=2, ep=2), 3)],
                         ids=["tp-zero2", "tp-zero3", "pp-zero2", "pp-zero3"])
def test_zero_with_experts_composes_with_tp_and_pp(launcher, mesh: Mesh, zero: int) -> None:
    _exact(models.factory(models.mixtral_eager, layers=2, aux=False), mesh, launcher, zero=zero,
           microbatches=2 if mesh.pp > 1 else 1)


@pytest.mark.parametrize("mesh, zero", [(Mesh(dp=4, ep=2), 2), pytest.param(Mesh(dp=(2, 4), ep=2), 3,
                                                                            marks=pytest.mark.slow)],
                         ids=["zero2", "hybrid-zero3"])
def test_clipping_counts_each_expert_slice_once_under_zero(launcher, mesh: Mesh, zero: int) -> None:
    """The global norm over ZeRO's slices: a slice of routed experts is held by one rank of its ``ep_shard`` group
    and by each replica; SGD with a bound that clips."""
    assert_equivalent(LOOP, mesh, (IDS8,), TARGET8, models.lm_loss, models.sgd, steps=2, rtol=1e-9, atol=1e-10,
                      launcher=launcher, zero=zero, max_grad_norm=0.05)
