"""Expert parallelism (``Mesh(dp=.., ep=..)``): each rank computes its experts on the tokens routed to them.

Every run is float64 and compared with single-device training within 1e-12 relative (loss per step, output,
every parameter after several optimizer steps), the experts of every ep rank gathered back by
``pm.state_dict()``. The load-balancing loss is a statistic of each data-parallel rank's batch (as in every
data-parallel MoE): with it, the run is compared exactly with one device on the same split (``control``).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import models
from autopar import Mesh, UnsupportedError, parallelize
from autopar.testing import assert_equivalent
from harness.training import assert_resumes_like_one_run, scheduled_steps

IDS = torch.randint(3, 96, (4, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(3, 96, (4, 8), generator=torch.Generator().manual_seed(2))
IDS8 = torch.randint(3, 96, (8, 8), generator=torch.Generator().manual_seed(3))
TARGET8 = torch.randint(3, 96, (8, 8), generator=torch.Generator().manual_seed(4))
LOOP = models.factory(models.loop_moe, aux=False)
MIXTRAL = models.factory(models.mixtral_eager, layers=1, aux=False)


def _exact(make, mesh: Mesh, optimizer, launcher, *, ids=IDS, target=TARGET) -> None:
    assert_equivalent(make, mesh, (ids,), target, models.lm_loss, optimizer, steps=3, rtol=1e-9, atol=1e-10,
                      launcher=launcher)


def test_loop_moe_trains_exactly_with_its_experts_split_over_two_ranks(launcher) -> None:
    """Mesh(dp=2, ep=2): experts 0-1 on rank 0, 2-3 on rank 1; tokens travel by all-to-all. SGD: its update is
    the gradient, so an expert gradient off by a constant factor fails too."""
    _exact(LOOP, Mesh(dp=2, ep=2), models.sgd, launcher)


def test_mixtral_eager_trains_exactly_with_stacked_experts_split(launcher) -> None:
    """Hugging Face's stacked (E, ...) expert weights held as E/ep rows per rank; AdamW."""
    _exact(MIXTRAL, Mesh(dp=2, ep=2), models.adamw, launcher)


def test_the_two_holders_of_each_expert_sum_their_gradients(launcher) -> None:
    """Mesh(dp=4, ep=2): each expert lives on two ranks (its ep_replicate group), whose gradients of their own
    tokens are all-reduced there; SGD, so an expert gradient that misses the other holder's tokens fails. (The
    traffic on ep_replicate is counted in test_expert_compose.py; this is the numbers.)"""
    _exact(LOOP, Mesh(dp=4, ep=2), models.sgd, launcher, ids=IDS8, target=TARGET8)


@pytest.mark.slow
@pytest.mark.parametrize("make, mesh, optimizer", [
    (LOOP, Mesh(dp=2, ep=2), models.adamw),
    (LOOP, Mesh(dp=4, ep=4), models.adamw),
    (LOOP, Mesh(dp=4, ep=2), models.adamw),  # two replicas of each expert: gradients averaged over them
    (models.factory(models.loop_moe, aux=False, score="sigmoid", shared=False, top_k=1), Mesh(dp=4, ep=2), models.sgd),
    (MIXTRAL, Mesh(dp=2, ep=2), models.sgd),
    (MIXTRAL, Mesh(dp=4, ep=4), models.adamw),
    (models.factory(models.qwen3_moe_eager, layers=1, aux=False), Mesh(dp=2, ep=2), models.adamw),
    (models.factory(models.qwen3_moe_eager, layers=1, aux=False), Mesh(dp=4, ep=4), models.sgd),
], ids=["loop-ep2-adamw", "loop-ep4", "loop-dp4-ep2", "loop-sigmoid-top1-dp4-ep2", "mixtral-ep2-sgd",
        "mixtral-ep4", "qwen3-ep2", "qwen3-ep4-sgd"])
def test_expert_parallel_is_exact(launcher, make, mesh: Mesh, optimizer) -> None:
    _exact(make, mesh, optimizer, launcher, ids=IDS8, target=TARGET8)


def _global_norm() -> float:
    pm = parallelize(LOOP(), Mesh(dp=2, ep=2), loss_fn=models.lm_loss, optimizer=models.sgd, max_grad_norm=1e9)
    pm.step(IDS, target=TARGET)
    return pm.grad_norm


def test_the_global_norm_counts_each_expert_once(launcher) -> None:
    """Mesh(dp=2, ep=2): each expert's gradient is held by one rank, the rest by both: the global norm is
    the single-device one (the clipped runs below are -m slow)."""
    model = LOOP()
    models.lm_loss(model(IDS), TARGET).backward()
    want = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    for norm in launcher(_global_norm, 2):
        assert norm == pytest.approx(want, rel=1e-12)


@pytest.mark.slow
def test_gradient_clipping_counts_each_expert_once(launcher) -> None:
    """The global norm sums each expert's gradient over the ranks holding it once (a small bound: it clips)."""
    assert_equivalent(LOOP, Mesh(dp=4, ep=2), (IDS8,), TARGET8, models.lm_loss, models.sgd, steps=3, rtol=1e-9,
                      atol=1e-10, launcher=launcher, max_grad_norm=0.05)


@pytest.mark.slow
def test_microbatches_accumulate_expert_gradients_before_the_reduction(launcher) -> None:
    assert_equivalent(LOOP, Mesh(dp=4, ep=2), (IDS8,), TARGET8, models.lm_loss, models.sgd, steps=3, rtol=1e-9,
                      atol=1e-10, launcher=launcher, microbatches=2)


@pytest.mark.slow
def test_load_balancing_loss_and_router_gradient_are_the_models(launcher) -> None:
    """With the auxiliary loss in the loss: within 1e-12 of one device on the same split of the batch (each
    dp rank's loss balances its own tokens, which moves the result by ~0.15 from the whole batch's)."""
    assert_equivalent(models.factory(models.loop_moe), Mesh(dp=4, ep=2), (IDS8,), TARGET8, models.moe_loss,
                      models.adamw, steps=3, control=True, control_rtol=0.5, rtol=1.0, atol=1.0, launcher=launcher)


@pytest.mark.slow
def test_deepseek_v3_experts_over_ep(launcher) -> None:
    """Shared experts and a grouped top-k over a biased sigmoid router; its router runs in float32, so exact
    against one device on the same split (as its data-parallel test)."""
    assert_equivalent(models.factory(models.deepseek_v3), Mesh(dp=4, ep=4), (IDS8,), TARGET8, models.lm_loss,
                      models.adamw, steps=2, control=True, rtol=1e-5, atol=1e-6, launcher=launcher)


def test_the_plan_shows_each_ranks_experts_and_the_all_to_alls() -> None:
    pm = parallelize(LOOP(), Mesh(dp=4, ep=2), example_inputs=(IDS8,), example_target=TARGET8, loss_fn=models.lm_loss)
    text = str(pm.plan)
    assert "expert parallelism: ep=2 folded onto dp=4" in text
    assert "moes.0 (LoopMoE): 4 experts, top-2; ranks [0, 2]: experts 0-1; ranks [1, 3]: experts 2-3" in text
    assert "expert 3 of moes.1 (LoopMoE): held by ep index 1" in text
    ops = {(c.op, c.direction): c.count for c in pm.plan.collectives if c.axis == "ep"}
    assert ops == {("all_to_all", "forward"): 2, ("all_to_all_v", "forward"): 4, ("all_to_all_v", "backward"): 4}
    assert "expert_parallel" in pm.graph(1).code and "where" not in pm.graph(1).code


def _leg(make, mesh: Mesh, steps: int, path: str, *, load: bool, save: bool) -> dict:
    """``steps`` steps on ``mesh``, after loading ``path`` into a model of other weights when asked."""
    pm = parallelize(make(seed=7 if load else 0), mesh, loss_fn=models.lm_loss, optimizer=models.adamw,
                     example_inputs=(IDS8,), example_target=TARGET8)
    losses = scheduled_steps(pm, (IDS8,), TARGET8, steps, path=path, load=load, save=save)
    state = pm.state_dict()  # (every rank gathers)
    return {"losses": losses, "state": state if dist.get_rank() == 0 else None}


@pytest.mark.slow
@pytest.mark.parametrize("make, meshes", [
    (models.factory(models.loop_moe, aux=False), [Mesh(dp=2, ep=2), Mesh(dp=4, ep=4), Mesh(dp=1)]),
    (MIXTRAL, [Mesh(dp=4, ep=2), Mesh(dp=2), Mesh(dp=2, ep=2)]),
    (MIXTRAL, [Mesh(dp=2, tp=2, ep=2), Mesh(dp=1)]),  # experts whole on every tp rank: tp index 0 writes them
    (models.factory(models.loop_moe, aux=False), [Mesh(dp=2, pp=2, ep=2), Mesh(dp=2, ep=2)]),
], ids=["loop", "mixtral", "mixtral-tp", "loop-pp"])
def test_checkpoints_move_between_ep_degrees_and_one_device(launcher, tmp_path, make, meshes: list[Mesh]) -> None:
    """Saved at one ep degree, resumed at another and on one device: the losses and the final state equal one
    uninterrupted single-device run (AdamW's state travels with each expert)."""
    assert_resumes_like_one_run(launcher, _leg, [(mesh, (1,)) for mesh in meshes], make, (IDS8,), TARGET8,
                                models.lm_loss, models.adamw, str(tmp_path / "ckpt"))


def _communication(make, mesh: Mesh) -> tuple[dict, list]:
    pm = parallelize(make(), mesh, loss_fn=models.lm_loss, optimizer=models.sgd)
    pm.step(IDS, target=TARGET)
    ep = {(c.op, c.direction): c.count for c in pm.plan.collectives if c.axis == "ep"}
    return pm.communication(calls=True), sorted(ep.items())


def test_the_runtime_communicates_what_the_plan_counts(launcher) -> None:
    """One step of two MoE layers: per layer the counts' all-to-all, dispatch and combine forward, the same
    two backward, on the ep groups only."""
    for calls, ep in launcher(_communication, 2, LOOP, Mesh(dp=2, ep=2)):
        assert calls["all_to_all@ep"] == 2 and calls["all_to_all_v@ep"] == 8
        assert ep == [(("all_to_all", "forward"), 2), (("all_to_all_v", "backward"), 4),
                      (("all_to_all_v", "forward"), 4)]


def test_experts_that_do_not_divide_by_ep_are_refused() -> None:
    with pytest.raises(UnsupportedError, match=r"module moes.0 \(LoopMoE\): 6 experts do not divide by ep=4; "
                                               r"use ep in \[1, 2, 3, 6\]"):
        parallelize(models.loop_moe(experts=6, aux=False), Mesh(dp=4, ep=4), example_inputs=(IDS8,),
                    example_target=TARGET8, loss_fn=models.lm_loss)


def test_experts_it_does_not_recognise_are_refused() -> None:
    """Hugging Face's batched-matmul experts (every expert on every token, then masked): named, with the switches
    that give a form it takes (tests/test_expert_grouped.py runs the grouped one)."""
    with pytest.raises(UnsupportedError, match=r"ep=2, but MixtralForCausalLM has no routed-experts layer .*run as "
                                               r"'batched_mm': set model.config._experts_implementation = "
                                               r"'grouped_mm' \(Hugging Face's default\) or 'eager'"):
        parallelize(models.mixtral(layers=1, experts_implementation="batched_mm"), Mesh(dp=2, ep=2),
                    example_inputs=(IDS,), example_target=TARGET, loss_fn=models.lm_loss)


class _WeightedInputs(torch.nn.Module):
    """Routing weights applied to each expert's input, not its output: a combine the pass does not take."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(8, 4, bias=False, dtype=torch.float64)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8, dtype=torch.float64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.topk(torch.softmax(self.router(x), dim=-1), 2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out = out.index_add(0, token, expert(x[token] * weights[token, slot, None]))
        return out


def test_a_combine_it_does_not_recognise_is_refused_naming_the_module() -> None:
    x = torch.randn(8, 8, dtype=torch.float64)
    with pytest.raises(UnsupportedError, match=r"cannot take the experts of module <the model> \(_WeightedInputs\): "
                                               r"expert 0's rows are .*linear.*, not its output times its weight"):
        parallelize(_WeightedInputs(), Mesh(dp=2, ep=2), example_inputs=(x,))


def test_ep_must_divide_the_shard_size_under_hybrid_sharding() -> None:
    """Each ep group exchanges tokens inside one replica (docs/decisions.md)."""
    with pytest.raises(ValueError, match=r"ep=4 must divide the shard size 2 of dp=\(2, 2\): each ep group exchanges "
                                         r"tokens inside one replica; use ep in \[1, 2\]"):
        Mesh(dp=(2, 2), ep=4)
    mesh = Mesh(dp=(2, 4), ep=2)
    assert mesh.groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("ep_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]] and mesh.expert_zero_axis == "ep_shard"
    assert mesh.groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]  # same experts, same slice of them
    assert Mesh(dp=8, ep=2).split_dp(4) == mesh


def test_ep_must_divide_dp() -> None:
    with pytest.raises(ValueError, match=r"ep=3 must divide dp=4"):
        Mesh(dp=4, ep=3)
    mesh = Mesh(dp=4, tp=2, ep=2)
    assert mesh.size == 8 and repr(mesh) == "Mesh(dp=4, tp=2, ep=2)"
    assert mesh.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("ep_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
