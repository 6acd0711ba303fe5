"""Zero-bubble pipelines: each backward split into B (input gradients) and W (weight gradients), run exactly."""
from __future__ import annotations

import pytest
import torch

import models
from autopar import Mesh, parallelize
from autopar.core.schedule import W, Action, add_communication, make_schedule, one_f_one_b, zb_h1
from autopar.core.simulate import render, simulate
from autopar.core.weight_grad import collect, split_linear
from autopar.core.zero_bubble import zbv
from autopar.passes.split_backward import defer_weight_gradients
from autopar.testing import assert_equivalent

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
    from autopar.capture import capture

    model = models.factory(models.gpt2, layers=2)()
    cap = capture(model, (IDS[:2],), {}, with_loss=True, loss_fn=models.lm_loss, target=TARGET[:2])
    trainable = {n for n, p in model.named_parameters()} - {"transformer.h.0.mlp.c_fc.weight"}
    gm, count = defer_weight_gradients(cap.gm, cap.slots, trainable)
    # 4 Conv1D weights per block and the tied head, less the frozen one
    assert count == 4 * 2 + 1 - 1
    assert sum(n.target is split_linear for n in gm.graph.nodes) == 1  # the head: linear(x, wte)


# --- equivalence on gloo ranks --------------------------------------------------------------------


def _run(launcher, name: str, mesh: Mesh, **kw) -> None:
    make = models.factory(getattr(models, name), layers=4)
    kw.setdefault("schedule", "zb-h1")
    assert_equivalent(make, mesh, (IDS,), TARGET, models.lm_loss, models.adamw, steps=2, launcher=launcher, **kw)


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


# --- the planner ----------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_the_planners_zero_bubble_formulas_are_the_simulators(p: int) -> None:
    from autopar.planner.cost_model import zero_bubble_units

    for m in range(1, 3 * p + 1):
        h1 = simulate(zb_h1(p, m), forward_time=1, backward_time=2, weight_time=1)
        assert h1.makespan - 3 * m == zero_bubble_units("zb-h1", p, m)
        assert max(h1.peak_in_flight) == min(p, m)
    for m in range(2 * p, 4 * p + 1):
        v = simulate(zbv(p, m), forward_time=1, backward_time=2, weight_time=1)
        assert v.makespan - 6 * m == zero_bubble_units("zbv", p, m)
