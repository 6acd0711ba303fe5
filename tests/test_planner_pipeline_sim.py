"""The pipeline's transfers simulated as their own streams (``autopar/planner/pipeline_transfers.py``).

- With free hops, or hops that never queue on their link, the simulation is the schedule dry run
  (``autopar.core.simulate``) for every schedule; a link carries one message at a time.
- Only the receiver waits: a hop shorter than the slack a stage leaves is hidden in the steady state (only the
  ramp pays it); one longer than it shows every microbatch. 1F1B with balanced stages has no slack: each microbatch
  shows ``2 (p - 1) / p`` hops.
- With free hops the planner's step is the blocking model's (today's formula); with a slow link it charges what
  the simulation exposes, less than every hop, and Megatron's blocking mode keeps every hop.
- On 2 gloo ranks (1F1B, 4 microbatches) the receives that wait are those the simulation, fed the runtime's own
  per-stage seconds, makes wait: order, not seconds.
"""
from __future__ import annotations

import re

import pytest
import torch

from autopar.core.schedules import make_schedule
from autopar.core.simulate import Timing, simulate
from autopar.planner import gpt
from autopar.planner.cluster import Cluster, Link
from autopar.planner.cost_model import PRECISIONS, Config, CostModel
from autopar.planner.model_profile import profile_model
from autopar.planner.pipeline_transfers import schedule_order, step_makespan, step_timeline

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2))


def _exposed(name: str, p: int, m: int, v: int, times: tuple, hop: float) -> float:
    order = schedule_order(make_schedule(name, p, m, v))
    n = len(times)
    return step_makespan(order, times, (hop,) * n) - step_makespan(order, times, (0.0,) * n)


@pytest.mark.parametrize("name, v", SCHEDULES)
@pytest.mark.parametrize("p", [2, 4])
def test_hops_that_never_queue_are_the_dry_runs(name: str, v: int, p: int) -> None:
    m = 2 * p
    schedule = make_schedule(name, p, m, v)
    order, n = schedule_order(schedule), schedule.n_stages
    split = schedule.splits_backward
    times = ((1.0, 1.0, 1.0) if split else (1.0, 2.0, 0.0),) * n
    for hop in (0.0, 0.25, 0.5):  # shorter than any compute: a link is free again before the next message
        want = simulate(schedule, 1.0, 2.0, hop).makespan
        assert step_makespan(order, times, (hop,) * n) == pytest.approx(want, rel=1e-12), hop
    assert step_makespan(order, times, (0.0,) * n) == pytest.approx(
        Timing.of(schedule).makespan(1.0, 2.0, 0.0, 1.0 if split else None), rel=1e-12)


def test_a_link_carries_one_message_at_a_time() -> None:
    """GPipe on 2 stages, F 1, B 2, hops 3: the forwards' messages queue on the link (rank 1's last forward
    starts at 1 + 3m), then the backwards' (rank 0's last backward starts 3m after rank 1's first ends)."""
    for m in (2, 4, 8):
        order = schedule_order(make_schedule("gpipe", 2, m, 1))
        assert step_makespan(order, ((1.0, 2.0, 0.0),) * 2, (3.0, 3.0)) == pytest.approx(6 + 6 * m)


def test_only_the_receiver_waits() -> None:
    """Rank 0 of GPipe runs its forwards back to back whatever the hop (its sends never block it)."""
    order = schedule_order(make_schedule("gpipe", 2, 4, 1))
    starts, _ = step_timeline(order, ((1.0, 2.0, 0.0),) * 2, (5.0, 5.0))
    forwards = [s for (rank, kind, *_), s in zip(order, starts) if rank == 0 and kind == "F"]
    assert forwards == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("name, v, times", [
    ("gpipe", 1, ((1.0, 2.0, 0.0),) * 4),
    ("interleaved-1f1b", 2, ((0.5, 1.0, 0.0),) * 8),
    ("1f1b", 1, ((1.0, 2.0, 0.0), (2.0, 4.0, 0.0))),  # stage 0 waits 3 per microbatch for stage 1: slack
])
def test_a_short_hop_is_paid_by_the_ramp_a_long_one_every_microbatch(name: str, v: int, times: tuple) -> None:
    p = len(times) // v
    short, long = 0.25, 4.0
    ramp = _exposed(name, p, 4 * p, v, times, short)
    assert ramp > 0
    assert _exposed(name, p, 8 * p, v, times, short) == pytest.approx(ramp, rel=1e-12)  # hidden in steady state
    grows = _exposed(name, p, 8 * p, v, times, long) - _exposed(name, p, 4 * p, v, times, long)
    assert grows > 0.5 * 4 * p  # more than half a time unit per microbatch


@pytest.mark.parametrize("p", [2, 4])
def test_balanced_1f1b_has_no_slack_each_microbatch_shows_part_of_its_hops(p: int) -> None:
    """Microbatch ``k + p`` enters stage 0 after microbatch ``k``'s backward came back through all ``p`` stages:
    ``2 (p - 1)`` hops per ``p`` microbatches."""
    times, hop = ((1.0, 2.0, 0.0),) * p, 0.25
    grows = _exposed("1f1b", p, 8 * p, 1, times, hop) - _exposed("1f1b", p, 4 * p, 1, times, hop)
    assert grows == pytest.approx(4 * p * 2 * (p - 1) / p * hop, rel=1e-9)


@pytest.fixture(scope="module")
def gpt_profile():
    return profile_model(gpt(8, 256, 8, vocab=1024), tp_sizes=(1, 2))


def _cost(profile, pp_link: Link, **kw) -> CostModel:
    cluster = Cluster.preset("dgx-a100").replace(intra=pp_link, devices_per_node=8)
    return CostModel(profile, cluster, PRECISIONS["mixed"], seq_len=2048, **kw)


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2)])
def test_with_free_hops_the_step_is_the_blocking_models(gpt_profile, schedule: str, v: int) -> None:
    config = Config(dp=1, pp=4, schedule=schedule, stages_per_rank=v, microbatches=8, microbatch_size=2)
    free = Link(1e300, 0.0)
    ours, blocking = _cost(gpt_profile, free).estimate(config), _cost(gpt_profile, free, scatter_gather=True).estimate(
        config)
    for part in ("pipeline_p2p", "bubble"):
        assert float(ours.time[part]) == pytest.approx(float(blocking.time[part]), rel=1e-12, abs=1e-15), part
    assert float(ours.step_time) == pytest.approx(float(blocking.step_time), rel=1e-12)


def test_a_slow_link_shows_less_than_every_hop(gpt_profile) -> None:
    config = Config(dp=1, pp=4, schedule="1f1b", microbatches=16, microbatch_size=2)
    slow = Link(2e9, 1e-4)
    ours, blocking = _cost(gpt_profile, slow).estimate(config), _cost(gpt_profile, slow, scatter_gather=True).estimate(
        config)
    assert 0 < float(ours.time["pipeline_p2p"]) < float(blocking.time["pipeline_p2p"])
    assert float(ours.links["pp"].busy) == pytest.approx(float(blocking.time["pipeline_p2p"]), rel=1e-12)  # tp=1
    assert float(ours.step_time) < float(blocking.step_time)


# the runtime: on 2 gloo ranks the receives that wait are the ones the simulation makes wait ----------------------
RUNTIME_M = 4
STEPS = 6


def _pipeline_timelines() -> list[list[tuple[str, float, float]]]:
    import models
    from autopar import Mesh, parallelize

    ids = torch.randint(0, 96, (8, 64), generator=torch.Generator().manual_seed(1))
    pm = parallelize(models.gpt2(layers=4, d=256, heads=4), Mesh(pp=2), loss_fn=models.lm_loss,
                     optimizer=models.sgd, schedule="1f1b", microbatches=RUNTIME_M)
    out = []
    for _ in range(STEPS):
        pm.step(ids, target=ids)
        out.append(pm.timeline())
    return out[1:]  # (the first step compiles)


@pytest.fixture(scope="module")
def pipeline_runtime(launcher) -> list[list[list[tuple[str, float, float]]]]:
    return launcher(_pipeline_timelines, 2)


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _medians(timelines: list[list[tuple[str, float, float]]]) -> dict[str, float]:
    """Each action's seconds in the median step (the runs share a loaded machine's cores: one step is noisy)."""
    seconds: dict[str, list[float]] = {}
    for timeline in timelines:
        for what, start, end in timeline:
            seconds.setdefault(what, []).append(end - start)
    return {what: _median(ts) for what, ts in seconds.items()}


def _simulated_waits(p: int, m: int, times: tuple) -> dict[str, float]:
    """Each receive's wait in the simulation (free hops): how late its compute starts after the rank is free."""
    order = schedule_order(make_schedule("1f1b", p, m, 1))
    starts, ends = step_timeline(order, times, (0.0,) * p)
    out: dict[str, float] = {}
    free = [0.0] * p
    for (rank, kind, stage, microbatch, need, _), start, end in zip(order, starts, ends):
        if need >= 0:
            out[f"{stage}RECV_{kind}{microbatch}"] = start - free[rank]
        free[rank] = end
    return out


@pytest.mark.slow  # measured waits: a loaded machine's scheduling adds waits of its own (opt-in, as the
# planner's other wall-clock checks)
def test_the_runtimes_receivers_wait_where_the_simulation_makes_them(pipeline_runtime) -> None:
    """1F1B on 2 stages, 4 microbatches, simulated with the runtime's own median F and B seconds per stage: a
    receive the simulation makes wait half a forward or more waits over a quarter of one in the runtime, one it
    makes wait under an eighth of a forward waits under half of one there (a microbatch's seconds vary around
    the median). Stage 1 waits for microbatch 0's forward (the ramp), stage 0
    for microbatch 0's gradient (while stage 1 runs its forward and backward); a send never waits (``isend``)."""
    ranks = [_medians(timelines) for timelines in pipeline_runtime]
    times = tuple((_median([t for w, t in r.items() if re.fullmatch(rf"{s}F\d+", w)]),
                   _median([t for w, t in r.items() if re.fullmatch(rf"{s}B\d+", w)]), 0.0)
                  for s, r in enumerate(ranks))
    forward = min(f for f, _, _ in times)
    simulated = _simulated_waits(2, RUNTIME_M, times)
    assert simulated["1RECV_F0"] >= forward / 2 and simulated["0RECV_B0"] >= forward / 2
    for what, wait in simulated.items():
        got = ranks[int(what[0])][what]
        if wait >= forward / 2:
            assert got > forward / 4, (what, wait, got, ranks)
        elif wait < forward / 8:
            assert got < forward / 2, (what, wait, got, ranks)
    for r in ranks:
        assert all(t < forward / 4 for w, t in r.items() if "SEND" in w), r
