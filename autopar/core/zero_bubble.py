"""The V-shaped zero-bubble schedule (ZBV, Qi et al. 2024), made by list scheduling.

Each of ``p`` ranks holds two stages in a V: stage ``s`` lives on rank ``s``
for ``s < p`` and on rank ``2p - 1 - s`` after, so rank 0 holds the first
and the last stage and a microbatch goes down the ranks and back up. Backwards
are split into ``B`` (input gradients) and ``W`` (weight gradients).

`zbv` builds every rank's program by simulating unit-time actions (F, B and W
take one step each, transfers none) and, whenever a rank is free, starting
the first ready action of: a ``B`` (the critical path), else an ``F`` if the
rank holds fewer than ``2p`` microbatch-stages between their ``F`` and their
``W`` (the activations of ``p`` whole microbatches, 1F1B's peak), else the
oldest waiting ``W``. Among ready actions of one kind the lowest microbatch
goes first, and for ``F`` the later stage (to reach the loss sooner). The
result is checked like any schedule by `autopar.core.simulate`.
"""
from __future__ import annotations

from autopar.core.schedule import B, F, W, Action, Schedule


def v_placement(n_ranks: int) -> tuple[int, ...]:
    """Stage ``s`` on rank ``s`` going down, then on rank ``2p - 1 - s`` coming back up."""
    return tuple(range(n_ranks)) + tuple(reversed(range(n_ranks)))


def zbv(n_ranks: int, n_microbatches: int) -> Schedule:
    """ZBV over ``n_ranks`` ranks (two stages each) and ``n_microbatches`` microbatches (see the module doc)."""
    for name, value in (("n_ranks", n_ranks), ("n_microbatches", n_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"zbv: {name} must be an integer >= 1, got {value!r}")
    p, m = n_ranks, n_microbatches
    placement = v_placement(p)
    n_stages = 2 * p
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, microbatch) -> the step it finished
    programs: list[list[Action]] = [[] for _ in range(p)]
    held = [0] * p  # microbatch-stages between F and W, per rank
    waiting: list[list[Action]] = [[] for _ in range(p)]  # W actions whose B has run, oldest first
    total, t = 3 * n_stages * m, 0
    while len(done) < total:
        for rank in range(p):
            action = _pick(rank, placement, n_stages, m, done, t, held[rank] < 2 * p, waiting[rank])
            if action is None:
                continue
            programs[rank].append(action)
            done[(action.kind, action.stage, action.microbatch)] = t + 1
            held[rank] += {F: 1, B: 0, W: -1}[action.kind]
            if action.kind == B:
                waiting[rank].append(Action(action.stage, W, action.microbatch))
        t += 1
    return Schedule(p, n_stages, m, placement, programs)


def _ready(kind: str, s: int, mb: int, n_stages: int, done: dict, t: int) -> bool:
    """Whether ``kind(s, mb)`` has not run and its inputs exist at step ``t``."""
    if (kind, s, mb) in done:
        return False
    if kind == F:
        return s == 0 or done.get((F, s - 1, mb), t + 1) <= t
    return done.get((F, s, mb), t + 1) <= t and (s == n_stages - 1 or done.get((B, s + 1, mb), t + 1) <= t)


def _pick(rank: int, placement: tuple[int, ...], n_stages: int, m: int, done: dict, t: int, may_forward: bool,
          waiting: list[Action]) -> Action | None:
    mine = [s for s in range(n_stages) if placement[s] == rank]
    for mb in range(m):
        for s in sorted(mine, reverse=True):
            if _ready(B, s, mb, n_stages, done, t):
                return Action(s, B, mb)
    if may_forward:
        for mb in range(m):
            for s in sorted(mine, reverse=True):
                if _ready(F, s, mb, n_stages, done, t):
                    return Action(s, F, mb)
    return waiting.pop(0) if waiting else None
