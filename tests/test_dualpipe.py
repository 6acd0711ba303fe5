"""DualPipeV: DualPipe cut in half into a V; its phases, what the simulator measures, and exact runs on gloo ranks."""
from __future__ import annotations

import itertools

import pytest
import torch

import models
from autopar import Mesh, parallelize
from autopar.core.dualpipe import dualpipev, min_microbatches, phases
from autopar.core.schedule import F, W, Action, add_communication, one_f_one_b, zb_h1
from autopar.core.schedules import make_schedule
from autopar.core.simulate import Timing, render, simulate
from autopar.core.zero_bubble import v_placement, zbv
from autopar.testing import assert_equivalent
from harness.probe import assert_split_backward_ran, probed

IDS = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(2))
SIZES = [(p, m) for p in range(1, 9) for m in sorted({min_microbatches(p), 2 * p, 2 * p + 1, 3 * p})]


# --- the schedule ---------------------------------------------------------------------------------


def test_the_phases_of_two_ranks() -> None:
    """Warm-up down the V, pairs of an F and a whole backward (B then W) in the steady state, W deferred only in
    the cool-down's second half."""
    assert " ".join(phases(0, 2, 4)) == "F0 F0 F0 F1 B1 W F1 F0 B1W F1 B0W B1W F1 B0W B1W B0 W B0 W"
    assert " ".join(phases(1, 2, 4)) == "F0 F1 F0 F1 F0 B1W F1 B0W F0 B1W F1 B0W B1W B0W B1 B0 W W"
    assert render(dualpipev(2, 4)).splitlines()[1:] == [
        "rank 0 0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3 3B1 3W1 3F2 0B0 0W0 3B2 3W2 3F3 0B1 0W1 3B3 3W3 0B2 0W2 .   0B3 0W3",
        "rank 1 .   1F0 2F0 1F1 2F1 1F2 2B0 2W0 2F2 1B0 1W0 1F3 2B1 2W1 2F3 1B1 1W1 2B2 2W2 1B2 1W2 2B3 1B3 2W3 1W3",
    ]


@pytest.mark.parametrize("p, m", SIZES)
def test_every_size_simulates(p: int, m: int) -> None:
    """Every (stage, microbatch) has one F, B and W, nothing deadlocks with or without communication, and the
    planner's many-durations form times it as the simulator does."""
    schedule = make_schedule("dualpipev", p, m)
    assert schedule.stage_to_rank == v_placement(p) and schedule.splits_backward
    simulate(schedule)
    lowered = simulate(add_communication(schedule), 1.0, 2.5, 0.3, weight_time=1.1)
    assert Timing.of(schedule).makespan(1.0, 2.5, 0.3, weight_time=1.1) == pytest.approx(lowered.makespan)


@pytest.mark.parametrize("p, m", [(2, 2), (3, 4), (4, 6), (8, 14)])
def test_too_few_microbatches_are_refused_with_the_fix(p: int, m: int) -> None:
    with pytest.raises(ValueError, match=rf"dualpipev on pp={p} needs at least 2\*pp - 1 = {2 * p - 1} "
                                         rf"microbatches .* got microbatches={m}; use microbatches={2 * p - 1} or more"):
        dualpipev(p, m)
    with pytest.raises(ValueError, match="places 2 stages per rank"):
        make_schedule("dualpipev", 2, 4, 1)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8, 12, 16])
def test_bubble_and_memory_against_zbv_and_1f1b(p: int) -> None:
    """What DualPipeV buys in this IR, where an F/B pair runs one after the other (no overlap).

    With F, B and W a step each (a V stage is half a 1F1B stage): it waits p - 1 steps at every p, as ZBV does up
    to p = 4 (ZBV's list scheduling waits more beyond: 4 against 5 steps at p = 5, 15 against 19 at p = 16), so
    its bubble is ZBV's or lower, and a third of 1F1B's. It holds 2p + 1 half-stages of activations on every
    rank (2p at m = 2p - 1): one more than ZBV and than 1F1B's first rank (p whole stages).
    """
    for m in (min_microbatches(p), 2 * p, 3 * p):
        dual = simulate(dualpipev(p, m), forward_time=1, backward_time=2, weight_time=1)
        v = simulate(zbv(p, m), forward_time=1, backward_time=2, weight_time=1)
        base = simulate(one_f_one_b(p, m), forward_time=2, backward_time=4)
        assert dual.makespan == 6 * m + p - 1
        assert base.makespan == 6 * m + 6 * (p - 1)
        assert dual.bubble_fraction <= v.bubble_fraction < base.bubble_fraction
        assert max(v.rank_peak_in_flight) == 2 * p == 2 * max(base.rank_peak_in_flight)
        assert set(dual.rank_peak_in_flight) == ({2 * p + 1} if m >= 2 * p else {2 * p, 2 * p + 1})


def test_unequal_times_and_communication() -> None:
    """With B longer than F, W shorter than B, or transfers that take time, DualPipeV's fixed phases never take
    longer than ZBV (whose programs are ordered as if every action took a step and then wait longer with every
    microbatch) nor than ZB-H1 (one stage per rank, twice as long)."""
    for p, k in itertools.product((2, 3, 4, 6, 8), (0, 1, 2, 3)):
        m = min_microbatches(p) + k * p
        dual, v, h1 = Timing.of(dualpipev(p, m)), Timing.of(zbv(p, m)), Timing.of(zb_h1(p, m))
        for b, w, comm in itertools.product((1.0, 1.5, 2.0, 3.0), (0.3, 0.5, 0.7), (0.0, 0.1, 0.5)):
            time = dual.makespan(1.0, b, comm, weight_time=w * b)
            assert time <= v.makespan(1.0, b, comm, weight_time=w * b) + 1e-9, (p, m, b, w, comm)
            assert time <= h1.makespan(2.0, 2 * b, comm, weight_time=2 * w * b) + 1e-9, (p, m, b, w, comm)
    slow_b = [simulate(s, forward_time=3, backward_time=7, weight_time=3).makespan
              for s in (dualpipev(4, 16), zbv(4, 16))]
    assert slow_b == [332, 387]  # B takes 4, F and W 3: 12 and 67 time units of waiting on top of 320 of work


# --- the runtime runs the simulated programs ------------------------------------------------------


def _timeline(m: int) -> tuple[dict[int, int], list[str]]:
    torch.manual_seed(0)
    pm = parallelize(models.factory(models.gpt2, layers=4)(), Mesh(pp=2), loss_fn=models.lm_loss,
                     optimizer=models.adamw, schedule="dualpipev", microbatches=m)
    pm.step(IDS[: 2 * m], target=TARGET[: 2 * m])
    return pm.runtime.executor.peak_in_flight, [a for a, _, _ in pm.timeline()]


@pytest.mark.parametrize("m", [4, pytest.param(3, marks=pytest.mark.slow)])
def test_the_runtime_runs_the_simulated_order_and_peak(launcher, m: int) -> None:
    schedule = add_communication(dualpipev(2, m))
    sim = simulate(schedule)
    for rank, (peak, timeline) in enumerate(launcher(_timeline, 2, m)):
        ran = [a for a in map(Action.parse, timeline) if a.is_compute or a.is_comm]
        assert ran == [e.action for e in sim.timeline if e.rank == rank]  # the program, in the simulator's order
        assert peak == {s: sim.peak_in_flight[s] for s in schedule.stages_of(rank)}
        assert sum(a.kind == F for a in ran) == sum(a.kind == W for a in ran) == 2 * m


# --- equivalence on gloo ranks --------------------------------------------------------------------


def _run(launcher, name: str, mesh: Mesh, microbatches: int = 4, **kw) -> None:
    """Exact against one device, and every rank ran W actions that computed weight gradients."""
    make = models.factory(getattr(models, name), layers=4)
    runs = assert_equivalent(make, mesh, (IDS,), TARGET, models.lm_loss, models.adamw, steps=2,
                             launcher=probed(launcher), schedule="dualpipev", microbatches=microbatches, **kw)
    assert_split_backward_ran(runs)


@pytest.mark.parametrize("name", ["gpt2", pytest.param("llama", marks=pytest.mark.slow),
                                  pytest.param("bert", marks=pytest.mark.slow)])
def test_pp2_is_exact(launcher, name: str) -> None:
    """GPT-2's tied embedding is used by rank 0's two stages (the first and the last of the V)."""
    _run(launcher, name, Mesh(pp=2))


@pytest.mark.parametrize("name, mesh, zero", [
    ("llama", Mesh(dp=2, pp=2), 1),
    pytest.param("bert", Mesh(dp=2, pp=2), 3, marks=pytest.mark.slow),
    pytest.param("gpt2", Mesh(dp=2, pp=2), 0, marks=pytest.mark.slow),
    pytest.param("gpt2", Mesh(dp=2, pp=2), 2, marks=pytest.mark.slow),
    pytest.param("gpt2", Mesh(pp=2, tp=2), 0, marks=pytest.mark.slow),
])
def test_with_dp_zero_and_tp(launcher, name: str, mesh: Mesh, zero: int) -> None:
    _run(launcher, name, mesh, zero=zero)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_pp4_is_exact(launcher, name: str) -> None:
    _run(launcher, name, Mesh(pp=4), microbatches=8)


@pytest.mark.slow
def test_the_fewest_microbatches_are_exact(launcher) -> None:
    """m = 2p - 1: rank 0 has no steady-state pair at all."""
    make = models.factory(models.llama, layers=4)
    assert_equivalent(make, Mesh(pp=2), (IDS[:6],), TARGET[:6], models.lm_loss, models.adamw, steps=2,
                      launcher=launcher, schedule="dualpipev", microbatches=3)


def test_the_planner_searches_it_with_its_simulated_bubble_and_extra_half_stage() -> None:
    """The planner prices DualPipeV like the other split schedules: its wait simulated from the generated
    schedule (F = B = W: p - 1 steps, as the simulator counts), one more half-stage of activations than ZBV, and
    only where it has its 2p - 1 microbatches."""
    import dataclasses

    from autopar.planner.bubble import Bubbles
    from autopar.planner.cluster import Cluster
    from autopar.planner.cost_model import PRECISIONS, Config, CostModel
    from autopar.planner.model_profile import profile_model
    from autopar.planner.search import search_space

    bubbles = Bubbles()
    for p, m in [(2, 3), (4, 8), (8, 16)]:
        span = simulate(dualpipev(p, m), forward_time=1, backward_time=2, weight_time=1).makespan
        assert span - 6 * m == pytest.approx(3 * bubbles.idle("dualpipev", p, m, (1, 1, 1)))
    profile = profile_model(models.gpt2(layers=4, dtype=torch.float32), tp_sizes=(1,))
    cost = CostModel(profile, Cluster.preset("cpu"), PRECISIONS["fp32"], seq_len=8)
    zbv_config = Config(dp=1, pp=2, schedule="zbv", stages_per_rank=2, microbatches=4, microbatch_size=2)
    dual = cost.estimate(dataclasses.replace(zbv_config, schedule="dualpipev"))
    assert float(dual.memory["activations"]) > float(cost.estimate(zbv_config).memory["activations"])
    found = {(c.schedule, c.microbatches) for c in search_space(profile, 2, 8, pp=(2,), recompute=("none",))}
    assert ("dualpipev", 4) in found and ("dualpipev", 8) in found and ("dualpipev", 2) not in found  # 2p - 1 = 3
