"""Pipeline transfers as their own streams: what of a schedule's hops the step shows.

autopar's runtime sends a stage's output (and, backward, its input's
gradient) with ``isend`` right after the compute that produced it, and goes
on with its program: a send never blocks its rank. Only the receiver waits,
at the ``RECV`` before the compute that needs the message
(``runtime/step_executor.py``; the semantics of ``autopar.core.schedule``).
So a hop costs the step only where the receiver has nothing else to do.

``Transfers.exposed`` simulates the schedule ``make_schedule`` builds, every
rank running its ``F``, ``B`` (and ``W``) in program order with each stage's
own times, and every message a transfer on the link from the sender's rank to
the receiver's: one stream per direction, one message at a time, in the order
the sender issues them, starting when its compute ends and the link is free.
A compute that consumes a message starts once it has arrived. What the
pipeline transfers cost is the makespan less that of the same schedule with
free hops (the bubble, which stays the bubble): zero where hops are zero.

That is not every hop hidden behind other work: 1F1B's steady state has no
slack when its stages are balanced (microbatch ``k + p`` enters stage 0 only
after microbatch ``k``'s backward has come back through every stage), so each
microbatch shows ``2 (p - 1) / p`` hops there; a lighter stage, GPipe's
forwards in a row or interleaving leave room that hides a short hop.

``Transfers`` caches the schedules' orders by ``(schedule, p, m, v)`` and the
results by those and the stage times and hops.
"""
from __future__ import annotations

from typing import Any

from autopar.core.schedule import B, F, W, Schedule
from autopar.core.simulate import Timing
from autopar.planner.bubble import Bubbles
from autopar.planner.config import ZERO_BUBBLE, Config
from autopar.planner.expr import number

RESOLUTION = 4000  # F, B, W and the hop are rounded to 1/4000 of a stage's F + B + W before simulating

# one step of a schedule's order: (rank, kind, stage, microbatch, the step it consumes or -1, the link its output
# travels or -1)
Step = tuple[int, str, int, int, int, int]


class Transfers:
    """What a schedule's pipeline transfers add to its step, simulated once per schedule, sizes and rounded times."""

    def __init__(self, bubbles: Bubbles | None = None) -> None:
        self.bubbles = bubbles or Bubbles()  # where the schedules are made (shared with the bubble's)
        self._orders: dict[tuple[str, int, int, int], tuple[Step, ...]] = {}
        self._exposed: dict[tuple, float] = {}  # in units of a stage's F + B + W
        self._free: dict[tuple, float] = {}  # the makespan with free hops, in shares

    def exposed(self, schedule: str, pp: int, microbatches: int, stages_per_rank: int,
                costs: tuple[float, float, float], hop: float) -> float:
        """How much longer the step is when each message takes ``hop``, in units of one stage's ``F + B + W``,
        every stage's ``F``, ``B`` and ``W`` of one microbatch taking ``costs`` (``W`` 0 unless the schedule splits
        backwards; any unit, the hop's the same: only ratios count).

        Simulated in whole ``1 / RESOLUTION`` shares of ``F + B + W`` (a nonzero compute at least one; a hop
        under half a share is free), so that configurations with the same ratios share one simulation.
        """
        work = sum(costs)
        if pp == 1 or hop <= 0 or work <= 0:
            return 0.0
        f, b, w = (max(1, round(RESOLUTION * x / work)) if x > 0 else 0 for x in costs)
        h = round(RESOLUTION * hop / work)
        if not h:
            return 0.0
        key = (schedule, pp, microbatches, stages_per_rank, f, b, w, h)
        if key not in self._exposed:
            n, order = pp * stages_per_rank, self.order(schedule, pp, microbatches, stages_per_rank)
            times = ((float(f), float(b), float(w)),) * n
            free = self._free.get(key[:-1])
            if free is None:
                free = self._free[key[:-1]] = step_makespan(order, times, (0.0,) * n)
            self._exposed[key] = max(step_makespan(order, times, (float(h),) * n) - free, 0.0) / (f + b + w)
        return self._exposed[key]

    def seconds(self, c: Config, compute: Any, tp: Any, p2p_t: Any, forward: Any, backward: Any, redo: Any) -> Any:
        """``exposed`` in seconds for configuration ``c``, from the busiest rank's per-microbatch parts summed over
        its ``v`` stages (``CostModel._stage``: compute, tp, its two hops per stage, forward, backward, recomputed):
        every stage takes the rank's ``F``, ``B`` (``W``: a forward's compute under a split backward) over ``v``;
        symbolic in ``b``, the ratios are those at ``c.microbatch_size``."""
        v = c.stages_per_rank
        weight = (compute - redo) / 3 if c.schedule in ZERO_BUBBLE else 0
        costs = [number(x, c.microbatch_size) for x in (forward, backward - weight, weight, p2p_t / 2)]
        grown = self.exposed(c.schedule, c.pp, c.microbatches, v, (costs[0], costs[1], costs[2]), costs[3])
        return grown / v * (compute + tp)

    def order(self, schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> tuple[Step, ...]:
        """``make_schedule``'s schedule as ``Step`` s, each after what it consumes (``Timing.of``'s order)."""
        key = (schedule, pp, microbatches, stages_per_rank)
        if key not in self._orders:
            self._orders[key] = schedule_order(*self.bubbles.prepared(schedule, pp, microbatches, stages_per_rank))
        return self._orders[key]


def schedule_order(schedule: Schedule, timing: Timing | None = None) -> tuple[Step, ...]:
    """A compute-only schedule's actions in ``Timing.of``'s order (``timing``: that, made already), with their
    stages, microbatches and the links (``(sender, receiver)`` rank pairs, numbered) their outputs travel."""
    timing = timing or Timing.of(schedule)
    owner, last = schedule.stage_to_rank, schedule.n_stages - 1
    pcs = [0] * schedule.n_ranks
    links: dict[tuple[int, int], int] = {}
    out = []
    for rank, kind, need, _ in timing.steps:
        a = schedule.actions[rank][pcs[rank]]
        pcs[rank] += 1
        to = a.stage + 1 if a.kind == F and a.stage < last else a.stage - 1 if a.kind == B and a.stage > 0 else None
        link = -1 if to is None or owner[to] == rank else links.setdefault((rank, owner[to]), len(links))
        out.append((rank, kind, a.stage, a.microbatch, need, link))
    return tuple(out)


def step_makespan(order: tuple[Step, ...], times: tuple[tuple[float, float, float], ...],
                  hops: tuple[float, ...]) -> float:
    """When the last rank ends (``step_timeline``)."""
    return max(step_timeline(order, times, hops)[1], default=0.0)


def step_timeline(order: tuple[Step, ...], times: tuple[tuple[float, float, float], ...],
                  hops: tuple[float, ...]) -> tuple[list[float], list[float]]:
    """When each step starts and ends: each rank runs its steps in order, a step starts once its rank is free
    and the message it consumes has arrived; a message leaves when its step ends and its link is free, and
    takes the hop between the two stages (``F`` of stage ``s`` sends ``hops[s + 1]``, ``B`` of stage ``s``
    ``hops[s]``). The sender goes on at once."""
    column = {F: 0, B: 1, W: 2}
    took = [times[stage][column[kind]] for _, kind, stage, *_ in order]
    hop = [hops[stage + 1 if kind == F else stage] if link >= 0 else 0.0 for _, kind, stage, _, _, link in order]
    starts, ends, arrives = [0.0] * len(order), [0.0] * len(order), [0.0] * len(order)
    clocks = [0.0] * (max((step[0] for step in order), default=0) + 1)
    link_free = [0.0] * (max((step[5] for step in order), default=0) + 1)
    for i, (rank, _, _, _, need, link) in enumerate(order):
        start = clocks[rank]
        if need >= 0 and arrives[need] > start:
            start = arrives[need]
        starts[i] = start
        ends[i] = clocks[rank] = end = start + took[i]
        if link < 0:
            arrives[i] = end
        else:
            arrives[i] = link_free[link] = (end if end > link_free[link] else link_free[link]) + hop[i]
    return starts, ends
