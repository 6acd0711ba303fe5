"""DualPipeV: DeepSeek-V3's DualPipe cut in half into a V (Sea AI Lab's "cut-in-half", 2025).

Each of ``p`` ranks holds two stages in the V of `autopar.core.zero_bubble.v_placement`:
rank ``r`` holds *chunk 0*, stage ``r`` on the way down, and *chunk 1*, stage
``2p - 1 - r`` on the way back up (rank 0 holds the first and the last stage).
DualPipe's steady state runs the forward of one microbatch on one chunk
together with the backward of another on the other chunk, so that one's
computation hides the other's communication (expert all-to-alls in
DeepSeek-V3). Our IR has no fused "overlapped F and B" action: a pair is
written as the ``F`` followed by the ``B`` (and its ``W``) in the rank's
program, run one after the other. What the overlap would buy is therefore not
in these schedules; `autopar.core.simulate` measures what is left (bubble and
activations held).

Every rank runs eight phases, with ``"F0"`` the forward of chunk 0, ``"B1W"``
a whole backward of chunk 1 (``B`` then its ``W`` at once), ``"B1"`` a
backward whose ``W`` waits in the rank's queue, and ``"W"`` the oldest
waiting ``W`` (microbatches go through each chunk's forwards, and through its
backwards, in order):

====  ===================  ==========================================================
 1    ``2(p - r - 1)`` x   ``F0``            warm-up down the V
 2    ``r + 1`` x          ``F0 F1``         the first forwards come back up
 3    ``p - r - 1`` x      ``B1 W F1``       first backwards, weight gradient at once
 4    ``m - 2p + r + 1`` x ``F0 B1W F1 B0W`` the steady state: two F/B pairs
 5    ``p - r - 1`` x      ``B1W F1 B0W``    the last forwards
 6    ``r + 1`` x          ``B1 B0``         cool-down; the first half whole, the second leaves W
 7    ``p - r - 1`` x      ``W B0``          a waiting W before each remaining backward
 8    ``r + 1`` x          ``W``             the waiting W
====  ===================  ==========================================================

Phase 4 of rank 0 runs ``m - 2p + 1`` times, so the schedule needs
``m >= 2p - 1`` microbatches (DeepSeek's and torch.distributed.pipelining's
implementations ask for ``m >= 2p``); any count from there on, even or odd.
"""
from __future__ import annotations

from autopar.core.schedule import B, F, W, Action, Schedule
from autopar.core.zero_bubble import v_placement


def min_microbatches(n_ranks: int) -> int:
    """The fewest microbatches DualPipeV runs on ``n_ranks`` ranks: rank 0's steady phase may be empty."""
    return 2 * n_ranks - 1


def dualpipev(n_ranks: int, n_microbatches: int) -> Schedule:
    """DualPipeV over ``n_ranks`` ranks (two stages each) and ``n_microbatches`` microbatches (see the module doc)."""
    for name, value in (("n_ranks", n_ranks), ("n_microbatches", n_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"dualpipev: {name} must be an integer >= 1, got {value!r}")
    p, m = n_ranks, n_microbatches
    if m < min_microbatches(p):
        raise ValueError(
            f"dualpipev on pp={p} needs at least 2*pp - 1 = {min_microbatches(p)} microbatches (rank 0 runs "
            f"2*(pp - 1) = {2 * (p - 1)} warm-up forwards before its first pair), got microbatches={m}; use "
            f"microbatches={min_microbatches(p)} or more, or schedule='zbv' (the same V, any number of microbatches)"
        )
    programs = [_realize(phases(rank, p, m), rank, p) for rank in range(p)]
    return Schedule(p, 2 * p, m, v_placement(p), programs)


def phases(rank: int, n_ranks: int, n_microbatches: int) -> list[str]:
    """Rank ``rank``'s program as the module doc's words (``"F0"``, ``"B1W"``, ``"B0"``, ``"W"``), in order."""
    r, p, m = rank, n_ranks, n_microbatches
    cool_down = ["B1", "B0"] * (r + 1)  # phase 6: the first r + 1 backwards whole, the rest leave their W
    return (
        ["F0"] * (2 * (p - r - 1))
        + ["F0", "F1"] * (r + 1)
        + ["B1", "W", "F1"] * (p - r - 1)
        + ["F0", "B1W", "F1", "B0W"] * (m - 2 * p + r + 1)
        + ["B1W", "F1", "B0W"] * (p - r - 1)
        + [word + "W" for word in cool_down[: r + 1]] + cool_down[r + 1:]
        + ["W", "B0"] * (p - r - 1)
        + ["W"] * (r + 1)
    )


def _realize(words: list[str], rank: int, n_ranks: int) -> list[Action]:
    """Actions for ``words``: each chunk's next microbatch for ``F`` and ``B``, a FIFO of waiting ``W``."""
    stage = (rank, 2 * n_ranks - 1 - rank)  # chunk -> stage
    next_mb = {(kind, chunk): 0 for kind in (F, B) for chunk in (0, 1)}
    waiting: list[Action] = []
    program: list[Action] = []
    for word in words:
        if word == W:
            program.append(waiting.pop(0))
            continue
        kind, chunk = word[0], int(word[1])
        action = Action(stage[chunk], kind, next_mb[kind, chunk])
        next_mb[kind, chunk] += 1
        program.append(action)
        if kind == B:
            waiting.append(Action(action.stage, W, action.microbatch))
            if word.endswith(W):  # a whole backward: its W right away
                program.append(waiting.pop())
    return program
