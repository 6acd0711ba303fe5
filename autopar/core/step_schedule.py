"""Whole steps as schedules: a pipeline schedule plus the step's other collectives, as actions.

A training step is more than its pipeline: gradients are averaged over the dp
axis, parameters that several pipeline ranks hold get their gradients summed,
ZeRO-3 gathers each stage's parameters and releases them, the optimizer steps,
and the loss reaches every rank. `training_step` lowers a compute-only
schedule (`autopar.core.schedule`) to one rank program that says all of it,
and `forward_step` does the same for a forward pass (``pm(x)``), so one
executor (``autopar.runtime.step_executor.Executor``) runs both and the simulator
checks both before anything runs. A model without a pipeline is a schedule of
one rank and one stage.

The step actions and where the lowering puts them (the executor's meaning in
brackets):

- ``UNSHARD(s)`` before the first action of stage ``s`` [ZeRO-3: start
  gathering the stage's first layer, so it overlaps the wait for its input];
- ``RESHARD(s)`` after the last action of stage ``s`` [ZeRO-3: release what
  of the stage is still gathered];
- then, once per rank, in this order: ``REDUCE_GRAD`` [finish the dp
  reduction of the rank's gradients: launch the buckets backward did not,
  wait for all], ``REDUCE_SHARED`` [sum the gradients of parameters other pp
  ranks hold too, with them], ``OPTIMIZER`` [clip if asked, step, zero the
  gradients], ``BROADCAST_LOSS`` [the mean loss from the last stage's rank to
  every rank, averaged over dp];
- a forward pass ends with ``BROADCAST_OUTPUTS`` [the last stage's outputs to
  every pp rank, gathered over dp].

Whether a backward runs with gradient hooks armed (so buckets launch during
it) follows from the program too: the last ``B`` of a stage before
``REDUCE_GRAD``, or its last ``W`` when the backward is split (`last_backwards`).

Invariant: the lowering keeps every compute and communication action and their
order, so a step deadlocks exactly when its pipeline does; the rank-wide
actions are collectives every participating rank reaches after all of its
pipeline work, in the same order on every rank.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

from autopar.core.schedule import (
    B, W, BROADCAST_LOSS, BROADCAST_OUTPUTS, F, OPTIMIZER, REDUCE_GRAD, REDUCE_SHARED, RESHARD, UNSHARD, Action,
    Schedule, add_communication, looped_placement, one_f_one_b,
)


def local_schedule(n_microbatches: int) -> Schedule:
    """The compute of a model without a pipeline: one rank, one stage, forward and backward per microbatch."""
    return one_f_one_b(1, n_microbatches)


def training_step(schedule: Schedule, *, reduce_grad: bool, unshard: bool,
                  shared_ranks: Iterable[int] = ()) -> Schedule:
    """``schedule`` (compute-only) lowered to a whole training step (see the module docstring).

    ``reduce_grad``: the rank's gradients are averaged over dp (data parallel or
    ZeRO); ``unshard``: stages are ZeRO-3 sharded; ``shared_ranks``: the pp
    ranks holding a parameter another pp rank holds too.
    """
    if not schedule.is_compute_only:
        raise ValueError("training_step expects a compute-only schedule; it adds the communication itself")
    lowered = add_communication(schedule)
    shared = set(shared_ranks)
    programs = []
    for rank, program in enumerate(lowered.actions):
        tail = [REDUCE_GRAD] * reduce_grad + [REDUCE_SHARED] * (rank in shared) + [OPTIMIZER, BROADCAST_LOSS]
        programs.append(_bracket_stages(program, unshard) + [Action(None, kind) for kind in tail])
    return dataclasses.replace(lowered, actions=tuple(programs))


def forward_step(n_ranks: int, n_stages: int, n_microbatches: int, *, unshard: bool,
                 placement: tuple[int, ...] | None = None) -> Schedule:
    """A forward pass: every rank runs its stages microbatch by microbatch, then the outputs go to every rank.

    Stages are placed by ``placement`` (default looped, as the training schedules place them).
    """
    placement = placement or looped_placement(n_ranks, n_stages)
    programs = [[Action(s, F, m) for m in range(n_microbatches) for s in range(n_stages) if placement[s] == rank]
                for rank in range(n_ranks)]
    lowered = add_communication(Schedule(n_ranks, n_stages, n_microbatches, placement, programs))
    programs = [_bracket_stages(p, unshard) + [Action(None, BROADCAST_OUTPUTS)] for p in lowered.actions]
    return dataclasses.replace(lowered, actions=tuple(programs))


def _bracket_stages(program: Iterable[Action], unshard: bool) -> list[Action]:
    """``program`` with ``UNSHARD(s)`` before stage ``s``'s first action and ``RESHARD(s)`` after its last."""
    program = list(program)
    if not unshard:
        return program
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, action in enumerate(program):
        first.setdefault(action.stage, i)
        last[action.stage] = i
    out = []
    for i, action in enumerate(program):
        if first[action.stage] == i:
            out.append(Action(action.stage, UNSHARD))
        out.append(action)
        if last[action.stage] == i:
            out.append(Action(action.stage, RESHARD))
    return out


def last_backwards(program: Iterable[Action]) -> set[Action]:
    """The ``B`` (or ``W``) actions after which a stage computes no more gradient before the program's
    ``REDUCE_GRAD``."""
    last: dict[int, Action] = {}
    for action in program:
        if action.kind == REDUCE_GRAD:
            return set(last.values())
        if action.kind in (B, W):
            last[action.stage] = action
    return set()
