"""Dry-run a pipeline schedule: find deadlocks and broken dependencies, measure the bubble.

`simulate` runs every rank's program in order, as the runtime would, with
fixed durations per action, and either returns a `SimResult` or raises a
`ScheduleError` that names the rank, the action and what it waits for.

A schedule is accepted when:

- every (stage, microbatch) has exactly one ``F`` and one ``B``;
- every SEND has exactly one matching RECV on the peer stage's (other) rank,
  and every RECV one matching SEND;
- on one rank, nothing runs before what it consumes from that rank:
  ``B(s, m)`` after ``F(s, m)``, ``W(s, m)`` after ``B(s, m)``; ``F(s, m)`` after ``F(s - 1, m)`` and
  ``B(s, m)`` after ``B(s + 1, m)`` when those stages share the rank; a SEND
  after the compute whose result it sends; with communication, a compute
  after the RECV of its input;
- step actions (``autopar.core.step_schedule``) sit where they mean something:
  ``UNSHARD(s)`` before stage ``s``'s first action and ``RESHARD(s)`` after
  its last, each rank-wide action (``REDUCE_GRAD``, ``OPTIMIZER``, ...) at most
  once and after all of its rank's pipeline work. A rank-wide action is a
  collective of the ranks whose programs hold it: it starts once all of them
  have reached it;
- a forward-only schedule (no ``B`` at all) needs only the ``F`` actions;
- across ranks nothing deadlocks. In a compute-only schedule the dependencies
  between stages are waited on directly (``F(s, m)`` waits for ``F(s - 1, m)``
  to finish, ``B(s, m)`` for ``B(s + 1, m)``); in a schedule with
  communication they go through the receives.

Time model (the semantics of `autopar.core.schedule`): ``F`` takes
``forward_time``, ``B`` ``backward_time`` (split: ``B`` and ``W`` share it); a SEND takes no time on its rank
and never blocks; a RECV blocks until ``comm_time`` after the matching SEND
was issued (in a compute-only schedule, a compute waits ``comm_time`` after
the producing compute on another rank finished, so both forms of a schedule
take the same time). Step actions take no time. Only ``F``, ``B`` and ``W`` count as busy time, so
``bubble_fraction = sum over ranks of (makespan - busy) / (ranks * makespan)``.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

from autopar.core.schedule import (
    B, F, W, RANK_KINDS, RECV_B, RECV_F, REDUCE_GRAD, RESHARD, SEND_B, SEND_F, STAGE_KINDS, UNSHARD, Action, Schedule,
)

Key = tuple[int, Action]  # (rank, action): rank-wide actions have no stage, so the rank tells them apart


class ScheduleError(ValueError):
    """A schedule that would deadlock, miss work, or run something before its inputs exist."""


class Event(NamedTuple):
    """One executed action: on ``rank`` from ``start`` to ``end``."""

    rank: int
    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class SimResult:
    """What a dry run of a schedule measured.

    ``busy_time[rank]`` is that rank's compute time; ``peak_in_flight[stage]``
    the most microbatches whose ``F`` had run on that stage while their ``B``
    (their ``W``, when the backward is split) had not (what the stage must hold
    activations for); ``rank_peak_in_flight[rank]`` the most such
    (stage, microbatch) pairs held at once over all of the rank's stages (with
    one stage per rank, that stage's peak).
    """

    makespan: float
    busy_time: tuple[float, ...]
    bubble_fraction: float
    peak_in_flight: tuple[int, ...]
    timeline: tuple[Event, ...]
    rank_peak_in_flight: tuple[int, ...] = ()


def _check_complete(schedule: Schedule) -> None:
    """Exactly one F and one B per (stage, microbatch), and one W or none at all; no B or W in a forward-only
    schedule."""
    counts = Counter((a.kind, a.stage, a.microbatch) for program in schedule.actions for a in program)
    kinds = (F,) if schedule.is_forward_only else (F, B, W) if schedule.splits_backward else (F, B)
    for stage in range(schedule.n_stages):
        rank = schedule.stage_to_rank[stage]
        for microbatch in range(schedule.n_microbatches):
            for kind in kinds:
                n = counts[(kind, stage, microbatch)]
                if n != 1:
                    what = f"has no {kind}" if n == 0 else f"has {n} {kind} actions"
                    raise ScheduleError(
                        f"stage {stage} microbatch {microbatch} {what} (expected exactly one "
                        f"{Action(stage, kind, microbatch)} in rank {rank}'s program)"
                    )


def _check_pairs(schedule: Schedule) -> None:
    """Every SEND/RECV crosses ranks, appears once and has its partner."""
    counts = Counter(a for program in schedule.actions for a in program if a.is_comm)
    for action, n in counts.items():
        rank = schedule.stage_to_rank[action.stage]
        if n > 1:
            raise ScheduleError(f"rank {rank} runs {action} {n} times; each transfer happens once")
        partner = action.matching()
        peer_rank = schedule.stage_to_rank[partner.stage]
        if peer_rank == rank:
            raise ScheduleError(
                f"rank {rank}: {action} talks to stage {partner.stage} on the same rank; "
                f"stages on one rank pass values directly, without SEND/RECV"
            )
        if partner not in counts:
            raise ScheduleError(f"rank {rank}: {action} has no matching {partner} on rank {peer_rank}")


def _check_step_actions(schedule: Schedule) -> None:
    """UNSHARD/RESHARD bracket their stage; rank-wide actions come once, after the rank's pipeline work."""
    for rank, program in enumerate(schedule.actions):
        pipeline = [i for i, a in enumerate(program) if a.is_compute or a.is_comm]
        seen: set[Action] = set()
        for i, action in enumerate(program):
            if action.kind in RANK_KINDS:
                if action in seen:
                    raise ScheduleError(f"rank {rank} runs {action} twice; a step runs each of its collectives once")
                seen.add(action)
                if pipeline and i < pipeline[-1]:
                    raise ScheduleError(f"rank {rank} runs {action} before {program[pipeline[-1]]}: the step's "
                                        "collectives come after all of the rank's pipeline work")
            elif action.kind in STAGE_KINDS:
                mine = [j for j in pipeline if program[j].stage == action.stage]
                if mine and ((action.kind == UNSHARD and i > mine[0]) or (action.kind == RESHARD and i < mine[-1])):
                    where = "before its first action" if action.kind == UNSHARD else "after its last action"
                    raise ScheduleError(f"rank {rank} runs {action} out of place: it belongs {where}")


def _needs(schedule: Schedule, rank: int, i: int, lowered: bool) -> tuple[list[Key], list[Key]]:
    """What action ``i`` of ``rank``'s program consumes: (actions on its own rank, actions on other ranks)."""
    action = schedule.actions[rank][i]
    s, m = action.stage, action.microbatch
    local: list[Action] = []
    remote: list[Action] = []

    def neighbour(peer: int, kind: str, recv_kind: str) -> None:
        if schedule.stage_to_rank[peer] == rank:
            local.append(Action(peer, kind, m))
        elif lowered:
            local.append(Action(s, recv_kind, m))
        else:
            remote.append(Action(peer, kind, m))

    if action.kind == F and s > 0:
        neighbour(s - 1, F, RECV_F)
    elif action.kind == B:
        local.append(Action(s, F, m))
        if s < schedule.n_stages - 1:
            neighbour(s + 1, B, RECV_B)
    elif action.kind == W:
        local.append(Action(s, B, m))
    elif action.kind in (SEND_F, SEND_B):
        local.append(Action(s, F if action.kind == SEND_F else B, m))
    elif action.kind in (RECV_F, RECV_B):
        remote.append(action.matching())
    elif action.kind == REDUCE_GRAD:
        local += [a for a in schedule.actions[rank] if a.kind in (B, W)]
    elif action.kind in RANK_KINDS:  # a collective: every rank holding it must have reached it
        return [], [_reached(schedule, peer, action) for peer in range(schedule.n_ranks)
                    if peer != rank and action in schedule.actions[peer]
                    and schedule.actions[peer].index(action) > 0]
    owner = schedule.stage_to_rank.__getitem__
    return [(rank, a) for a in local], [(owner(a.stage), a) for a in remote]


def _reached(schedule: Schedule, rank: int, action: Action) -> Key:
    """What ``rank`` must have finished to be at ``action``: the action before it in its program."""
    program = schedule.actions[rank]
    return rank, program[program.index(action) - 1]


def _out_of_order(rank: int, action: Action, missing: Action) -> ScheduleError:
    if action.kind == B and missing.kind == F and missing.stage == action.stage:
        why = "a microbatch's backward needs its forward first"
    elif missing.kind in (RECV_F, RECV_B):
        why = "its input comes from another rank and must be received first"
    elif action.kind in (SEND_F, SEND_B):
        why = "a send needs the result it sends"
    else:
        why = "it consumes that action's result"
    return ScheduleError(f"rank {rank} runs {action} before {missing}: {why}")


def _deadlock(schedule: Schedule, pcs: list[int], waits: dict[int, Key]) -> ScheduleError:
    lines = []
    for rank, (owner, needed) in sorted(waits.items()):
        at = schedule.actions[rank][pcs[rank]]
        if at.kind in RANK_KINDS:
            lines.append(f"rank {rank} is stuck at {at} waiting for rank {owner} to reach it")
        else:
            lines.append(f"rank {rank} is stuck at {at} waiting for {needed} on rank {owner}")
    return ScheduleError("deadlock: " + "; ".join(lines))


def _try_run(
    schedule: Schedule, rank: int, i: int, lowered: bool, finished: dict[Key, float],
    clock: float, duration: dict[str, float], comm_time: float,
) -> Event | Key:
    """Run action ``i`` of ``rank``, free from ``clock``: its `Event`, or the remote action it still waits for."""
    action = schedule.actions[rank][i]
    local, remote = _needs(schedule, rank, i, lowered)
    for needed in local:
        if needed not in finished:
            raise _out_of_order(rank, action, needed[1])
    for needed in remote:
        if needed not in finished:
            return needed
    if action.kind in RANK_KINDS:  # a collective starts when the last rank reaches it
        start = max([clock, *(finished[needed] for needed in remote)])
        return Event(rank, start, start, action)
    # A value from another rank arrives comm_time after it was produced or sent.
    ready = max((finished[needed] + comm_time for needed in remote), default=0.0)
    if action.kind in (RECV_F, RECV_B):  # posted at once, blocks until the value is there
        return Event(rank, clock, max(clock, ready), action)
    start = max(clock, ready)
    return Event(rank, start, start + duration.get(action.kind, 0.0), action)


def simulate(
    schedule: Schedule, forward_time: float = 1.0, backward_time: float = 2.0, comm_time: float = 0.0,
    weight_time: float | None = None,
) -> SimResult:
    """Run ``schedule`` in a dry run; raise `ScheduleError` if it is broken (see the module docstring).

    ``backward_time`` is a whole backward's; in a schedule that splits it, ``W``
    takes ``weight_time`` (default half of it) and ``B`` the rest.
    """
    duration = _durations(schedule.splits_backward, forward_time, backward_time, comm_time, weight_time)
    _check_complete(schedule)
    _check_pairs(schedule)
    _check_step_actions(schedule)
    lowered = any(a.is_comm for program in schedule.actions for a in program) or schedule.n_ranks == 1
    finished: dict[Key, float] = {}  # (rank, action) -> the time it finished
    clocks = [0.0] * schedule.n_ranks
    pcs = [0] * schedule.n_ranks
    timeline: list[Event] = []
    progress = True
    while progress:  # run every rank as far as it can; stop when no rank can move
        progress = False
        waits: dict[int, Key] = {}
        for rank, program in enumerate(schedule.actions):
            while pcs[rank] < len(program):
                outcome = _try_run(schedule, rank, pcs[rank], lowered, finished, clocks[rank], duration, comm_time)
                if not isinstance(outcome, Event):
                    waits[rank] = outcome
                    break
                finished[(rank, outcome.action)] = clocks[rank] = outcome.end
                timeline.append(outcome)
                pcs[rank] += 1
                progress = True
    if any(pc < len(program) for pc, program in zip(pcs, schedule.actions)):
        raise _deadlock(schedule, pcs, waits)
    return _result(schedule, timeline, duration)


def _durations(splits_backward: bool, forward_time: float, backward_time: float, comm_time: float,
               weight_time: float | None) -> dict[str, float]:
    """The duration of each compute kind (``simulate``'s time model), the arguments checked."""
    weight_time = backward_time / 2 if weight_time is None else weight_time
    if not (forward_time > 0 and backward_time > 0 and comm_time >= 0 and 0 < weight_time < backward_time):
        raise ValueError(
            f"durations must be forward_time > 0, backward_time > weight_time > 0, comm_time >= 0; "
            f"got {forward_time}, {backward_time}, {weight_time}, {comm_time}"
        )
    if splits_backward:
        return {F: forward_time, B: backward_time - weight_time, W: weight_time}
    return {F: forward_time, B: backward_time}


@dataclass(frozen=True)
class Timing:
    """A compute-only schedule prepared to be timed at many durations (the planner's pipeline bubble).

    ``Timing.of(schedule).makespan(...)`` is ``simulate(schedule, ...).makespan``, the same time model without
    the checks and the timeline: ``steps`` holds every action once, in an order in which each comes after
    the actions it waits for (its rank's previous one, and the other stage's it consumes).
    """

    n_ranks: int
    splits_backward: bool
    # (rank, kind, the position of the other stage's action it consumes or -1, whether that one runs elsewhere)
    steps: tuple[tuple[int, str, int, bool], ...]

    @classmethod
    def of(cls, schedule: Schedule) -> Timing:
        """``schedule``'s actions in the order ``simulate``'s loop reaches them: each rank in turn as far as the
        actions it consumes from other stages have run.

        A schedule it would reject, when no such order exists, is handed to it so that its error is raised.
        """
        if not schedule.is_compute_only:
            raise ValueError("Timing takes a compute-only schedule (no SEND/RECV or step actions); use simulate")
        last, owner = schedule.n_stages - 1, schedule.stage_to_rank
        position: dict[tuple[str, int, int], int] = {}  # (kind, stage, microbatch) -> its place in ``steps``
        steps: list[tuple[int, str, int, bool]] = []
        pcs = [0] * schedule.n_ranks
        progress = True
        while progress:  # run every rank as far as the actions it consumes from other stages have run
            progress = False
            for rank, program in enumerate(schedule.actions):
                while pcs[rank] < len(program):
                    a = program[pcs[rank]]
                    s, mb = a.stage, a.microbatch
                    need = (F, s - 1, mb) if a.kind == F and s > 0 else (B, s + 1, mb) if a.kind == B and s < last \
                        else None
                    if need is not None and need not in position:
                        break
                    position[(a.kind, s, mb)] = len(steps)
                    steps.append((rank, a.kind, -1 if need is None else position[need],
                                  need is not None and owner[need[1]] != rank))
                    pcs[rank] += 1
                    progress = True
        if len(steps) < sum(map(len, schedule.actions)) or len(position) < len(steps):
            simulate(schedule)  # raises, naming the deadlock or the repeated action
        return cls(schedule.n_ranks, schedule.splits_backward, tuple(steps))

    def makespan(self, forward_time: float = 1.0, backward_time: float = 2.0, comm_time: float = 0.0,
                 weight_time: float | None = None) -> float:
        """When the last rank finishes, every ``F``, ``B`` and ``W`` taking the given times (``simulate``'s)."""
        duration = _durations(self.splits_backward, forward_time, backward_time, comm_time, weight_time)
        finished = [0.0] * len(self.steps)
        clocks = [0.0] * self.n_ranks
        for i, (rank, kind, need, remote) in enumerate(self.steps):
            start = clocks[rank]
            if need >= 0:
                start = max(start, finished[need] + comm_time * remote)
            clocks[rank] = finished[i] = start + duration[kind]
        return max(clocks)


def _peak_in_flight(schedule: Schedule) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per stage and per rank, the most microbatches forwarded and not yet backwarded, along the rank's program."""
    in_flight = [0] * schedule.n_stages
    peak = [0] * schedule.n_stages
    rank_peak = [0] * schedule.n_ranks
    done = W if schedule.splits_backward else B  # a microbatch's activations are freed by its last backward part
    for rank, program in enumerate(schedule.actions):
        held = 0
        for action in program:
            if action.kind in (F, done):
                step = 1 if action.kind == F else -1
                in_flight[action.stage] += step
                held += step
                peak[action.stage] = max(peak[action.stage], in_flight[action.stage])
                rank_peak[rank] = max(rank_peak[rank], held)
    return tuple(peak), tuple(rank_peak)


def _result(schedule: Schedule, timeline: list[Event], duration: dict[str, float]) -> SimResult:
    makespan = max(event.end for event in timeline)
    busy = [0.0] * schedule.n_ranks
    for event in timeline:
        busy[event.rank] += duration.get(event.action.kind, 0.0)
    idle = sum(makespan - b for b in busy)
    timeline.sort(key=lambda e: (e.start, e.rank))  # stable: program order among equal starts
    fraction = idle / (schedule.n_ranks * makespan)
    peak, rank_peak = _peak_in_flight(schedule)
    return SimResult(makespan, tuple(busy), fraction, peak, tuple(timeline), rank_peak)


def check_channel_order(schedule: Schedule) -> None:
    """Check that between any two ranks, messages are received in the order they are sent.

    `simulate` matches a RECV to its SEND by identity. A transport that pairs
    the point-to-point operations of two ranks by posting order instead
    (NCCL, or gloo with one tag) also needs this: for every (sender, receiver)
    pair, the sender's SENDs and the receiver's RECVs name the same transfers
    in the same order. The lowered generator schedules always pass.
    """
    sent: dict[tuple[int, int], list[Action]] = {}
    received: dict[tuple[int, int], list[Action]] = {}
    for rank, program in enumerate(schedule.actions):
        for action in program:
            if action.kind in (SEND_F, SEND_B):
                peer = schedule.stage_to_rank[action.peer_stage]
                sent.setdefault((rank, peer), []).append(action)
            elif action.kind in (RECV_F, RECV_B):
                peer = schedule.stage_to_rank[action.peer_stage]
                received.setdefault((peer, rank), []).append(action.matching())
    for src, dst in sorted(set(sent) | set(received)):
        sends, recvs = sent.get((src, dst), []), received.get((src, dst), [])
        for i, (send, recv) in enumerate(zip(sends, recvs)):
            if send != recv:
                raise ScheduleError(
                    f"rank {src} -> rank {dst}: transfer {i} is {send} on rank {src}, but rank {dst} posts "
                    f"{recv.matching()} there (the receive of {recv}); post sends and receives in the same order"
                )
        if len(sends) != len(recvs):
            raise ScheduleError(f"rank {src} -> rank {dst}: {len(sends)} sends but {len(recvs)} receives")


def render(schedule: Schedule) -> str:
    """A rank x time-step table of the compute, every ``F``, ``B`` and ``W`` taking one step.

    Cells read ``F0`` / ``B3`` (with the stage in front, ``2F0``, when ranks
    hold several stages); ``.`` is an idle step. Communication is not shown.
    """
    split = schedule.splits_backward  # then B and W take one step each
    result = simulate(schedule, forward_time=1.0, backward_time=2.0 if split else 1.0, comm_time=0.0,
                      weight_time=1.0 if split else None)
    n_steps = round(result.makespan)
    show_stage = schedule.n_stages > schedule.n_ranks
    grid = [["."] * n_steps for _ in range(schedule.n_ranks)]
    for event in result.timeline:
        if event.action.is_compute:
            a = event.action
            grid[event.rank][round(event.start)] = str(a) if show_stage else f"{a.kind}{a.microbatch}"
    header = ["time"] + [str(step) for step in range(n_steps)]
    rows = [header] + [[f"rank {rank}"] + cells for rank, cells in enumerate(grid)]
    widths = [max(len(row[col]) for row in rows) for col in range(len(header))]
    return "\n".join(" ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
