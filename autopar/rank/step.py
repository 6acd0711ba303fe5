"""One training step and one forward of a compiled program on this rank's ``RankRuntime``.

Both run the program's step schedule (``Program.step``, see
``autopar.core.step_schedule``) through the rank's ``Executor``; this module
says what the step actions mean on a rank: ``StepHandlers`` built from the
rank's gradient sync, shared parameters, ZeRO shards, optimizer and groups.
``train_step`` returns the global mean loss; ``forward`` the outputs of the
global batch, whole on every rank.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from autopar.core.collectives import bind
from autopar.core.errors import UnsupportedError
from autopar.core.mesh import Mesh
from autopar.compiler.program import Program
from autopar.rank.build import pp_rank_fn
from autopar.runtime.batch import cp_unshard
from autopar.runtime.clip import clip, global_grad_norm
from autopar.runtime.step_executor import StepHandlers, output_metas
from autopar.runtime.rank import RankRuntime
from autopar.compiler.zero_program import unused_parameters


def train_step(model: torch.nn.Module, mesh: Mesh, program: Program, rt: RankRuntime, flats: list[list[Any]],
               max_grad_norm: float | None) -> tuple[float, float | None]:
    """Trains on this rank's microbatches (``flats``: each one's flat graph inputs); ``(global mean loss,
    gradient norm before clipping or None)``."""
    norm: list[float] = []
    shared_on_rank = _shared_within_rank(program, rt.groups.rank)

    def arm(last: bool) -> None:  # a parameter two stages of this rank use is complete only after both
        if rt.grad_sync is not None:
            rt.grad_sync.arm(last and not shared_on_rank)

    def optimizer() -> None:
        if max_grad_norm is not None:
            norm.append(global_grad_norm(rt, model, program.placements, rt.holders,
                                         frozenset(program.plan.expert_params)))
            clip(rt, norm[0], max_grad_norm)
        if rt.zero is not None and rt.zero.stage == 3:
            rt.zero.unused = unused_parameters(program)  # (this program's: another input may read others)
        rt.optimizer.step()
        rt.optimizer.zero_grad(set_to_none=True)

    handlers = StepHandlers(arm=arm, reduce_grad=rt.grad_sync.finish if rt.grad_sync is not None else lambda: None,
                            reduce_shared=lambda: _reduce_shared(rt), optimizer=optimizer,
                            broadcast_loss=lambda loss: _broadcast_loss(mesh, program, rt, loss),
                            **_zero_handlers(program, rt))
    loss = _run(program, rt, flats, handlers)
    return float(loss), (norm[0] if norm else None)


def forward(mesh: Mesh, program: Program, rt: RankRuntime, flats: list[list[Any]], *, gather: bool = True) -> Any:
    """Forward only (no autograd graph is kept) on this rank's microbatches (each one's flat graph inputs);
    the full output on every rank (``gather``), or this dp rank's (scalars still averaged over dp)."""
    handlers = StepHandlers(broadcast_outputs=lambda outs: _broadcast_outputs(mesh, program, rt, outs, len(flats),
                                                                             gather),
                            **_zero_handlers(program, rt))
    with torch.no_grad():
        return _run(program, rt, flats, handlers)


def _run(program: Program, rt: RankRuntime, flat: list[list[Any]], handlers: StepHandlers) -> Any:
    pp = rt.groups.coords.pp
    rt.binding.waits.clear()  # the ops' waits of this run only (``pm.timeline(layers=True)``)
    with bind(rt.binding):  # the graphs' autopar::* ops run on this rank's groups
        return rt.executor.run(program.step.actions[pp], program.run_stages(rt.groups.rank), flat, rt.state,
                               program.captured.constants, handlers)


def _zero_handlers(program: Program, rt: RankRuntime) -> dict[str, Any]:
    """ZeRO-3: ``UNSHARD(s)`` starts gathering stage ``s``'s first layer, ``RESHARD(s)`` drops what is pending."""
    if rt.zero is None or rt.zero.stage < 3:
        return {}
    stages = program.run_stages(rt.groups.rank)
    return {"unshard": lambda s: rt.zero.prefetch_first(stages[s].gm, stages[s].slots),
            "reshard": lambda s: rt.zero.drop_pending(stages[s].params)}


def _reduce_shared(rt: RankRuntime) -> None:
    """Copies of one parameter on several pp ranks get the summed gradient (zeros from a holder that made none)."""
    for param, group in rt.shared:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, group=group)


def _broadcast_loss(mesh: Mesh, program: Program, rt: RankRuntime, loss: torch.Tensor | None) -> torch.Tensor:
    """The mean loss over this dp rank's microbatches from the last stage's rank to its pp group, then over dp."""
    if loss is None:
        loss = torch.zeros((), dtype=torch.float64, device=rt.groups.device)
    if program.schedule is not None:
        last = program.schedule.n_stages - 1
        src = pp_rank_fn(mesh, rt.groups)(program.schedule.stage_to_rank[last])
        dist.broadcast(loss, src=src, group=rt.groups["pp"])
    loss /= mesh.dp * mesh.cp  # (cp: each cp rank's loss is its tokens' part of its sequences')
    group = rt.groups["dp_cp"] if mesh.cp > 1 else rt.groups["dp"]
    if group is not None:
        dist.all_reduce(loss, group=group)
    return loss


def _broadcast_outputs(mesh: Mesh, program: Program, rt: RankRuntime, flats: list[list[torch.Tensor]] | None,
                       m: int, gather: bool) -> Any:
    """The last stage's outputs from its rank to the pp group, unflattened, then gathered over dp."""
    if program.schedule is not None:
        last = program.pipeline_stages[-1]
        if flats is None:
            flats = [[torch.empty(b.shape, dtype=b.dtype, device=rt.groups.device) for b in output_metas(last)]
                     for _ in range(m)]
        src = pp_rank_fn(mesh, rt.groups)(program.schedule.stage_to_rank[last.index])
        for flat in flats:
            for t in flat:
                dist.broadcast(t, src=src, group=rt.groups["pp"])
    if mesh.cp > 1:
        flats = [[gather_sequence(t, rt.groups["cp"], mesh.cp, program.cp_local) for t in flat] for flat in flats]
    outs = [pytree.tree_unflatten(flat, program.captured.out_spec) for flat in flats]
    return gather_batch(outs, rt.groups["dp"], mesh.dp, gather=gather)


def gather_sequence(t: Any, group: dist.ProcessGroup, cp: int, local: int) -> Any:
    """An output of one cp rank made whole: its sequence (dim 1 of ``local`` tokens) gathered from the cp
    ranks' chunks; a scalar averaged over them (each rank's is its tokens' part)."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.dim() == 0:
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t / cp
    if t.dim() < 2 or t.shape[1] != local:
        raise UnsupportedError(f"context parallelism: an output of shape {tuple(t.shape)} has no sequence dim of "
                               f"the {local} tokens each cp rank holds (dim 1); return (batch, sequence, ...) "
                               f"outputs or run the forward without cp")
    pieces = [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in range(cp)]
    dist.all_gather(pieces, t.contiguous(), group=group)
    return cp_unshard(pieces)


def _shared_within_rank(program: Program, rank: int) -> bool:
    """Whether two stages of this rank use one parameter (its gradient completes only after both)."""
    seen: set[str] = set()
    for st in program.own_stages(rank):
        if seen & set(st.params):
            return True
        seen |= set(st.params)
    return False


def gather_batch(outs: list[Any], group: dist.ProcessGroup | None, dp: int, *, gather: bool = True) -> Any:
    """Microbatch outputs concatenated, then (``gather``) dp slices all-gathered, along dim 0; scalars averaged
    over microbatches and dp."""
    flats = [pytree.tree_flatten(o) for o in outs]
    spec = flats[0][1]
    merged = []
    for leaves in zip(*(f for f, _ in flats)):
        first = leaves[0]
        if not isinstance(first, torch.Tensor):
            merged.append(first)
            continue
        local = torch.cat(leaves) if first.dim() > 0 else torch.stack(leaves).mean(0)
        if group is not None and local.dim() > 0 and gather:
            pieces = [torch.empty_like(local) for _ in range(dp)]
            dist.all_gather(pieces, local.contiguous(), group=group)
            local = torch.cat(pieces)
        elif group is not None and local.dim() == 0:
            local = local.clone()
            dist.all_reduce(local, group=group)
            local /= dp
        merged.append(local)
    return pytree.tree_unflatten(merged, spec)
