"""Zero-bubble pipelines: each backward split into B (input gradients) and W (weight gradients), run exactly."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import models
from autopar import Mesh, parallelize
from autopar.core.schedule import W, Action, add_communication, one_f_one_b, zb_h1
from autopar.core.schedules import make_schedule
from autopar.core.simulate import render, simulate
from autopar.core.weight_grad import collect, split_linear
from autopar.core.zero_bubble import zbv
from autopar.passes.split_backward import defer_weight_gradients
from autopar.testing import assert_equivalent
from harness.probe import assert_split_backward_ran, probed

IDS = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(2))


# --- the schedule ---------------------------------------------------------------------------------


@pytest.mark.parametrize("p, m", [(2, 2), (2, 8), (3, 7), (4, 8), (4, 16), (8, 16)])
def test_zb_h1_has_a_third_of_1f1bs_bubble_at_its_peak_memory(p: int, m: int) -> None:
    """With W as long as B (F=B=W), the bubble is (p - 1)(F + B - W): a third of 1F1B's (p - 1)(F + B + W)."""
    zb = simulate(zb_h1(p, m), forward_time=1, backward_time=2, weight_time=1)
    base = simulate(one_f_one_b(p, m), forward_time=1, backward_time=2)
    assert zb.makespan == 3 * m + (p - 1) and base.makespan == 3 * m + 3 * (p - 1)
    assert zb.bubble_fraction <= 0.5 * base.bubble_fraction
    assert max(zb.peak_in_flight) == max(base.peak_in_flight) == min(p, m)


def test_zb_h1_picture() -> None:
    assert render(zb_h1(2, 4)).splitlines()[1:] == [
        "rank 0 F0 F1 .  B0 W0 F2 B1 W1 F3 B2 W2 B3 W3",
        "rank 1 .  F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3",
    ]
    assert make_schedule("zb-h1", 2, 4).splits_backward


@pytest.mark.parametrize("p, m", [(2, 2), (2, 4), (3, 5), (4, 8), (4, 16), (8, 16)])
def test_zbv_bubble_and_memory(p: int, m: int) -> None:
    """The V: under F=B=W, less bubble than ZB-H1 (which has a third of 1F1B's), within 1F1B's activation memory:
    at most 2p half-size stages in flight on a rank (1F1B holds p whole ones on its first rank)."""
    schedule = zbv(p, m)
    assert schedule.stage_to_rank == tuple(range(p)) + tuple(reversed(range(p)))
    v = simulate(add_communication(schedule), forward_time=1, backward_time=2, weight_time=1)
    h1 = simulate(zb_h1(p, m), forward_time=1, backward_time=2, weight_time=1)
    assert v.bubble_fraction <= h1.bubble_fraction
    for rank in range(p):
        assert sum(v.peak_in_flight[s] for s in schedule.stages_of(rank)) <= 2 * p + 1


def test_zbv_picture() -> None:
    assert render(zbv(2, 2)).splitlines()[1:] == [
        "rank 0 0F0 0F1 .   3F0 3B0 3F1 3B1 0B0 3W0 0B1 3W1 0W0 0W1",
        "rank 1 .   1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1 2W0 1W0 2W1 1W1",
    ]


# --- the ops and the pass -------------------------------------------------------------------------


def test_a_deferred_weight_gradient_is_the_same_gradient() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    (torch.nn.functional.linear(x, w, b) ** 2).sum().backward()
    expected = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    with collect() as deferred:
        (split_linear(x, w, b) ** 2).sum().backward()
    assert w.grad is None and x.grad is not None and b.grad is not None  # B: input and bias gradients only
    deferred.run()  # W
    for t, e in zip((x, w, b), expected):
        torch.testing.assert_close(t.grad, e, rtol=1e-14, atol=1e-14)


def test_the_pass_splits_trainable_weight_matmuls_only() -> None:
    from autopar.compiler.capture import capture

    model = models.factory(models.gpt2, layers=2)()
    cap = capture(model, (IDS[:2],), {}, with_loss=True, loss_fn=models.lm_loss, target=TARGET[:2])
    trainable = {n for n, p in model.named_parameters()} - {"transformer.h.0.mlp.c_fc.weight"}
    gm, count = defer_weight_gradients(cap.gm, cap.slots, trainable)
    # 4 Conv1D weights per block and the tied head, less the frozen one
    assert count == 4 * 2 + 1 - 1
    assert sum(n.target is split_linear for n in gm.graph.nodes) == 1  # the head: linear(x, wte)


# --- equivalence on gloo ranks --------------------------------------------------------------------


def _run(launcher, name: str, mesh: Mesh, **kw) -> None:
    """Exact against one device, and every rank ran W actions that computed weight gradients (a fallback to
    1F1B, or a backward that leaves W nothing, would be exact too)."""
    make = models.factory(getattr(models, name), layers=4)
    kw.setdefault("schedule", "zb-h1")
    runs = assert_equivalent(make, mesh, (IDS,), TARGET, models.lm_loss, models.adamw, steps=2,
                             launcher=probed(launcher), **kw)
    assert_split_backward_ran(runs)


@pytest.mark.parametrize("name", ["gpt2", pytest.param("llama", marks=pytest.mark.slow),
                                  pytest.param("bert", marks=pytest.mark.slow)])
def test_zb_h1_pp2_is_exact(launcher, name: str) -> None:
    _run(launcher, name, Mesh(pp=2), microbatches=4)


@pytest.mark.slow
def test_zb_h1_pp4_tied_embeddings(launcher) -> None:
    _run(launcher, "gpt2", Mesh(pp=4), microbatches=8)


@pytest.mark.parametrize("name", [pytest.param("gpt2", marks=pytest.mark.slow), "llama", "bert"])
def test_zbv_pp2_is_exact(launcher, name: str) -> None:
    """The V puts the first and the last stage on rank 0: GPT-2's tied embedding is used by two of its stages."""
    _run(launcher, name, Mesh(pp=2), microbatches=4, schedule="zbv")


@pytest.mark.parametrize("mesh, zero", [pytest.param(Mesh(dp=2, pp=2), 0, marks=pytest.mark.slow),
                                        (Mesh(dp=2, pp=2), 1),
                                        pytest.param(Mesh(dp=2, pp=2), 2, marks=pytest.mark.slow),
                                        (Mesh(pp=2, tp=2), 0)])
def test_zb_h1_with_dp_zero_and_tp(launcher, mesh: Mesh, zero: int) -> None:
    _run(launcher, "llama", mesh, microbatches=2, zero=zero)


@pytest.mark.parametrize("mesh, zero", [(Mesh(dp=2, pp=2), 2), pytest.param(Mesh(pp=2, tp=2), 0,
                                                                            marks=pytest.mark.slow)])
def test_zbv_with_dp_zero_and_tp(launcher, mesh: Mesh, zero: int) -> None:
    _run(launcher, "gpt2", mesh, microbatches=2, zero=zero, schedule="zbv")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_zero_bubble_pp4(launcher, name: str, schedule: str) -> None:
    _run(launcher, name, Mesh(pp=4), microbatches=8, schedule=schedule)


@pytest.mark.parametrize("name, schedule", [("gpt2", "zb-h1"), pytest.param("llama", "zbv",
                                                                             marks=pytest.mark.slow)])
def test_zero3_with_a_split_backward(launcher, name: str, schedule: str) -> None:
    """A layer's gathered parameters get their gradients in B (norms, biases) and W (weight matmuls): the
    gather's backward reduce-scatters each part as it completes, and the shard sums them."""
    _run(launcher, name, Mesh(dp=2, pp=2), microbatches=2, zero=3, schedule=schedule)


def _peak() -> tuple[dict[int, int], list[str]]:
    torch.manual_seed(0)
    pm = parallelize(models.factory(models.gpt2, layers=2)(), Mesh(pp=2), loss_fn=models.lm_loss,
                     optimizer=models.adamw, schedule="zb-h1", microbatches=4)
    pm.step(IDS, target=TARGET)
    return pm.runtime.executor.peak_in_flight, [a for a, _, _ in pm.timeline()]


def test_the_runtime_runs_the_simulated_program(launcher) -> None:
    expected = simulate(zb_h1(2, 4)).peak_in_flight
    for rank, (peak, timeline) in enumerate(launcher(_peak, 2)):
        assert peak == {rank: expected[rank]}
        assert sorted(str(a) for a in map(Action.parse, timeline) if a.kind == W) == [f"{rank}W{m}" for m in range(4)]


def _gradient_tensors(schedule: str) -> tuple[list[bool], dict[str, int]]:
    """Per step after the first, whether each matmul weight's gradient at the optimizer is last step's tensor;
    ``pm.memory()``."""
    import weakref

    torch.manual_seed(0)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pm = parallelize(models.mlp((6, 16, 16, 16, 6)), Mesh(pp=2), loss_fn=models.mse, optimizer=models.adamw,
                     schedule=schedule, microbatches=4)
    pm.step(x, target=y)
    weights = [p for p in pm.parameters() if p.dim() == 2 and p.requires_grad]
    last: list = []
    same: list[bool] = []

    def seen(*_) -> None:
        same.extend(ref() is w.grad for ref, w in zip(last, weights))
        last[:] = [weakref.ref(w.grad) for w in weights]
    pm.optimizer.register_step_pre_hook(seen)
    for _ in range(3):
        pm.step(x, target=y)
    assert all(w.grad is None for w in weights)  # freed for the optimizer's and the user's eyes
    return same, pm.memory()


def test_w_writes_into_last_steps_gradient_tensors(launcher) -> None:
    """A split backward's W writes each weight gradient into the tensor of the step before (resident memory, no
    fresh pages), where 1F1B's backward makes new ones; ``pm.memory()`` counts the same bytes for both."""
    for (zb, zb_memory), (base, base_memory) in zip(launcher(_gradient_tensors, 2, "zb-h1"),
                                                    launcher(_gradient_tensors, 2, "1f1b")):
        assert len(zb) > 0 and all(zb)
        assert not any(base)
        assert zb_memory == base_memory


# --- the planner ----------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 8, 9, 12, 16, 32])
def test_the_planners_zero_bubble_waits_are_the_simulators(p: int) -> None:
    """The planner's wait of a zero-bubble schedule is the simulated wait of the schedule autopar runs.

    With F, B and W a step each, ZB-H1 waits p - 1 steps once m >= p; ZBV's list scheduling waits p - 1 up to
    p = 4 and irregularly more beyond (19 steps for p = 16 where a closed form p - 1 said 15). With B longer
    than F, ZBV's programs (ordered as if every action took a step) wait longer with every microbatch.
    """
    from autopar.planner.bubble import Bubbles

    bubbles = Bubbles()
    for m in sorted({1, p - 1, p, p + 1, 2 * p, 3 * p} - {0}):
        h1 = simulate(zb_h1(p, m), forward_time=1, backward_time=2, weight_time=1)
        assert h1.makespan - 3 * m == pytest.approx(3 * bubbles.idle("zb-h1", p, m, (1, 1, 1)))
        if m >= p:
            assert h1.makespan - 3 * m == p - 1
        v = simulate(zbv(p, m), forward_time=1, backward_time=2, weight_time=1)
        assert v.makespan - 6 * m == pytest.approx(3 * bubbles.idle("zbv", p, m, (1, 1, 1)))
        slow_b = simulate(zbv(p, m), forward_time=3, backward_time=7, weight_time=3)  # B takes 4, F and W 3
        assert slow_b.makespan - 20 * m == pytest.approx(10 * bubbles.idle("zbv", p, m, (3, 4, 3)))
    if p == 16:
        assert 3 * bubbles.idle("zbv", p, 2 * p, (1, 1, 1)) == pytest.approx(19)


def _reduce_scatters(schedule: str) -> tuple[int, int, int]:
    torch.manual_seed(0)
    pm = parallelize(models.factory(models.gpt2, layers=4)(), Mesh(dp=2, pp=2), loss_fn=models.lm_loss,
                     optimizer=models.adamw, schedule=schedule, microbatches=2, zero=3)
    pm.step(IDS, target=TARGET)
    op = "zero_reduce_scatter@dp"
    return pm.mesh.coords(torch.distributed.get_rank()).pp, pm.communication(calls=True)[op], \
        pm.communication()[op]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_planner_counts_zero3s_reduce_scatters_as_they_run(launcher, schedule: str) -> None:
    """Under a split backward ZeRO-3 reduce-scatters a layer's whole flat gradient when B finishes and once
    again when W lands its weight gradients (all of them through one autograd call), not once per weight
    matmul; groups without weight matmuls once. The planner charges the calls and bytes the runtime counts,
    rank by rank."""
    from autopar.planner.cluster import Cluster
    from autopar.planner.cost_model import Config, CostModel, precision_of
    from autopar.planner.model_profile import profile_model

    profile = profile_model(models.factory(models.gpt2, layers=4)(), example_inputs=(IDS[:2],), tp_sizes=(1,))
    cost = CostModel(profile, Cluster.preset("cpu"), precision_of(torch.float64), seq_len=IDS.shape[1])
    config = Config(dp=2, pp=2, zero=3, schedule=schedule, microbatches=2, microbatch_size=2)
    predicted = cost.zero3_reduce_scatters(config)
    whole = cost.zero3_reduce_scatters(config, split=False)
    for pp, calls, nbytes in launcher(_reduce_scatters, 4, schedule):
        assert (calls, nbytes) == predicted[pp]
        if schedule == "zb-h1":
            assert whole[pp][0] < calls <= 2 * whole[pp][0] and nbytes <= 2 * whole[pp][1]  # at most twice over
        else:
            assert (calls, nbytes) == whole[pp]


def test_the_plan_charges_and_explains_zero3s_repeated_reduce_scatters() -> None:
    from autopar.planner import plan
    from autopar.planner.cluster import Cluster
    from autopar.planner.cost_model import Config, CostModel, precision_of
    from autopar.planner.model_profile import profile_model

    profile = profile_model(models.factory(models.gpt2, layers=4)(), example_inputs=(IDS[:2],), tp_sizes=(1,))
    exposed = Cluster.preset("cpu").replace(contention=1.0, cores=0)  # overlap buys nothing; no cores shared
    cost = CostModel(profile, exposed, precision_of(torch.float64), seq_len=IDS.shape[1])
    split, whole = (Config(dp=2, pp=2, zero=3, schedule=s, microbatches=2, microbatch_size=2)
                    for s in ("zb-h1", "1f1b"))
    dp = lambda c: float(cost.estimate(c).time["data_parallel"] + cost.estimate(c).time["contention"])  # noqa: E731
    assert dp(split) > dp(whole)
    zero1 = [dp(dataclasses.replace(c, zero=1)) for c in (split, whole)]
    assert zero1[0] == pytest.approx(zero1[1])  # below stage 3 the gradients are reduced once, in buckets
    result = plan(None, 4, cluster=exposed, global_batch=8, seq_len=IDS.shape[1], profile=profile,
                  precision="fp64", tp=(1,), pp=(2,), zero=(3,), schedules=("zb-h1",), recompute=("none",))
    assert result.best.config.schedule == "zb-h1" and result.best.config.zero == 3
    calls, nbytes = max(cost.zero3_reduce_scatters(result.best.config), key=lambda x: x[1])
    assert (f"zero=3 with zb-h1: each layer's gradients are reduce-scattered after B and again after each of its "
            f"weight gradients in W, {calls:,} times per step") in str(result)
