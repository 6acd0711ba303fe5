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
    n_stages = 2 * p
    # a stage runs its F (and its B) in microbatch order, so the next one of each stage is the only candidate
    state = _State(n_stages, m)
    programs: list[list[Action]] = [[] for _ in range(p)]
    held = [0] * p  # microbatch-stages between F and W, per rank
    waiting: list[list[Action]] = [[] for _ in range(p)]  # W actions whose B has run, oldest first
    remaining, t = 3 * n_stages * m, 0
    while remaining:
        for rank in range(p):
            action = _pick(state, (n_stages - 1 - rank, rank), t, held[rank] < 2 * p, waiting[rank])
            if action is None:
                continue
            programs[rank].append(action)
            state.run(action, t)
            held[rank] += {F: 1, B: 0, W: -1}[action.kind]
            if action.kind == B:
                waiting[rank].append(Action(action.stage, W, action.microbatch))
            remaining -= 1
        t += 1
    return Schedule(p, n_stages, m, v_placement(p), programs)


class _State:
    """When each stage's F and B of each microbatch finished (a step), and each stage's next F and B."""

    def __init__(self, n_stages: int, m: int) -> None:
        never = float("inf")
        self.n_stages, self.m = n_stages, m
        self.done = {F: [[never] * m for _ in range(n_stages)], B: [[never] * m for _ in range(n_stages)]}
        self.next = {F: [0] * n_stages, B: [0] * n_stages}

    def ready(self, kind: str, s: int, t: int) -> int | None:
        """The microbatch of stage ``s``'s next ``kind`` if its inputs exist at step ``t``, else None."""
        mb = self.next[kind][s]
        if mb == self.m:
            return None
        if kind == F:
            ok = s == 0 or self.done[F][s - 1][mb] <= t
        else:
            ok = self.done[F][s][mb] <= t and (s == self.n_stages - 1 or self.done[B][s + 1][mb] <= t)
        return mb if ok else None

    def run(self, action: Action, t: int) -> None:
        if action.kind != W:
            self.done[action.kind][action.stage][action.microbatch] = t + 1
            self.next[action.kind][action.stage] += 1


def _pick(state: _State, mine: tuple[int, int], t: int, may_forward: bool, waiting: list[Action]) -> Action | None:
    """A ready B of the lowest microbatch (the later stage first), else such an F if allowed, else the oldest W."""
    for kind in (B, F) if may_forward else (B,):
        ready = [(mb, -s) for s in mine if (mb := state.ready(kind, s, t)) is not None]
        if ready:
            mb, s = min(ready)
            return Action(-s, kind, mb)
    return waiting.pop(0) if waiting else None
