"""ZeRO at compile time on any mesh: each rank's flat layout, the plan's estimate, the stage-3 graphs.

A rank's ZeRO layout is a function of the trainable parameters it holds — those
of its pipeline stages, at their tensor-parallel local shapes, in the model's
parameter order — so the compiler here and the rank's runtime
(``runtime/zero.py``) compute the same one; ``ParallelModel`` checks that they do.
A parameter held by several pipeline ranks (tied embeddings) gets a flat group
of its own, so its shards cover the same elements on every holder and their
gradients can be summed shard by shard.

Invariant: ranks that differ only in their dp coordinate hold the same
parameters and get the same layout; only the shard each one owns differs.
ZeRO shards over ``mesh.zero_axis``: dp, or under hybrid sharding
(``Mesh(dp=(replicate, shard))``) the ``dp_shard`` sub-axis, whose replicas own
the same shards.
"""
from __future__ import annotations

import dataclasses
import weakref

import torch

from autopar.core.graph import SlotKind
from autopar.core.layout import local_shape
from autopar.core.mesh import Mesh
from autopar.core.plan import Collective, memory
from autopar.core.zero_layout import ZeroLayout, zero_layout
from autopar.options import Options
from autopar.passes.zero_graphs import insert_gathers, memory_estimate, zero_collectives, zero_placements
from autopar.precision import Policy, stored_dtype
from autopar.compiler.program import Program


def held_names(program: Program, rank: int) -> set[str] | None:
    """Names of the parameters and buffers ``rank``'s pipeline stages use (None: no pipeline, it holds all)."""
    if not program.pipelined:
        return None
    return {s.name for st in program.own_stages(rank) for s in st.slots if s.kind in (SlotKind.PARAM, SlotKind.BUFFER)}


def rank_parameters(program: Program, model: torch.nn.Module, rank: int,
                    pol: Policy | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, local shape, dtype as the runtime stores it under ``pol``)`` of the trainable parameters
    ``rank`` holds, in the model's order."""
    mesh = program.plan.mesh
    held = held_names(program, rank)
    tp = mesh.coords(rank).tp
    out = [(n, local_shape(tuple(p.shape), program.placements.get(n), mesh.tp, tp), stored_dtype(p, pol))
           for n, p in model.named_parameters()
           if p.requires_grad and (held is None or n in held)]
    experts, index = program.plan.expert_params, mesh.coord(rank, "ep")
    return [(n, experts[n].local_shape(shape, index) if n in experts else shape, dtype) for n, shape, dtype in out
            if n not in experts or experts[n].stacked or experts[n].holder() == index]  # its ep index's experts


def unused_parameters(program: Program) -> frozenset[str]:
    """Parameters no gradient reaches: the captured graph reads them nowhere, or only through a ``detach``
    (``torch.no_grad()`` blocks are captured as one) or an integer value. ZeRO-3's optimizer step leaves their
    elements of a flat shard untouched (``runtime/zero_untouched.py``), as one device's skips a parameter whose
    ``grad`` is None; tied names included. (Asked at each stage-3 step: one walk over each program's graph,
    remembered with it.)"""
    captured = program.captured
    if captured.gm in _UNUSED:
        return _UNUSED[captured.gm]
    reached = _differentiably_reached(captured.gm.graph)
    nodes = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
    names = {s.name for n, s in zip(nodes, captured.slots) if s.kind is SlotKind.PARAM and n not in reached}
    _UNUSED[captured.gm] = frozenset(names | {tied for tied, used in captured.aliases.items() if used in names})
    return _UNUSED[captured.gm]


_UNUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a captured graph module -> its unused parameters


def _differentiably_reached(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes from which a gradient can flow to the graph's outputs (back from them, not across a ``detach``
    or a value that is not floating point)."""
    out = next(n for n in graph.nodes if n.op == "output")
    reached, todo = set(), [out]
    while todo:
        node = todo.pop()
        if node in reached:
            continue
        reached.add(node)
        val = node.meta.get("val")
        if node.target is torch.ops.aten.detach.default or (
                isinstance(val, torch.Tensor) and not (val.is_floating_point() or val.is_complex())):
            continue
        todo.extend(node.all_input_nodes)
    return reached


def shared_across_pp(program: Program) -> set[str]:
    """Parameters that stages on several pipeline ranks use."""
    return set(program.shared_parameters())


def rank_layout(program: Program, model: torch.nn.Module, options: Options, rank: int) -> ZeroLayout:
    """The ZeRO layout of the parameters ``rank`` holds (what its runtime computes from its tensors)."""
    mesh = program.plan.mesh
    return zero_layout(rank_parameters(program, model, rank, options.policy), stage=options.zero,
                       n=mesh[mesh.zero_axis], bucket_bytes=options.bucket_bytes, alone=shared_across_pp(program),
                       routed=frozenset(program.plan.expert_params), routed_n=mesh[mesh.expert_zero_axis],
                       routed_axis=mesh.expert_zero_axis)


def apply_zero(program: Program, model: torch.nn.Module, mesh: Mesh, options: Options, *, factor: int,
               frozen_bytes: dict[int, int]) -> list[Collective]:
    """Adds every rank's layout and the worst rank's memory estimate to ``program``; under zero=3
    rewrites each rank's graphs to gather its layers (``passes.zero_graphs.insert_gathers``). Returns the
    worst rank's dp collectives. Under mixed precision stage 3 gathers the compute dtype (half the bytes
    of fp32 for bf16) and gradients are reduced in the policy's reduce dtype.

    ``factor``: optimizer-state elements per parameter element; ``frozen_bytes``: bytes of
    parameters without gradients each rank holds.
    """
    plan, pol, axis = program.plan, options.policy, mesh.zero_axis
    n = mesh[axis]
    reps = {r: _representative(mesh, axis, r) for r in range(mesh.size)}
    layouts = {rep: rank_layout(program, model, options, rep) for rep in sorted(set(reps.values()))}
    program.zero_layouts = {r: layouts[reps[r]] for r in range(mesh.size)}
    estimates = {}
    for rep, layout in layouts.items():
        parts = [memory_estimate(param_bytes=trainable, trainable_bytes=trainable, optimizer_factor=factor,
                                 stage=options.zero, n=part.n)
                 for part in layout.by_axis().values() for trainable in [sum(g.nbytes for g in part.groups)]]
        frozen = frozen_bytes.get(rep, 0)
        estimates[rep] = {k: sum(e[k] for e in parts) + (frozen if k == "parameters" else 0)
                          for k in ("parameters", "gradients", "optimizer")}
        if options.zero == 3:
            estimates[rep]["gathered"] = gathered_bytes(layout, options.zero_prefetch, pol)
    worst = max(estimates, key=lambda r: sum(estimates[r].values()))
    plan.memory = memory(estimates[worst], worst if len(layouts) > 1 else None)
    merged = {(g.name, g.params): g for rep in layouts if mesh.coords(rep).tp == 0 for g in layouts[rep].groups}
    for on, part in ZeroLayout(options.zero, n, tuple(merged.values())).by_axis().items():
        plan.params = zero_placements(plan.params, part, on or axis)
    if options.zero == 3:
        _gather_layers(program, mesh, options)
    out = []
    for on, part in layouts[worst].by_axis().items():
        out += zero_collectives(part, microbatches=options.microbatches,
                                gather_dtype=pol.compute if pol and options.zero == 3 else None,
                                reduce_dtype=pol.reduce if pol else None,
                                split=program.schedule is not None and program.schedule.splits_backward,
                                axis=on or axis, replicas=mesh.dp_replicate)
    return out


def _representative(mesh: Mesh, axis: str, rank: int) -> int:
    """The first rank of ``rank``'s ZeRO group with its ep index: such ranks hold the same parameters."""
    index = mesh.coord(rank, "ep")
    return next(r for r in mesh.group_of(rank, axis) if mesh.coord(r, "ep") == index)


def gathered_bytes(layout: ZeroLayout, prefetch: int, pol: Policy | None) -> int:
    """The most bytes of gathered layers alive at once: stored bytes, or the compute dtype's under ``pol``."""
    stored = layout.largest_gathered(prefetch)
    dtypes = {g.dtype for g in layout.groups}
    if pol is None or dtypes != {pol.master}:
        return stored
    return stored * pol.compute.itemsize // pol.master.itemsize


def _gather_layers(program: Program, mesh: Mesh, options: Options) -> None:
    """Each ZeRO group's own stages with all-gathers of its layers, named by its ranks (made on first access)."""
    prefetch, axis = options.zero_prefetch, mesh.zero_axis
    program.graphs.rewrite_per_group(lambda ranks, st: dataclasses.replace(st, gm=insert_gathers(
        st.gm, st.slots, program.zero_layouts[ranks[0]], axis=axis, ranks=mesh.group_of(ranks[0], axis),
        prefetch=prefetch, routed_ranks=mesh.group_of(ranks[0], mesh.expert_zero_axis))))
