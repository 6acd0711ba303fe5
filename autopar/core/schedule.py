"""Pipeline schedules as data: actions, schedules, generators and the communication lowering.

A pipeline cuts the model into ``n_stages`` stages, spread over ``n_ranks``
pipeline ranks; every rank runs a plain list of `Action` values in order. The
generators (`gpipe`, `one_f_one_b`, `interleaved_1f1b`, `zb_h1`; the V-shaped `zbv` and
`dualpipev` in modules of their own) are pure functions of the sizes and return *compute-only* schedules: each rank's list holds one ``F``
and one ``B`` (and, for `zb_h1`, one ``W``) per (stage it owns, microbatch), and
nothing else.
``autopar.core.schedules`` names them (``make_schedule``). `add_communication` lowers such a schedule to one that also says where values
cross ranks. `autopar.core.simulate` checks a schedule (deadlock, completeness, data
dependencies) and measures its bubble before anything runs.

Placement. Stage ``s`` lives on rank ``s % n_ranks`` (`looped_placement`): with
``v`` stages per rank, rank ``r`` holds stages ``r, r + p, r + 2p, ...``, the
placement of Megatron's interleaved 1F1B. `Schedule` itself accepts any
placement in which every rank holds at least one stage.

A schedule may split a backward in two: then ``B(s, m)`` computes only the
gradient of the stage's input (what the previous stage waits for) and
``W(s, m)`` the gradients of its weights, which can wait (zero-bubble
schedules, Qi et al. 2023). A schedule has a ``W`` for every ``B`` or none.

Communication actions carry the stage *of the rank that runs them*:

- ``SEND_F(s, m)`` sends stage ``s``'s forward output for microbatch ``m`` to
  stage ``s + 1``; it pairs with ``RECV_F(s + 1, m)``.
- ``SEND_B(s, m)`` sends the gradient of stage ``s``'s input to stage ``s - 1``;
  it pairs with ``RECV_B(s - 1, m)``.

Semantics assumed for communication (the runtime uses batched non-blocking
``isend`` / ``irecv``): a SEND never blocks its rank (the transfer completes
when the matching RECV is posted), and a RECV blocks its rank until the
matching SEND has been issued. Sends and receives are matched by identity
(kind, stage, microbatch), not by position. `add_communication` puts each SEND
right after the compute that produces the value and each RECV right before the
compute that consumes it, so the lowered schedule deadlocks exactly when the
compute-only one does.

Invariants `Schedule` checks on construction (structure only; completeness and
ordering are the simulator's job, so that broken schedules can be built and
diagnosed): every action's stage and microbatch exist, every action sits in the
list of the rank that owns its stage, and no communication action points past
the first or last stage.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Sequence



class Kind(str, Enum):
    """What an action does. A kind equals its name as a string (``Kind.F == "F"``) and prints as it, so that
    schedules read, print and parse as text."""

    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"
    REDUCE_SHARED = "REDUCE_SHARED"
    OPTIMIZER = "OPTIMIZER"
    BROADCAST_LOSS = "BROADCAST_LOSS"
    BROADCAST_OUTPUTS = "BROADCAST_OUTPUTS"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


F, B, W = Kind.F, Kind.B, Kind.W
SEND_F, RECV_F, SEND_B, RECV_B = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
UNSHARD, RESHARD = Kind.UNSHARD, Kind.RESHARD
REDUCE_GRAD, REDUCE_SHARED, OPTIMIZER = Kind.REDUCE_GRAD, Kind.REDUCE_SHARED, Kind.OPTIMIZER
BROADCAST_LOSS, BROADCAST_OUTPUTS = Kind.BROADCAST_LOSS, Kind.BROADCAST_OUTPUTS
COMPUTE_KINDS = (F, B, W)
COMM_KINDS = (SEND_F, RECV_F, SEND_B, RECV_B)
STAGE_KINDS = (UNSHARD, RESHARD)  # of one stage, for no microbatch (see autopar.core.step_schedule)
RANK_KINDS = (REDUCE_GRAD, REDUCE_SHARED, OPTIMIZER, BROADCAST_LOSS, BROADCAST_OUTPUTS)  # of the whole rank
KINDS = COMPUTE_KINDS + COMM_KINDS + STAGE_KINDS + RANK_KINDS

# Stage offset of the peer of a communication action: SEND_F(s) talks to s + 1, ...
_PEER_OFFSET = {SEND_F: 1, RECV_F: -1, SEND_B: -1, RECV_B: 1}
_MATCHING_KIND = {SEND_F: RECV_F, RECV_F: SEND_F, SEND_B: RECV_B, RECV_B: SEND_B}
_KIND_RE = "|".join(sorted(KINDS, key=len, reverse=True))
_ACTION_RE = re.compile(rf"(\d*)({_KIND_RE})(\d*)", re.ASCII)


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` of ``stage`` for ``microbatch``; prints as ``"2F0"``.

    Compute and communication actions name a stage and a microbatch;
    ``UNSHARD``/``RESHARD`` a stage only (``"1UNSHARD"``); the step actions of
    the whole rank (``REDUCE_GRAD``, ``OPTIMIZER``, ...) neither.
    """

    stage: int | None
    kind: Kind  # (a kind's name is accepted too: Action(0, "F", 1))
    microbatch: int | None = None

    def __post_init__(self) -> None:
        if type(self.kind) is Kind and self.kind in COMPUTE_KINDS and type(self.stage) is int \
                and type(self.microbatch) is int and self.stage >= 0 and self.microbatch >= 0:
            return  # the common case, valid (the generators make thousands)
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; the kinds are {', '.join(KINDS)}")
        object.__setattr__(self, "kind", Kind(self.kind))
        has_stage = self.kind not in RANK_KINDS
        has_microbatch = self.kind in COMPUTE_KINDS + COMM_KINDS
        for name, needed in (("stage", has_stage), ("microbatch", has_microbatch)):
            value = getattr(self, name)
            if not needed:
                if value is not None:
                    raise ValueError(f"a {self.kind} action has no {name}, got {name}={value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"action {name} must be an integer >= 0, got {value!r}")

    def __str__(self) -> str:
        stage = "" if self.stage is None else self.stage
        microbatch = "" if self.microbatch is None else self.microbatch
        return f"{stage}{self.kind}{microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action printed as ``text``, e.g. ``Action.parse("1SEND_F3")`` or ``Action.parse("OPTIMIZER")``."""
        match = _ACTION_RE.fullmatch(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><kind><microbatch> with kind one of "
                f"{', '.join(KINDS)}, e.g. '2F0', '1SEND_F3', '0UNSHARD' or 'OPTIMIZER'"
            )
        stage, kind, microbatch = match.groups()
        try:
            return cls(int(stage) if stage else None, kind, int(microbatch) if microbatch else None)
        except ValueError as e:
            raise ValueError(f"cannot parse action {text!r}: {e}") from None

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        """A point-to-point transfer between pipeline ranks (SEND/RECV)."""
        return self.kind in COMM_KINDS

    @property
    def peer_stage(self) -> int:
        """The stage a communication action sends to or receives from."""
        if self.kind not in _PEER_OFFSET:
            raise ValueError(f"{self} is a {self.kind} action; only communication actions have a peer stage")
        return self.stage + _PEER_OFFSET[self.kind]

    def matching(self) -> Action:
        """The communication action on the peer stage that pairs with this one."""
        return Action(self.peer_stage, _MATCHING_KIND[self.kind], self.microbatch)


def parse_program(text: str | Iterable[str]) -> tuple[Action, ...]:
    """Actions from ``"0F0 0F1 0B0"`` (or from a list of such words)."""
    words = text.split() if isinstance(text, str) else list(text)
    return tuple(Action.parse(word) for word in words)


def looped_placement(n_ranks: int, n_stages: int) -> tuple[int, ...]:
    """Stage ``s`` on rank ``s % n_ranks``: rank ``r`` holds stages ``r, r + p, r + 2p, ...``."""
    return tuple(stage % n_ranks for stage in range(n_stages))


@dataclass(frozen=True)
class Schedule:
    """What every pipeline rank runs: ``actions[rank]`` is that rank's program, in order.

    Lists given for ``stage_to_rank`` and ``actions`` are stored as tuples.
    """

    n_ranks: int
    n_stages: int
    n_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        for name in ("n_ranks", "n_stages", "n_microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Schedule.{name} must be an integer >= 1, got {value!r}")
        object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))
        object.__setattr__(self, "actions", tuple(tuple(program) for program in self.actions))
        self._check_placement()
        self._check_actions()

    def _check_placement(self) -> None:
        if len(self.stage_to_rank) != self.n_stages:
            raise ValueError(
                f"stage_to_rank has {len(self.stage_to_rank)} entries for {self.n_stages} stages; "
                f"give one rank per stage, e.g. looped_placement({self.n_ranks}, {self.n_stages})"
            )
        for stage, rank in enumerate(self.stage_to_rank):
            if not 0 <= rank < self.n_ranks:
                raise ValueError(f"stage {stage} is placed on rank {rank}, outside ranks 0..{self.n_ranks - 1}")
        empty = sorted(set(range(self.n_ranks)) - set(self.stage_to_rank))
        if empty:
            raise ValueError(f"ranks {empty} hold no stage; every pipeline rank needs at least one stage")

    def _check_actions(self) -> None:
        if len(self.actions) != self.n_ranks:
            raise ValueError(f"actions has {len(self.actions)} programs for {self.n_ranks} ranks; give one per rank")
        for rank, program in enumerate(self.actions):
            for action in program:
                if not isinstance(action, Action):
                    raise ValueError(f"rank {rank}: {action!r} is not an Action (use Action.parse for text)")
                if action.stage is None:
                    continue
                if not action.stage < self.n_stages:
                    raise ValueError(
                        f"rank {rank}: {action} names stage {action.stage}, but there are {self.n_stages}"
                    )
                if action.microbatch is not None and not action.microbatch < self.n_microbatches:
                    raise ValueError(
                        f"rank {rank}: {action} names microbatch {action.microbatch}, "
                        f"but there are {self.n_microbatches}"
                    )
                owner = self.stage_to_rank[action.stage]
                if owner != rank:
                    raise ValueError(
                        f"{action} is in rank {rank}'s program, but stage {action.stage} lives on rank {owner}"
                    )
                if action.is_comm and not 0 <= action.peer_stage < self.n_stages:
                    raise ValueError(
                        f"rank {rank}: {action} talks to stage {action.peer_stage}, which does not exist"
                    )

    @property
    def is_compute_only(self) -> bool:
        return all(action.is_compute for program in self.actions for action in program)

    @property
    def splits_backward(self) -> bool:
        """Backwards are split into ``B`` (input gradients) and ``W`` (weight gradients)."""
        return any(action.kind == W for program in self.actions for action in program)

    @property
    def is_forward_only(self) -> bool:
        """No backward anywhere: the schedule of a forward pass (``pm(x)``)."""
        return not any(action.kind == B for program in self.actions for action in program)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` holds, in increasing order."""
        return tuple(stage for stage, owner in enumerate(self.stage_to_rank) if owner == rank)

    def __str__(self) -> str:
        lines = (f"rank {rank}: {' '.join(map(str, program))}" for rank, program in enumerate(self.actions))
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# Generators: pure functions of the sizes returning compute-only schedules.
# ---------------------------------------------------------------------------


def _check_positive(schedule_name: str, **sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{schedule_name}: {name} must be an integer >= 1, got {value!r}")


def _compute_only(
    n_ranks: int, n_stages: int, n_microbatches: int, programs: Sequence[Sequence[Action]]
) -> Schedule:
    placement = looped_placement(n_ranks, n_stages)
    return Schedule(n_ranks, n_stages, n_microbatches, placement, tuple(map(tuple, programs)))


def _warmup_then_1f1b(forwards: Sequence[Action], backwards: Sequence[Action], n_warmup: int) -> list[Action]:
    """``n_warmup`` forwards, then one forward and one backward in turn, then the remaining backwards."""
    program = list(forwards[:n_warmup])
    steady = forwards[n_warmup:]
    for forward, backward in zip(steady, backwards):
        program += [forward, backward]
    return program + list(backwards[len(steady):])


def gpipe(n_ranks: int, n_microbatches: int) -> Schedule:
    """GPipe: every rank runs all its forwards, then all its backwards, in microbatch order.

    Peak in-flight microbatches per stage is ``n_microbatches``.
    """
    _check_positive("gpipe", n_ranks=n_ranks, n_microbatches=n_microbatches)
    programs = [
        [Action(rank, kind, m) for kind in (F, B) for m in range(n_microbatches)] for rank in range(n_ranks)
    ]
    return _compute_only(n_ranks, n_ranks, n_microbatches, programs)


def one_f_one_b(n_ranks: int, n_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush, Megatron's non-interleaved schedule).

    Rank ``r`` runs ``min(p - r - 1, m)`` warm-up forwards, then alternates one
    forward and one backward, then runs the remaining backwards. At most
    ``min(p - r, m)`` microbatches are in flight on stage ``r``.
    """
    _check_positive("1f1b", n_ranks=n_ranks, n_microbatches=n_microbatches)
    programs = []
    for rank in range(n_ranks):
        forwards = [Action(rank, F, m) for m in range(n_microbatches)]
        backwards = [Action(rank, B, m) for m in range(n_microbatches)]
        programs.append(_warmup_then_1f1b(forwards, backwards, min(n_ranks - rank - 1, n_microbatches)))
    return _compute_only(n_ranks, n_ranks, n_microbatches, programs)


def _interleaved_order(
    rank: int, n_ranks: int, n_chunks: int, n_microbatches: int, kind: str
) -> list[Action]:
    """Rank ``rank``'s forwards (or backwards) in interleaved order.

    Microbatches go in groups of ``p``: a group runs through chunk 0, then
    chunk 1, ... (backwards: the last chunk first) before the next group
    starts. Chunk ``c`` of rank ``r`` is stage ``c * p + r``.
    """
    order = []
    per_group = n_ranks * n_chunks
    for k in range(n_microbatches * n_chunks):
        group, within = divmod(k, per_group)
        chunk = within // n_ranks if kind == F else n_chunks - 1 - within // n_ranks
        microbatch = group * n_ranks + within % n_ranks
        order.append(Action(chunk * n_ranks + rank, kind, microbatch))
    return order


def interleaved_1f1b(n_ranks: int, n_stages_per_rank: int, n_microbatches: int) -> Schedule:
    """Megatron's interleaved 1F1B (Narayanan et al., 2021) with ``v`` chunks per rank.

    The model has ``p * v`` stages, placed looped (stage ``s`` on rank
    ``s % p``). Rank ``r`` runs ``min((p - r - 1) * 2 + (v - 1) * p, m * v)``
    warm-up forwards, then alternates one forward and one backward, then runs
    the remaining backwards, in the order of `_interleaved_order`. The bubble
    shrinks by a factor ``v`` against 1F1B at the price of ``v`` times the
    point-to-point traffic. Needs ``m`` to be a multiple of ``p``; with
    ``v == 1`` it is exactly `one_f_one_b` (any ``m``).
    """
    _check_positive(
        "interleaved-1f1b", n_ranks=n_ranks, n_stages_per_rank=n_stages_per_rank, n_microbatches=n_microbatches
    )
    p, v, m = n_ranks, n_stages_per_rank, n_microbatches
    if v == 1:
        return one_f_one_b(p, m)
    if m % p:
        below = (m // p) * p
        choices = f"{below} or {below + p}" if below else f"{p}"
        raise ValueError(
            f"interleaved-1f1b runs microbatches in groups of pp={p}, so microbatches must be a multiple "
            f"of {p}; {m} is not. Use microbatches={choices}, or n_stages_per_rank=1 (plain 1F1B)"
        )
    programs = []
    for rank in range(p):
        forwards = _interleaved_order(rank, p, v, m, F)
        backwards = _interleaved_order(rank, p, v, m, B)
        n_warmup = min((p - rank - 1) * 2 + (v - 1) * p, m * v)
        programs.append(_warmup_then_1f1b(forwards, backwards, n_warmup))
    return _compute_only(p, p * v, m, programs)


def zb_h1(n_ranks: int, n_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., 2023): 1F1B with each backward split into ``B`` and a deferred ``W``.

    Rank ``r`` runs 1F1B's warm-up forwards and then its forward/backward
    alternation, where ``B`` computes only the input gradient the previous
    rank waits for; the weight gradients ``W`` follow their ``B`` in order,
    at most ``r`` of them held back. The held-back ``W`` fill the waits of
    the cool-down, so with ``W`` as long as ``B`` the bubble is a third of
    1F1B's, while every rank holds at most ``p`` microbatches (1F1B's peak).
    """
    _check_positive("zb-h1", n_ranks=n_ranks, n_microbatches=n_microbatches)
    programs = []
    for rank in range(n_ranks):
        forwards = [Action(rank, F, m) for m in range(n_microbatches)]
        backwards = [Action(rank, B, m) for m in range(n_microbatches)]
        program: list[Action] = []
        held: list[Action] = []
        for action in _warmup_then_1f1b(forwards, backwards, min(n_ranks - rank - 1, n_microbatches)):
            program.append(action)
            if action.kind == B:
                held.append(Action(rank, W, action.microbatch))
                if len(held) > rank:
                    program.append(held.pop(0))
        programs.append(program + held)
    return _compute_only(n_ranks, n_ranks, n_microbatches, programs)


# ---------------------------------------------------------------------------
# Lowering: compute-only schedule -> schedule with explicit communication.
# ---------------------------------------------------------------------------


def _crosses_ranks(schedule: Schedule, stage: int, peer: int) -> bool:
    return 0 <= peer < schedule.n_stages and schedule.stage_to_rank[stage] != schedule.stage_to_rank[peer]


def _lower_action(schedule: Schedule, action: Action) -> list[Action]:
    """``action`` with the receive it waits on before it and the send of its result after it."""
    s, m = action.stage, action.microbatch
    if action.kind == W:  # weight gradients stay on the rank
        return [action]
    if action.kind == F:
        before = [Action(s, RECV_F, m)] if _crosses_ranks(schedule, s, s - 1) else []
        after = [Action(s, SEND_F, m)] if _crosses_ranks(schedule, s, s + 1) else []
    else:
        before = [Action(s, RECV_B, m)] if _crosses_ranks(schedule, s, s + 1) else []
        after = [Action(s, SEND_B, m)] if _crosses_ranks(schedule, s, s - 1) else []
    return before + [action] + after


def add_communication(schedule: Schedule) -> Schedule:
    """Lower a compute-only schedule to one with explicit point-to-point communication.

    A RECV goes right before every compute whose input comes from another
    rank, a SEND right after every compute whose output goes to another rank;
    stages that share a rank pass values directly. Keeps the compute actions
    and their order on every rank, so the result deadlocks exactly when the
    input does; every SEND pairs with exactly one RECV.
    """
    comm = [str(a) for program in schedule.actions for a in program if not a.is_compute]  # (or step actions)
    if comm:
        raise ValueError(
            f"add_communication expects a compute-only schedule, but it already has {comm[0]} "
            f"(and {len(comm) - 1} more communication actions); lower the schedule once"
        )
    programs = [tuple(lowered for action in program for lowered in _lower_action(schedule, action))
                for program in schedule.actions]
    return dataclasses.replace(schedule, actions=tuple(programs))
