"""The pipeline bubble: how long the busiest pipeline rank waits in one step.

GPipe and (interleaved) 1F1B wait ``(p - 1) / v`` microbatches' work,
whatever the ratio of forward to backward time. The zero-bubble schedules have
no such closed form: ZB-H1's wait depends on how ``W`` compares with ``F`` and
``B``, and ZBV's programs come out of list scheduling
(``autopar.core.zero_bubble``), whose wait changes irregularly with ``p`` and
``m`` and grows with ``m`` when ``B`` takes longer than ``F`` (its programs
were ordered as if they took the same time). So for those the planner runs the
schedule autopar would run through the simulator (``autopar.core.simulate.Timing``)
with the configuration's ``F``, ``B`` and ``W`` times.

``Bubbles`` caches the schedules by ``(schedule, p, m)`` and the simulated
waits by those and the three times' ratios, rounded to ``1 / RESOLUTION`` of a
stage's work: the planner's candidates share few distinct ratios.

Invariant: with ``F``, ``B`` and ``W`` taking the same time, the wait is what
``autopar.core.simulate.simulate`` measures for the generated schedule
(``tests/test_zero_bubble.py`` checks ``p`` up to 32).
"""
from __future__ import annotations

from autopar.core.schedule import Schedule
from autopar.core.schedules import make_schedule, stages_per_rank
from autopar.core.simulate import Timing

RESOLUTION = 200  # F, B and W are rounded to 1/200 of a stage's F + B + W before simulating


class Bubbles:
    """Waits of generated pipeline schedules, simulated once per (schedule, p, m, rounded cost ratios)."""

    def __init__(self) -> None:
        self._prepared: dict[tuple[str, int, int, int], tuple[Schedule, Timing]] = {}
        self._idle: dict[tuple[str, int, int, int, int, int], float] = {}

    def idle(self, schedule: str, pp: int, microbatches: int, costs: tuple[float, float, float]) -> float:
        """A rank's waiting time in one step, in units of one stage's ``F + B + W`` of one microbatch, when
        every stage's ``F``, ``B`` and ``W`` take ``costs`` (any unit: only their ratios count).

        ``schedule`` splits its backwards (``"zb-h1"``, ``"zbv"``); every rank holds ``v`` stages of
        the same cost, so its work is ``v * m`` units and the step ``v * m`` units plus this.
        """
        if pp == 1 or sum(costs) <= 0:
            return 0.0
        f, b, w = _units(costs)
        key = (schedule, pp, microbatches, f, b, w)
        if key not in self._idle:
            timing, v = self.timing(schedule, pp, microbatches)
            span = timing.makespan(forward_time=f, backward_time=b + w, weight_time=w)
            self._idle[key] = (span - v * microbatches * (f + b + w)) / (f + b + w)
        return self._idle[key]

    def least_idle(self, pp: int, costs: tuple[float, float, float]) -> float:
        """A lower bound of ``idle`` for each of these schedules and any ``m``, without simulating: every
        microbatch enters at stage 0, so the rank that holds stage ``pp - 1`` (the V's turn) starts after
        microbatch 0's forward through the ``pp - 1`` stages before it, and then does all of its work."""
        if pp == 1 or sum(costs) <= 0:
            return 0.0
        f, b, w = _units(costs)
        return (pp - 1) * f / (f + b + w)

    def timing(self, name: str, pp: int, microbatches: int) -> tuple[Timing, int]:
        """The compute-only schedule ``make_schedule`` generates, prepared for timing once; its stages per rank."""
        timing = self.prepared(name, pp, microbatches)[1]
        return timing, len(timing.steps) // (3 * pp * microbatches)

    def prepared(self, name: str, pp: int, microbatches: int, v: int | None = None) -> tuple[Schedule, Timing]:
        """``make_schedule(name, pp, microbatches, v)`` and its ``Timing``, made once (``pipeline_transfers`` times
        the same schedules)."""
        key = (name, pp, microbatches, stages_per_rank(name, v))
        if key not in self._prepared:
            schedule = make_schedule(name, pp, microbatches, key[3])
            self._prepared[key] = schedule, Timing.of(schedule)
        return self._prepared[key]



def _units(costs: tuple[float, float, float]) -> tuple[int, int, int]:
    """``F``, ``B`` and ``W`` in whole ``1 / RESOLUTION`` shares of their sum (at least one each)."""
    total = sum(costs)
    f, b, w = (max(1, round(RESOLUTION * x / total)) for x in costs)
    return f, b, w
