"""One training step and one forward of a compiled program on this rank's ``RankRuntime``.

``train_step``: forward and backward per microbatch (or the pipeline schedule),
gradient sync over dp and across stages sharing a parameter, optional clipping,
the optimizer step; returns the global mean loss. ``forward``: the outputs of
the global batch, whole on every rank.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from autopar.core.mesh import Mesh
from autopar.program import Program
from autopar.rank_runtime import pp_rank_fn
from autopar.runtime.clip import clip, global_grad_norm
from autopar.runtime.pipeline import output_metas
from autopar.runtime.rank import RankRuntime


def train_step(model: torch.nn.Module, mesh: Mesh, program: Program, rt: RankRuntime, parts: list[Any],
               max_grad_norm: float | None) -> tuple[float, float | None]:
    """Trains on this rank's microbatches ``parts``; ``(global mean loss, gradient norm before clipping or None)``."""
    if rt.pipeline is not None:
        loss = _pipeline_step(mesh, program, parts, rt)
    else:
        loss = _local_step(program, parts, rt)
    if rt.grad_sync is not None:
        rt.grad_sync.finish()
    for param, group in rt.shared:  # copies of one parameter on several stages get the summed gradient
        if param.grad is None:  # (every holder takes part, with zeros if its stages made no gradient)
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, group=group)
    norm = None
    if max_grad_norm is not None:
        norm = global_grad_norm(rt, model, program.placements, rt.holders)
        clip(rt, norm, max_grad_norm)
    rt.optimizer.step()
    rt.optimizer.zero_grad(set_to_none=True)
    loss /= mesh.dp
    if rt.groups["dp"] is not None:
        dist.all_reduce(loss, group=rt.groups["dp"])
    return float(loss), norm


def _local_step(program: Program, parts: list[Any], rt: RankRuntime) -> torch.Tensor:
    gm = program.graphs[rt.groups.rank]
    total = torch.zeros((), dtype=torch.float64, device=rt.groups.device)
    for i, part in enumerate(parts):
        if rt.grad_sync is not None:
            rt.grad_sync.enabled = i == len(parts) - 1
        loss = program.captured.run(rt.state, pytree.tree_leaves(part), gm)
        (loss / len(parts)).backward()
        total += loss.detach().double()
    return total / len(parts)


def _pipeline_step(mesh: Mesh, program: Program, parts: list[Any], rt: RankRuntime) -> torch.Tensor:
    last = len(program.stages) - 1

    def before_backward(mb: int) -> None:
        if rt.grad_sync is not None:
            rt.grad_sync.enabled = mb == len(parts) - 1 and not rt.shared_on_rank

    rt.shared_on_rank = _shared_within_rank(program, rt.groups.rank)
    flat = [pytree.tree_leaves(p) for p in parts]
    loss = rt.pipeline.step(program.stages_for(rt.groups.rank), flat, rt.state, program.captured.constants, before_backward)
    if loss is None:
        loss = torch.zeros((), dtype=torch.float64, device=rt.groups.device)
    src = pp_rank_fn(mesh, rt.groups)(program.schedule.stage_to_rank[last])
    dist.broadcast(loss, src=src, group=rt.groups["pp"])
    return loss


def forward(mesh: Mesh, program: Program, rt: RankRuntime, parts: list[Any]) -> Any:
    """Forward only (no autograd graph is kept) on this rank's microbatches; the full output on every rank."""
    with torch.no_grad():
        if rt.pipeline is not None:
            outs = _pipeline_forward(mesh, program, parts, rt)
        else:
            gm = program.graphs[rt.groups.rank]
            outs = [program.captured.run(rt.state, pytree.tree_leaves((a, k)), gm) for a, k, _ in parts]
        return gather_batch(outs, rt.groups["dp"], mesh.dp)


def _pipeline_forward(mesh: Mesh, program: Program, parts: list[Any], rt: RankRuntime) -> list[Any]:
    """Pipelined forward; the last stage broadcasts its outputs to the other pp ranks."""
    last = program.stages[-1]
    flats = rt.pipeline.forward(program.stages_for(rt.groups.rank), [pytree.tree_leaves((a, k)) for a, k, _ in parts],
                                rt.state, program.captured.constants)
    if flats is None:
        flats = [[torch.empty(b.shape, dtype=b.dtype, device=rt.groups.device) for b in output_metas(last)]
                 for _ in parts]
    src = pp_rank_fn(mesh, rt.groups)(program.schedule.stage_to_rank[last.index])
    for flat in flats:
        for t in flat:
            dist.broadcast(t, src=src, group=rt.groups["pp"])
    return [pytree.tree_unflatten(flat, program.captured.out_spec) for flat in flats]


def _shared_within_rank(program: Program, rank: int) -> bool:
    """Whether two stages of this rank use one parameter (its gradient completes only after both)."""
    seen: set[str] = set()
    for st in program.own_stages(rank):
        if seen & set(st.params):
            return True
        seen |= set(st.params)
    return False


def gather_batch(outs: list[Any], group: dist.ProcessGroup | None, dp: int) -> Any:
    """Microbatch outputs concatenated, then dp slices all-gathered, along dim 0; scalars averaged."""
    flats = [pytree.tree_flatten(o) for o in outs]
    spec = flats[0][1]
    merged = []
    for leaves in zip(*(f for f, _ in flats)):
        first = leaves[0]
        if not isinstance(first, torch.Tensor):
            merged.append(first)
            continue
        local = torch.cat(leaves) if first.dim() > 0 else torch.stack(leaves).mean(0)
        if group is not None:
            if local.dim() > 0:
                pieces = [torch.empty_like(local) for _ in range(dp)]
                dist.all_gather(pieces, local.contiguous(), group=group)
                local = torch.cat(pieces)
            else:
                local = local.clone()
                dist.all_reduce(local, group=group)
                local /= dp
        merged.append(local)
    return pytree.tree_unflatten(merged, spec)
