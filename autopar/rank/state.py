"""Moving a model's state between its full form and the form one rank stores.

A rank stores each parameter as its tp shard (re-ordered where a fused layout
says so), only for its pipeline stages, and under ZeRO as flat dp shards.
``full_state`` undoes all three with collectives (every rank calls it);
``local_state`` cuts a full state the way this rank stores it (no
communication); ``checkpoint_state`` says where each tensor a rank stores lies in
the logical tensor (the boxes it reads from and writes to a checkpoint) and which
copies it writes.

Under ``precision="mixed"`` the optimizer's float32 masters (``runtime/master.py``)
stand for the bfloat16 parameters they are rounded into: the full state and the
checkpoint entries hold the masters.

Invariant: ``local_state(full_state())`` on every rank gives back what each rank stores.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from autopar.core.expert_layout import ExpertParam
from autopar.core.graph import tied_aliases
from autopar.core.layout import from_storage, local_shape, to_storage
from autopar.core.mesh import Coords, Mesh
from autopar.runtime import checkpoint
from autopar.runtime.reshard import Geometry
from autopar.compiler.zero_program import held_names

if TYPE_CHECKING:
    from autopar.compiler.program import Program
    from autopar.runtime.rank import RankRuntime


def full_state(model: torch.nn.Module, mesh: Mesh, program: Program, rt: RankRuntime) -> dict[str, torch.Tensor]:
    """Every parameter and buffer at full size, by canonical name, from the ranks' shards (collective)."""
    current = {n: rt.master_of(t).data for n, t in [*model.named_parameters(), *model.named_buffers()]}
    if rt.zero is not None:
        current.update(rt.zero.full_parameters(masters=True))
    full_shapes = {p.name: p.shape for p in program.plan.params}
    tp = rt.groups.coords.tp
    for name, t in current.items():  # other stages' parameters are not kept: buffers to receive them into
        if t.numel() == 0 and name in full_shapes:
            shape = local_shape(full_shapes[name], program.placements.get(name), mesh.tp, tp)
            if name in program.plan.expert_params and program.plan.expert_params[name].stacked:  # its ep rows
                shape = program.plan.expert_params[name].local_shape(shape, rt.groups.coord("ep"))
            dtype = torch.float32 if rt.masters is not None and name in program.trainable else t.dtype
            current[name] = torch.empty(shape, dtype=dtype, device=t.device)
    if program.pipelined:
        _broadcast_from_owners(mesh, program, rt, current)
    if program.plan.expert_params:
        _gather_experts(mesh, program, rt, current)
    return _gather_tp(mesh, program, rt, current)


def _gather_experts(mesh: Mesh, program: Program, rt: RankRuntime, current: dict[str, torch.Tensor]) -> None:
    """Stacked expert weights gathered over ep; one expert's tensors broadcast from the ep rank holding it."""
    group = rt.groups["ep"]
    with torch.no_grad():
        for name, placed in program.plan.expert_params.items():
            t = current[name]
            if placed.stacked:
                pieces = [torch.empty_like(t) for _ in range(mesh.ep)]
                dist.all_gather(pieces, t.contiguous(), group=group)
                current[name] = torch.cat(pieces)
            else:  # (a full-size buffer on the ranks that hold it not, made above)
                dist.broadcast(t, src=mesh.group_of(rt.groups.rank, "ep")[placed.holder()], group=group)


def _broadcast_from_owners(mesh: Mesh, program: Program, rt: RankRuntime, current: dict[str, torch.Tensor]) -> None:
    """Each tensor's owner (the pp rank of the first stage using it) broadcasts it to the other pp ranks."""
    owner: dict[str, int] = {}
    for st in program.pipeline_stages:
        for slot in st.slots:
            owner.setdefault(slot.name, program.schedule.stage_to_rank[st.index])
    coords = rt.groups.coords
    with torch.no_grad():
        for name, t in current.items():
            src = mesh.rank_at(coords.replace(pp=owner.get(name, 0)))
            dist.broadcast(t, src=src, group=rt.groups["pp"])


def _gather_tp(mesh: Mesh, program: Program, rt: RankRuntime, current: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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


def local_state(model: torch.nn.Module, mesh: Mesh, program: Program, rank: int,
                state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state (the model's keys) cut the way ``rank`` stores it: tp shards, re-ordered where a layout says."""
    aliases = tied_aliases(model)
    n, i = mesh.tp, mesh.coords(rank).tp
    out = {}
    for key, value in state.items():
        name = aliases.get(key, key)
        if name in program.layouts:
            value = to_storage(value, program.layouts[name])
        placement = program.placements.get(name)
        out[key] = value.chunk(n, placement.dim)[i] if isinstance(placement, Shard) else value
        if name in program.plan.expert_params:
            out[key] = program.plan.expert_params[name].local(out[key], mesh.coord(rank, "ep"))
    return out


def checkpoint_state(model: torch.nn.Module, mesh: Mesh, program: Program, rt: RankRuntime,
                     full_shapes: dict[str, tuple[int, ...]]) -> checkpoint.RankState:
    """What ``rt``'s rank stores of every parameter and buffer, where it lies in the logical tensor, and which
    copies it writes to a checkpoint; ``full_shapes``: every parameter's logical shape."""
    aliases = tied_aliases(model)
    params = dict(model.named_parameters())
    held = held_names(program, rt.groups.rank)
    used = {s.name for st in program.pipeline_stages for s in st.slots} if program.pipelined else None
    writer = _pp_writers(program)
    coords = rt.groups.coords
    zero_of = {n: (fs, k) for fs in rt.zero.shards for k, n in enumerate(fs.spec.params)} if rt.zero else {}
    entries, expected, trainable = [], {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if name in aliases or (name in params and used is not None and name not in used):
            continue  # a tied alias is saved once; a parameter no stage uses is not kept by any rank
        shape = full_shapes[name] if name in params else tuple(t.shape)
        mastered = rt.masters is not None and name in params and t.requires_grad and t.is_floating_point()
        expected[name] = (shape, torch.float32 if mastered else t.dtype)
        if name in params and t.requires_grad:
            trainable.add(name)
        if name in params and held is not None and name not in held:
            continue  # another pipeline rank stores it
        writes = writer.get(name, 0) == coords.pp
        if name in program.plan.expert_params:  # (whole on every tp rank: tp index 0 writes it)
            entries += _expert_entry(name, shape, rt.master_of(t), program.plan.expert_params[name], mesh,
                                     rt.groups.rank, writes and coords.tp == 0, zero_of.get(name), rt.master_of)
            continue
        if name not in params:  # a buffer: whole on every rank that has it
            entries.append(checkpoint.Entry(name, Geometry(shape, shape), t.detach(),
                                            writes=writes and coords.tp == 0))
        else:
            entries.append(_param_entry(name, shape, rt.master_of(t), program, mesh, coords, zero_of.get(name),
                                        writes, rt.master_of))
    return checkpoint.RankState(tuple(entries), expected, frozenset(trainable),
                                f"zero={rt.zero.stage if rt.zero else 0} on {mesh!r}")


def _param_entry(name: str, shape: tuple[int, ...], p: torch.Tensor, program: Program, mesh: Mesh,
                 coords: Coords, zero: tuple[Any, int] | None, writes: bool,
                 of: Callable[[torch.Tensor], torch.Tensor]) -> checkpoint.Entry:
    """A parameter's entry: its tp chunk (in storage order), and under ZeRO the part of it in this rank's shard
    (``of``: the tensor saved for a stored one, its master under mixed precision)."""
    placement = program.placements.get(name)
    local = local_shape(shape, placement, mesh.tp, coords.tp)
    dim = placement.dim if isinstance(placement, Shard) and mesh.tp > 1 else None
    start = coords.tp * -(-shape[dim] // mesh.tp) if dim is not None else 0  # as torch.chunk cuts
    lay = program.layouts.get(name)
    geometry = Geometry(shape, local, dim, start, (lay.dim, lay.sizes, lay.n) if lay is not None else None)
    writes = writes and (dim is not None or coords.tp == 0)  # a tp-replicated parameter: tp rank 0 writes it
    if zero is None:
        if tuple(p.shape) != local:
            raise RuntimeError(f"internal error: {name!r} is stored as {tuple(p.shape)}, expected {local}")
        return checkpoint.Entry(name, geometry, p, writes=writes, trainable=p.requires_grad)
    return _zero_entry(name, geometry, local, zero, writes, of)


def _zero_entry(name: str, geometry: Geometry, local: tuple[int, ...], zero: tuple[Any, int], writes: bool,
                of: Callable[[torch.Tensor], torch.Tensor]) -> checkpoint.Entry:
    """The part of a parameter (``local``: its shape on this rank) in this rank's ZeRO shard."""
    fs, k = zero
    lo, hi = fs.index * fs.spec.shard, (fs.index + 1) * fs.spec.shard
    offset = fs.spec.offsets[k]
    a = max(offset, lo)
    b = max(a, min(offset + fs.spec.numels[k], hi))  # [a, b): its elements in the shard (empty: none)
    if tuple(fs.spec.shapes[k]) != local:
        raise RuntimeError(f"internal error: {name!r} is laid out as {fs.spec.shapes[k]}, expected {local}")
    return checkpoint.Entry(name, dataclasses.replace(geometry, flat=(a - offset, b - offset)), of(fs.shard),
                            window=(a - lo, b - lo), writes=writes, trainable=True)


def _expert_entry(name: str, shape: tuple[int, ...], p: torch.Tensor, placed: ExpertParam, mesh: Mesh,
                  rank: int, writes: bool, zero: tuple[Any, int] | None,
                  of: Callable[[torch.Tensor], torch.Tensor]) -> list[checkpoint.Entry]:
    """An expert parameter's entry on ``rank``: its rows of stacked weights, or one expert's whole tensor on
    the ep index holding it (none elsewhere); the first ``ep_replicate`` group writes it where ``writes`` (its
    pp stage's writer, tp index 0). Under ZeRO (``zero``: its flat group and index there) each rank of the
    ``ep_replicate`` group writes the part in its shard."""
    index = mesh.coord(rank, "ep")
    local = placed.local_shape(shape, index)
    if not placed.stacked and placed.holder() != index:
        return []
    dim, start = (0, index * local[0]) if placed.stacked else (None, 0)
    if zero is not None:
        return [_zero_entry(name, Geometry(shape, local, dim, start), local, zero, writes, of)]
    return [checkpoint.Entry(name, Geometry(shape, local, dim, start), p,
                             writes=writes and mesh.coord(rank, "ep_replicate") == 0, trainable=p.requires_grad)]


def _pp_writers(program: Program) -> dict[str, int]:
    """The pp rank that writes each tensor: the rank of the first stage using it (others: pp rank 0)."""
    out: dict[str, int] = {}
    for st in program.pipeline_stages:
        for slot in st.slots:
            out.setdefault(slot.name, program.schedule.stage_to_rank[st.index])
    return out
