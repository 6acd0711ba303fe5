"""The pipeline schedules by name: each generator with the stages per rank it places.

The generators live beside their ideas (``schedule.py``: GPipe, 1F1B, interleaved 1F1B, ZB-H1;
``zero_bubble.py``: ZBV; ``dualpipe.py``: DualPipeV); this table names them, so that the IR module
imports none of them back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from autopar.core.dualpipe import dualpipev
from autopar.core.schedule import Schedule, gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from autopar.core.zero_bubble import zbv


@dataclass(frozen=True)
class Generator:
    """A schedule generator: ``make(ranks, stages per rank, microbatches)``."""

    make: Callable[[int, int, int], Schedule]
    stages_per_rank: int | None = 1  # the stages it places on every rank; None: any number (default 2)


SCHEDULES: dict[str, Generator] = {
    "gpipe": Generator(lambda p, v, m: gpipe(p, m)),
    "1f1b": Generator(lambda p, v, m: one_f_one_b(p, m)),
    "interleaved-1f1b": Generator(interleaved_1f1b, stages_per_rank=None),
    "zb-h1": Generator(lambda p, v, m: zb_h1(p, m)),
    "zbv": Generator(lambda p, v, m: zbv(p, m), stages_per_rank=2),
    "dualpipev": Generator(lambda p, v, m: dualpipev(p, m), stages_per_rank=2),
}
STAGES_PER_RANK = {name: g.stages_per_rank for name, g in SCHEDULES.items()
                   if g.stages_per_rank not in (None, 1)}  # schedules with a fixed number of stages per rank above 1


def stages_per_rank(name: str, given: int | None = None) -> int:
    """The stages per rank schedule ``name`` places (``given``, checked against the schedule's own number);
    raises ValueError for an unknown schedule or a number it cannot place."""
    if name not in SCHEDULES:
        known = ", ".join(map(repr, SCHEDULES))
        raise ValueError(f"unknown pipeline schedule {name!r}; the known schedules are {known}")
    fixed = SCHEDULES[name].stages_per_rank
    if given is not None and given < 1:
        raise ValueError(f"stages_per_rank={given} must be >= 1")
    if fixed is None:
        return 2 if given is None else given
    if given not in (None, fixed):
        raise ValueError(
            f"schedule {name!r} places {fixed} stage{'s' * (fixed > 1)} per rank, got "
            f"stages_per_rank={given}; use schedule='interleaved-1f1b' for any number per rank"
        )
    return fixed


def make_schedule(name: str, n_ranks: int, n_microbatches: int, n_stages_per_rank: int | None = None) -> Schedule:
    """The compute-only schedule called ``name`` ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv" or
    "dualpipev")."""
    v = stages_per_rank(name, n_stages_per_rank)  # (checks the name first)
    return SCHEDULES[name].make(n_ranks, v, n_microbatches)
