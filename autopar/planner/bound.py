"""Branch and bound over the planner's candidates: the step time only of those that can rank.

The search estimates every configuration's memory (``CostModel.estimate(timed=False)``):
what fits, and by how much the others do not, is needed of each. Their step
time costs more (the zero-bubble schedules' bubble and the pipeline's
transfers are simulated, ZeRO-3's collectives counted per flat group) and only a few of them are read: the best
``top`` that fit (the table), the best of each mesh (the explanation compares
the best with every other tp and pp size, ep degree and with the best with or without
hybrid sharding; the measured checks run each mesh's best) and the best that
autopar runs. ``timed_candidates`` bounds each fitting configuration's step
time from below twice (``CostModel.step_time_bound``: the step without
those dear parts and without the dp collectives' simulated exposure, then
with it), visits them lowest known time first (a candidate's first bound,
once computed its second), and times one only while its bounds could
still beat one of those.

Invariant: sorted by ``rank_key``, the candidates returned begin with the same
``top`` candidates, and hold the same best of each mesh, as timing every
fitting configuration would (``tests/test_planner_bound.py`` compares the two
searches).
"""
from __future__ import annotations

import heapq
import math
from autopar.planner.result import Candidate

SLACK = 1e-9  # a bound is summed in another order than the step time: it may exceed it by rounding


def rank_key(c: Candidate) -> tuple:
    """How candidates are ranked: fitting first, fastest first (``Candidate.pace``); at the same time to three significant digits the
    lower ZeRO stage, then less recomputation (its time is measured to exceed the model's where the model calls it
    negligible), then less memory. A candidate that does not fit is ranked by its memory."""
    return (not c.fits, rounded(c.pace if c.fits else c.total_memory), c.config.zero, c.config.recompute_order,
            c.total_memory)


def rounded(x: float) -> float:
    """``x`` to three significant digits, as ``rank_key`` compares step times."""
    return float(f"{x:.3g}")


def timed_candidates(fitting: list[Candidate], top: int | None) -> list[Candidate]:
    """The fitting candidates that can be among the best ``top``, the best of their tp or pp size or the best that
    autopar runs, each timed (see the module doc); all of them, timed, when ``top`` is None."""
    if top is None:
        return fitting
    top = max(top, 1)
    queue = [(_paced(c, c.cost.step_time_bound(c.config, simulated=False)), 0, i) for i, c in enumerate(fitting)]
    heapq.heapify(queue)  # (what is known of a candidate's time: a bound without, then with the dp simulation; 1)
    leaders: list[float] = []  # the best ``top`` rounded step times known, negated (a max-heap)
    best: dict[tuple, float] = {}  # group -> the fastest step time known in it
    out = []
    while queue:  # the lowest known first: a candidate is timed only once its closest bound is the lowest left
        known, stage, i = heapq.heappop(queue)
        c = fitting[i]
        groups = _groups(c)
        low = rounded(known * (1 - SLACK))
        if len(leaders) >= top and low > -leaders[0] and all(low > rounded(best.get(g, math.inf)) for g in groups):
            continue  # cannot be among the best ``top``, nor beat or tie (``rank_key``) the best of any of its groups
        if stage == 0:
            heapq.heappush(queue, (_paced(c, c.cost.step_time_bound(c.config)), 1, i))
            continue
        t = c.pace
        out.append(c)
        heapq.heappush(leaders, -rounded(t))
        if len(leaders) > top:
            heapq.heappop(leaders)
        for g in groups:
            best[g] = min(best.get(g, math.inf), t)
    return out


def measure(best: Candidate) -> str:
    """What the explanation's ratios compare (``Candidate.pace``)."""
    return "the time per local batch" if best.per_sample else "the step time"


def _paced(c: Candidate, seconds: float) -> float:
    """``seconds`` of ``c``'s step as ``Candidate.pace`` counts them."""
    return seconds / c.config.dp if c.per_sample else seconds


def _groups(c: Candidate) -> list[tuple]:
    """The groups whose best the plan reports: its tp size, its pp size, hybrid sharding or not, its cp size
    (1 without context parallelism), its ep degree (1 without expert parallelism), and the configurations autopar
    runs."""
    cfg = c.config
    return [("tp", cfg.tp), ("pp", cfg.pp), ("hybrid", cfg.dp_shard > 0), ("cp", cfg.cp), ("ep", cfg.ep)] \
        + [("runnable",)] * c.runnable
