"""ZeRO over the dp axis (or its dp_shard sub-axis): the stage-3 gather pass, the plan's memory estimate and
collectives.

The flat layout these read (``ZeroLayout``) is ``autopar.core.zero_layout``.

``insert_gathers`` is the stage-3 rewrite. Invariant: fed each group's shard
through the placeholder of the group's first parameter (renamed
``zero_shard_<group>``), the rewritten graph computes what ``gm`` computes on
the full parameters. Before a group's first use it inserts
``autopar.zero_all_gather`` (backward: reduce-scatter of the gradient), splits
the flat result into views shaped like the parameters, and sends every use
there. fx's generated code drops each value after its last use, so a gathered
layer is freed after its last forward use; ``zero_begin``/``zero_end`` bracket
the graph so that autograd keeps only a handle to a gathered parameter it saves
for backward and re-gathers it there (the ops are declared in ``core/zero_ops.py``,
run by ``runtime/zero_kernels.py``).
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from autopar.core import zero_ops as _declared  # noqa: F401  (declares the autopar::zero_* ops)
from autopar.core.graph import Slot, SlotKind, copy_module
from autopar.core.plan import Collective, FlatShard, ParamPlan, ZeroShard
from autopar.core.zero_layout import FlatGroup, ZeroLayout
from autopar.passes.mixed_precision import CAST, COMPUTE, retyped


def _ops() -> dict[str, object]:
    ns = torch.ops.autopar
    return {"begin": ns.zero_begin.default, "end": ns.zero_end.default, "gather": ns.zero_all_gather.default,
            "prefetch": ns.zero_prefetch.default, "free": ns.zero_free.default}


def insert_gathers(gm: fx.GraphModule, slots: list[Slot], layout: ZeroLayout, *, axis: str, ranks: list[int],
                   prefetch: int = 1, routed_ranks: list[int] | None = None) -> fx.GraphModule:
    """A copy of ``gm`` that all-gathers each layer's shard before the layer's first use (see the module doc).

    ``prefetch`` layers ahead are gathered asynchronously as soon as a layer's own gather is issued. A group of
    routed experts (its ``axis`` set) gathers over its own axis, the ranks ``routed_ranks``.
    """

    def over(group: FlatGroup) -> tuple[str, list[int]]:
        return (group.axis, list(routed_ranks or ())) if group.axis else (axis, list(ranks))

    ops = _ops()
    gm = copy_module(gm)
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(slots):
        raise ValueError(f"the graph has {len(placeholders)} placeholders but the signature has {len(slots)} slots")
    by_name = {s.name: node for node, s in zip(placeholders, slots) if s.kind is SlotKind.PARAM}
    firsts = _first_uses(graph, layout, by_name)
    if firsts:
        with graph.inserting_before(firsts[0][0]):
            graph.call_function(ops["begin"], (prefetch,))
        with graph.inserting_before(next(n for n in graph.nodes if n.op == "output")):
            graph.call_function(ops["end"], ())
    prefetched: set[str] = set()
    dtypes = {group.name: _gather_dtype(group, by_name) for _, group, _ in firsts}
    for i, (first, group, carrier) in enumerate(firsts):
        with graph.inserting_before(first):
            flat = graph.call_function(ops["gather"], (carrier, *over(group)), _dtype_arg(dtypes[group.name]))
            flat.meta["autopar.zero"] = group.name
            flat.meta["val"] = retyped(carrier.meta["val"], dtypes[group.name] or group.dtype, (group.padded,))
            for _, ahead, ahead_carrier in firsts[i + 1 : i + 1 + prefetch]:
                if ahead.name not in prefetched:
                    prefetched.add(ahead.name)
                    graph.call_function(ops["prefetch"], (ahead_carrier, *over(ahead)),
                                        _dtype_arg(dtypes[ahead.name]))
            pieces = _split_into_parameters(graph, flat, group, by_name, set(ops.values()))
        if dtypes[group.name] is not None:
            _drop_casts(graph, pieces)
        _free_after_last_use(graph, flat, pieces, ops["free"])
    graph.lint()
    gm.recompile()
    return gm


def _gather_dtype(group: FlatGroup, by_name: dict[str, fx.Node]) -> torch.dtype | None:
    """The compute dtype of every parameter of ``group`` here (``passes.mixed_precision``), or None (as stored)."""
    found = {by_name[p].meta.get(COMPUTE) for p in group.params if p in by_name}
    return found.pop() if len(found) == 1 and None not in found else None


def _dtype_arg(dtype: torch.dtype | None) -> dict:
    return {"dtype": dtype} if dtype is not None else {}


def _drop_casts(graph: fx.Graph, pieces: list[fx.Node]) -> None:
    """The mixed-precision casts of a layer's parameters now read views of the buffer gathered in the compute
    dtype: their uses read the views, and the casts go."""
    for piece in pieces:
        for view in list(piece.users):
            for cast in [u for u in view.users if CAST in u.meta]:
                cast.replace_all_uses_with(view)
                graph.erase_node(cast)


def _first_uses(graph: fx.Graph, layout: ZeroLayout,
                by_name: dict[str, fx.Node]) -> list[tuple[fx.Node, FlatGroup, fx.Node]]:
    """``(first use, group, carrier placeholder)`` of every group the graph uses, in graph order.

    The carrier (the group's first parameter placeholder) is renamed ``zero_shard_<group>``: it is
    fed the group's shard.
    """
    order = {node: i for i, node in enumerate(graph.nodes)}
    firsts = []
    for group in layout.groups:
        present = [p for p in group.params if p in by_name]
        users = [u for p in present for u in by_name[p].users]
        if users:
            firsts.append((min(users, key=order.__getitem__), group, by_name[present[0]]))
    firsts.sort(key=lambda item: order[item[0]])
    for _, group, carrier in firsts:
        name = "zero_shard_" + group.name.replace(".", "_").replace(":", "_")
        carrier.target = name
        carrier._rename(name)
    return firsts


def _split_into_parameters(graph: fx.Graph, flat: fx.Node, group: FlatGroup, by_name: dict[str, fx.Node],
                           zero_ops: set) -> list[fx.Node]:
    """Views of the gathered ``flat`` shaped like the group's parameters, replacing their placeholders' uses."""
    parts = graph.call_function(torch.ops.aten.split_with_sizes.default, (flat, group.split_sizes()))
    pieces = []
    flat_val = flat.meta["val"]
    parts.meta["val"] = [retyped(flat_val, flat_val.dtype, (k,)) for k in group.split_sizes()]
    for j, (name, shape) in enumerate(zip(group.params, group.shapes)):
        node = by_name.get(name)
        if node is None or not [u for u in node.users if u.target not in zero_ops]:
            continue
        piece = graph.call_function(operator.getitem, (parts, j))
        piece.meta["val"] = parts.meta["val"][j]
        pieces.append(piece)
        view = graph.call_function(torch.ops.aten.view.default, (piece, list(shape)))
        view.meta["val"] = retyped(flat_val, flat_val.dtype, tuple(shape))
        node.replace_all_uses_with(view, delete_user_cb=lambda u: u.target not in zero_ops)
    return pieces


def _free_after_last_use(graph: fx.Graph, flat: fx.Node, pieces: list[fx.Node], free: object) -> None:
    """Inserts ``free(flat, pieces)`` after the last node that reads the gathered buffer or a view of it."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    seen, stack, last = {flat}, [flat], flat
    while stack:  # the split, its pieces and their views alias the buffer
        node = stack.pop()
        for user in node.users:
            if user.op == "output":
                return  # a gathered parameter is a graph output: it must outlive the graph
            if order[user] > order[last]:
                last = user
            if _may_alias(user) and user not in seen:
                seen.add(user)
                stack.append(user)
    with graph.inserting_after(last):
        graph.call_function(free, (flat, pieces))


def _may_alias(node: fx.Node) -> bool:
    """Whether ``node``'s output may share storage with an input (a view, a piece of a split, ...)."""
    if node.target is operator.getitem or node.target is torch.ops.aten._unsafe_view.default:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is None or any(r.alias_info is not None for r in schema.returns)


def memory_estimate(*, param_bytes: int, trainable_bytes: int, optimizer_factor: int, stage: int, n: int,
                    gathered: int = 0) -> dict[str, int]:
    """Bytes per rank the ZeRO paper predicts: what each stage divides by the dp size ``n``."""
    frozen = param_bytes - trainable_bytes
    opt = optimizer_factor * trainable_bytes
    if stage == 0:
        return {"parameters": param_bytes, "gradients": trainable_bytes, "optimizer": opt}
    out = {
        "parameters": param_bytes if stage < 3 else frozen + trainable_bytes // n,
        "gradients": trainable_bytes if stage == 1 else trainable_bytes // n,
        "optimizer": opt // n,
    }
    if stage == 3:
        out["gathered"] = gathered
    return out


def zero_collectives(layout: ZeroLayout, *, microbatches: int, gather_dtype: torch.dtype | None = None,
                     reduce_dtype: torch.dtype | None = None, split: bool = False, axis: str = "dp",
                     replicas: int = 1) -> list[Collective]:
    """The kinds of collective a ZeRO step runs on one rank, with their counts and bytes.

    ``gather_dtype`` / ``reduce_dtype``: what stage 3 gathers and every stage reduces, when not the
    parameters' dtype (mixed precision); the collectives then show their dtypes. ``split``: backwards
    run as B and W (stage 3 then reduce-scatters a layer's gradient when each finishes). ``axis``: what
    ZeRO shards over; ``replicas`` > 1 (hybrid sharding): each shard's gradient is then all-reduced over
    ``dp_replicate``, once per flat group and step.
    """
    across = [] if replicas == 1 else [Collective(
        "dp_replicate", "all_reduce", len(layout.groups),
        sum(g.shard * (reduce_dtype or g.dtype).itemsize for g in layout.groups),
        f"each flat group's shard gradient among the {replicas} ranks holding that shard, after the last reduction",
        dtypes=(reduce_dtype,) if reduce_dtype is not None else ())]
    if layout.n == 1:
        return across
    k, m = len(layout.groups), microbatches
    stored = tuple(dict.fromkeys(g.dtype for g in layout.groups))
    shown = gather_dtype is not None or reduce_dtype is not None

    def kind(op: str, count: int, dtype: torch.dtype | None, what: str, times: int = 1) -> Collective:
        nbytes = sum(g.padded * (dtype or g.dtype).itemsize for g in layout.groups)
        dtypes = ((dtype,) if dtype else stored) if shown else ()
        return Collective(axis, op, count, times * nbytes, what, dtypes=dtypes)

    gather_after_step = kind("all_gather", k, None, "updated parameter shards after the optimizer step")
    if layout.stage == 1:
        return [kind("reduce_scatter", k, reduce_dtype, "gradient buckets after the last microbatch, in place"),
                *across, gather_after_step]
    if layout.stage == 2:
        return [kind("reduce_scatter", k * m, reduce_dtype,
                     "gradient buckets during every microbatch's backward; full gradients freed", m),
                *across, gather_after_step]
    return [kind("all_gather", 2 * k * m, gather_dtype, "each layer before its forward and again for its backward",
                 2 * m),
            kind("reduce_scatter", k * m * (1 + split), reduce_dtype,
                 "each layer's gradients when B and again when W finishes" if split else "each layer's gradients in backward",
                 m * (1 + split)), *across]


def zero_placements(params: list[ParamPlan], layout: ZeroLayout, axis: str = "dp") -> list[ParamPlan]:
    """The plan's parameters, each told which flat group shards it over ``axis`` (dp, or dp_shard under hybrid
    sharding; zero=3: stored flat-sharded)."""
    group_of = {name: g.name for g in layout.groups for name in g.params}
    out = []
    for p in params:
        if p.name in group_of:
            if layout.stage == 3 and "dp" in p.axes:
                p = p.with_placement("dp", FlatShard())
            p = dataclasses.replace(p, zero=ZeroShard(layout.stage, group_of[p.name], axis))
        out.append(p)
    return out
