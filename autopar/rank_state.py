"""Moving a model's state between its full form and the form one rank stores.

A rank stores each parameter as its tp shard (re-ordered where a fused layout
says so), only for its pipeline stages, and under ZeRO as flat dp shards.
``full_state`` undoes all three with collectives (every rank calls it);
``local_state`` cuts a full state the way this rank stores it (no
communication); ``checkpoint_scope`` says which of its tensors a rank writes to
a checkpoint and which keys need its coordinates.

Invariant: ``local_state(full_state())`` on every rank gives back what each rank stores.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from autopar.capture import tied_aliases
from autopar.mesh import Mesh
from autopar.zero_compile import held_names, local_shape
from passes.fused_projections import from_storage, to_storage
from runtime import checkpoint


def full_state(model: torch.nn.Module, mesh: Mesh, program: Any, rt: Any) -> dict[str, torch.Tensor]:
    """Every parameter and buffer at full size, by canonical name, from the ranks' shards (collective)."""
    current = {n: t.data for n, t in [*model.named_parameters(), *model.named_buffers()]}
    if rt.zero is not None:
        current.update(rt.zero.full_parameters())
    full_shapes = {name: shape for name, shape, _ in program.plan.params}
    tp = mesh.coords(rt.groups.rank)["tp"]
    for name, t in current.items():  # other stages' parameters are not kept: buffers to receive them into
        if t.numel() == 0 and name in full_shapes:
            shape = local_shape(full_shapes[name], program.placements.get(name), mesh.tp, tp)
            current[name] = torch.empty(shape, dtype=t.dtype, device=t.device)
    if program.stages is not None:
        _broadcast_from_owners(mesh, program, rt, current)
    return _gather_tp(mesh, program, rt, current)


def _broadcast_from_owners(mesh: Mesh, program: Any, rt: Any, current: dict[str, torch.Tensor]) -> None:
    """Each tensor's owner (the pp rank of the first stage using it) broadcasts it to the other pp ranks."""
    owner: dict[str, int] = {}
    for st in program.stages:
        for slot in st.slots:
            owner.setdefault(slot.name, program.schedule.stage_to_rank[st.index])
    coords = mesh.coords(rt.groups.rank)
    with torch.no_grad():
        for name, t in current.items():
            src = mesh.rank_of(**{**coords, "pp": owner.get(name, 0)})
            dist.broadcast(t, src=src, group=rt.groups["pp"])


def _gather_tp(mesh: Mesh, program: Any, rt: Any, current: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors from this rank's (``current``) and the other tp ranks' shards."""
    out = dict(current)
    for name in current:
        placement = program.placements.get(name)
        if isinstance(placement, Shard):
            pieces = [torch.empty_like(current[name]) for _ in range(mesh.tp)]
            dist.all_gather(pieces, current[name].contiguous(), group=rt.groups["tp"])
            out[name] = torch.cat(pieces, placement.dim)
        if name in program.layouts:
            out[name] = from_storage(out[name], program.layouts[name])
    return out


def local_state(model: torch.nn.Module, mesh: Mesh, program: Any, rank: int,
                state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state (the model's keys) cut the way ``rank`` stores it: tp shards, re-ordered where a layout says."""
    aliases = tied_aliases(model)
    n, i = mesh.tp, mesh.coords(rank)["tp"]
    out = {}
    for key, value in state.items():
        name = aliases.get(key, key)
        if name in program.layouts:
            value = to_storage(value, program.layouts[name])
        placement = program.placements.get(name)
        out[key] = value.chunk(n, placement.dim)[i] if isinstance(placement, Shard) else value
    return out


def checkpoint_scope(model: torch.nn.Module, mesh: Mesh, program: Any, rank: int) -> checkpoint.Scope:
    """What ``rank`` saves: its stages' tensors; keys of tp shards and per-rank layouts carry its coordinates."""
    if mesh.pp == 1 and mesh.tp == 1:
        return checkpoint.Scope()
    c = mesh.coords(rank)
    held = held_names(program, rank)
    if held is not None and c["pp"] == 0:  # tensors no stage uses are saved by the first pp rank
        used = {s.name for st in program.stages for s in st.slots}
        held |= {n for n, _ in [*model.named_parameters(), *model.named_buffers()]} - used
    tp_local = {n for n, p in program.placements.items() if isinstance(p, Shard)} | set(program.layouts)
    return checkpoint.Scope(where=f"@pp{c['pp']}.tp{c['tp']}", held=frozenset(held) if held is not None else None,
                            tp_local=frozenset(tp_local))
