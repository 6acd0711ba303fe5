"""Fused projections (one matmul producing q|k|v or gate|up, then cut into blocks) made shardable.

A column-parallel shard of a fused weight would give rank 0 all of q and half
of k. This pass re-parameterizes such a weight for a tp axis of ``n``: it is
stored with its output columns ordered (rank, block, column) instead of
(block, rank, column), and each block's consumer is rewritten to read the
output as a view ``(..., n, total/n)``, a slice of the block's columns
``(..., n, size/n)`` and a reshape back to ``(..., size)``. The rewritten
graph computes exactly what the original computes when given the re-ordered
parameter (it only moves data), and a plain ``Shard`` of the stored parameter
hands each rank the q, k and v (or gate and up) columns of its own heads, so
the solver finds the Megatron plan for it.

The blocks may differ in size (grouped-query attention: q is wider than k and
v) and may be cut by ``split``, ``split_with_sizes``, ``chunk`` or by slices
that tile the last dim (``qkv[..., :q_end]``, ``qkv[..., q_end:k_end]``, ...).
Every block's width must divide by ``n``.

``to_storage`` / ``from_storage`` convert between the model's layout and the
stored one; the runtime applies them when it shards and when it gathers.
"""
from __future__ import annotations

import operator
import sys

import torch
import torch.fx as fx

from autopar.core.graph import Captured, SlotKind
from autopar.core.layout import Interleave

aten = torch.ops.aten
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
CUTS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)


def _meta(shape: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=like.dtype, device="meta")


def interleave_fused_projections(cap: Captured, n: int) -> dict[str, Interleave]:
    """Rewrites every fused projection's block consumers in ``cap.gm`` in place; the parameters to store interleaved."""
    slot_of = dict(zip([nd for nd in cap.gm.graph.nodes if nd.op == "placeholder"], cap.slots))
    layouts: dict[str, Interleave] = {}
    for y in list(cap.gm.graph.nodes):
        found = _cut(y, n)
        if found is None:
            continue
        params = _projection_params(y, slot_of)
        if params is None:
            continue
        sizes, consumers = found
        _rewrite(cap.gm.graph, y, n, sizes, consumers)
        for name, dim in params:
            layouts[name] = Interleave(dim, sizes, n)
    cap.gm.recompile()
    return layouts


def _rewrite(graph: fx.Graph, y: fx.Node, n: int, sizes: tuple[int, ...],
             consumers: list[tuple[fx.Node, int]]) -> None:
    """Each consumer of block ``b`` of ``y`` reads it through view -> slice -> reshape; cut nodes are erased."""
    val = y.meta["val"]
    lead, total = list(val.shape[:-1]), val.shape[-1]
    starts = [sum(sizes[:b]) for b in range(len(sizes))]
    with graph.inserting_after(y):
        y_ranks = graph.call_function(aten.view.default, (y, lead + [n, total // n]))  # (..., n, total/n)
    y_ranks.meta = {**y.meta, "val": _meta(lead + [n, total // n], val)}
    cuts = {c.args[0] for c, _ in consumers if c.target is operator.getitem}
    for consumer, b in consumers:
        with graph.inserting_before(consumer):
            lo, hi = starts[b] // n, (starts[b] + sizes[b]) // n
            part = graph.call_function(aten.slice.Tensor, (y_ranks, len(lead) + 1, lo, hi))  # (..., n, size/n)
            part.meta = {**consumer.meta, "val": _meta(lead + [n, hi - lo], val)}
            merged = graph.call_function(aten.reshape.default, (part, lead + [sizes[b]]))  # (..., size)
            merged.meta = {**consumer.meta, "val": _meta(lead + [sizes[b]], val)}
        consumer.replace_all_uses_with(merged)
        graph.erase_node(consumer)
    for cut in cuts:
        graph.erase_node(cut)


def _cut(y: fx.Node, n: int) -> tuple[tuple[int, ...], list[tuple[fx.Node, int]]] | None:
    """(block widths, [(consumer, block)]) when every use of ``y`` cuts its last dim into blocks of width % n == 0."""
    val = y.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() == 0 or not y.users:
        return None
    total, last = val.shape[-1], val.dim() - 1
    if not isinstance(total, int):
        return None
    users = list(y.users)
    if len(users) == 1 and users[0].target in CUTS:
        found = _cut_by_op(users[0], total, last)
    elif all(u.target == aten.slice.Tensor for u in users):
        found = _cut_by_slices(users, total, last)
    else:
        return None
    if found is None or len(found[0]) < 2 or any(s % n for s in found[0]):
        return None
    return found


def _cut_by_op(cut: fx.Node, total: int, last: int) -> tuple[tuple[int, ...], list[tuple[fx.Node, int]]] | None:
    dim = cut.args[2] if len(cut.args) > 2 else cut.kwargs.get("dim", 0)
    if dim % (last + 1) != last or not all(u.target is operator.getitem for u in cut.users):
        return None
    arg = cut.args[1]
    if cut.target == aten.chunk.default:
        if not isinstance(arg, int) or total % arg:
            return None
        sizes = (total // arg,) * arg
    elif cut.target == aten.split.Tensor and isinstance(arg, int):
        if total % arg:
            return None
        sizes = (arg,) * (total // arg)
    elif isinstance(arg, (list, tuple)) and all(isinstance(s, int) for s in arg) and sum(arg) == total:
        sizes = tuple(arg)
    else:
        return None
    return sizes, [(u, u.args[1]) for u in cut.users]


def _cut_by_slices(slices: list[fx.Node], total: int,
                   last: int) -> tuple[tuple[int, ...], list[tuple[fx.Node, int]]] | None:
    ranges = {}
    for s in slices:
        dim, start, end = (list(s.args[1:4]) + [0, None, sys.maxsize][len(s.args) - 1:])[:3]
        step = s.args[4] if len(s.args) > 4 else 1
        if not (isinstance(dim, int) and dim % (last + 1) == last and step == 1):
            return None
        start, end = start or 0, total if end is None else end
        if not (isinstance(start, int) and isinstance(end, int)) or start < 0 or end < 0:
            return None
        ranges[s] = (start, min(end, total))
    tiles = sorted(set(ranges.values()))
    if tiles[0][0] != 0 or tiles[-1][1] != total or any(a[1] != b[0] for a, b in zip(tiles, tiles[1:])):
        return None
    index = {r: b for b, r in enumerate(tiles)}
    return tuple(e - s for s, e in tiles), [(s, index[r]) for s, r in ranges.items()]


def _projection_params(y: fx.Node, slot_of: dict) -> list[tuple[str, int]] | None:
    """The parameters of the projection computing ``y`` (through at most one view) and their output dims."""
    proj = y.args[0] if y.target in VIEWS else y
    if y.target in VIEWS and (len(proj.users) != 1 or not _keeps_last_dim(proj, y)):
        return None
    if proj.target == aten.addmm.default:
        pairs = [(proj.args[2], 1), (proj.args[0], 0)]  # (in, out) weight, bias
    elif proj.target == aten.linear.default:
        pairs = [(proj.args[1], 0)] + ([(proj.args[2], 0)] if len(proj.args) > 2 and proj.args[2] is not None else [])
    else:
        return None
    params = []
    for node, d in pairs:
        slot = slot_of.get(node)
        if slot is None or slot.kind is not SlotKind.PARAM or len(node.users) != 1:
            return None
        params.append((slot.name, d))
    return params


def _keeps_last_dim(proj: fx.Node, view: fx.Node) -> bool:
    """Whether ``view`` of the projection's output keeps its last dim whole (flattening the leading dims).

    A view that splits it (GPT-NeoX's ``(B, S, heads * 3 * hd) -> (B, S, heads, 3 * hd)``) cuts each head's
    q|k|v, not the weight's columns: the weight is already stored head by head, and re-ordering it by the
    view's blocks would mix heads (and does not fit: the blocks tile the view's last dim, not the weight's).
    """
    a, b = proj.meta.get("val"), view.meta.get("val")
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape[-1] == b.shape[-1]
