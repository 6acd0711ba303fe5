"""Sharding rules for the shape ops: view / reshape / flatten, expand, permute /
transpose, unsqueeze / squeeze, slice / narrow, select, split / chunk / unbind,
getitem on a tuple, cat / stack, index, gather, pad, diff and repeat_interleave.

Every strategy is sound on real tensors, as ``tests/test_sharding_rules.py``
checks for each entry (the cases for these ops are in ``tests/harness/cases/shape.py``).
"""

from __future__ import annotations

import operator

import torch
from torch.distributed.tensor import Shard

from autopar.passes.rules.base import (
    PARTIAL, REPLICATE, Call, LocalArgs, Op, P, R, Rule, Strategy, broadcast_placement, dims_except, divisible,
    local_size, mapped, norm_dim, shard_choices, summable,
)

aten = torch.ops.aten


# ---------------------------------------------------------------------------
# Shape ops.

def _view(call: Call) -> list[Strategy] | None:
    """A sharded input dim that leads its group of merged / split dims maps to the
    leading dim of the matching output group, when that one divides too."""
    x = call["self"]
    sizes = list(call["shape" if call.op is aten.reshape.default else "size"])
    if not all(isinstance(s, int) for s in (*x.shape, *sizes)):
        return None
    return _view_strategies(call, x, _infer_sizes(x.numel(), sizes))


def _flatten(call: Call) -> list[Strategy] | None:
    """flatten(start, end) is the view that merges dims start..end (the same dim mapping)."""
    x = call["self"]
    if x.ndim == 0 or not all(isinstance(s, int) for s in x.shape):
        return None
    start, end = norm_dim(call["start_dim"], x.ndim), norm_dim(call["end_dim"], x.ndim)
    merged = 1
    for size in x.shape[start : end + 1]:
        merged *= size
    return _view_strategies(call, x, [*x.shape[:start], merged, *x.shape[end + 1 :]])


def _infer_sizes(numel: int, sizes: list[int]) -> list[int]:
    if -1 in sizes:
        known = 1
        for s in sizes:
            known *= s if s != -1 else 1
        sizes = [numel // known if s == -1 else s for s in sizes]
    return sizes


def _view_strategies(call: Call, x: torch.Tensor, out: list[int]) -> list[Strategy]:
    """Strategies of a view of ``x`` as shape ``out``: Partial through, and each input group's leading dim
    sharded onto the matching output group's leading dim where both divide."""
    found = [call.strategy(P, PARTIAL, self=P)] if summable(x) else []
    for ins, outs in _view_groups(list(x.shape), out):
        if divisible(x.shape[ins[0]], call.n) and divisible(out[outs[0]], call.n):
            found.append(call.strategy(Shard(outs[0]), "", self=Shard(ins[0])))
    return found


def _view_groups(a: list[int], b: list[int]) -> list[tuple[list[int], list[int]]]:
    """Pairs (dims of a, dims of b) of consecutive non-1 dims with equal products."""
    if 0 in a or 0 in b:
        return []
    da, db = [d for d, s in enumerate(a) if s != 1], [d for d, s in enumerate(b) if s != 1]
    groups, i, j = [], 0, 0
    while i < len(da) and j < len(db):
        ga, gb, pa, pb = [da[i]], [db[j]], a[da[i]], b[db[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ga.append(da[i])
                pa, i = pa * a[da[i]], i + 1
            else:
                gb.append(db[j])
                pb, j = pb * b[db[j]], j + 1
        groups.append((ga, gb))
    return groups


def _expand(call: Call) -> list[Strategy]:
    """A dim kept from the input follows its shard; a broadcast (size 1) or new dim
    may be sharded with the input replicated, each rank expanding to its local size."""
    x, size = call["self"], list(call["size"])
    offset = len(size) - x.ndim
    found = [call.strategy(P, PARTIAL, self=P)] if summable(x) else []
    for o, s in enumerate(size):
        d = o - offset
        full = x.shape[d] if s == -1 else s
        if divisible(full, call.n):
            kept = d >= 0 and x.shape[d] == full
            found.append(call.strategy(Shard(o), "", self=Shard(d) if kept else R))
    return found


def _permute(call: Call) -> list[Strategy]:
    x = call["self"]
    if call.op is aten.t.default:
        perm = list(reversed(range(x.ndim)))
    elif call.op is aten.transpose.int:
        perm = list(range(x.ndim))
        a, b = norm_dim(call["dim0"], x.ndim), norm_dim(call["dim1"], x.ndim)
        perm[a], perm[b] = perm[b], perm[a]
    else:
        perm = [norm_dim(d, x.ndim) for d in call["dims"]]
    return mapped(call, {perm[o]: o for o in range(len(perm))}, linear=True)


def _unsqueeze(call: Call) -> list[Strategy]:
    x = call["self"]
    at = norm_dim(call["dim"], x.ndim + 1)
    return mapped(call, {d: d + (d >= at) for d in range(x.ndim)}, linear=True)


def _squeeze(call: Call) -> list[Strategy]:
    """A sharded dim is never size 1, but its local size may be: then a squeeze that
    names it (or names every dim) would drop it locally, so it stays unsharded."""
    x = call["self"]
    named = call.get("dim", list(range(x.ndim)))
    named = {norm_dim(d, x.ndim) for d in ([named] if isinstance(named, int) else named)}
    kept = [d for d in range(x.ndim) if not (d in named and x.shape[d] == 1)]
    dims = {d: kept.index(d) for d in kept if d not in named or x.shape[d] // call.n != 1}
    return mapped(call, dims, linear=True)


def _slice(call: Call) -> list[Strategy]:
    """Slice / narrow: any dim but the sliced one. A slice that keeps all of its dim
    (start 0, end past the size, step 1: common in captured graphs) keeps the shard too,
    its bounds still right on the local shard; narrow's length would not be."""
    x = call["self"]
    dim = norm_dim(call["dim"], x.ndim)
    whole = (
        call.op is aten.slice.Tensor
        and call["start"] in (None, 0)
        and (call["end"] is None or call["end"] >= x.shape[dim])
        and call["step"] == 1
    )
    return mapped(call, dims_except(x.ndim) if whole else dims_except(x.ndim, dim), linear=True)


def _select(call: Call) -> list[Strategy]:
    x = call["self"]
    dim = norm_dim(call["dim"], x.ndim)
    return mapped(call, {d: d - (d > dim) for d in range(x.ndim) if d != dim}, linear=True)


def _split(call: Call) -> list[Strategy] | None:
    """split / split_with_sizes / chunk / unbind along a dim that is not sharded."""
    x = call["self"]
    if x.ndim == 0:
        return None
    dim = norm_dim(call["dim"], x.ndim)
    size = x.shape[dim]
    if not isinstance(size, int) or size == 0:
        return None
    if call.op is aten.unbind.int:
        return mapped(call, {d: d - (d > dim) for d in range(x.ndim) if d != dim}, linear=True, outputs=size)
    if call.op is aten.split_with_sizes.default:
        count = len(call["split_sizes"])
    else:
        piece = call["split_size"] if call.op is aten.split.Tensor else -(-size // call["chunks"])
        count = max(1, -(-size // piece))
    return mapped(call, dims_except(x.ndim, dim), linear=True, outputs=count)


def _getitem(call: Call) -> list[Strategy] | None:
    """getitem on a tuple of tensors: the output is the selected element, read as it is;
    the other elements are not read (None)."""
    items, index = call["arg0"], call["arg1"]
    if not isinstance(items, (list, tuple)) or not isinstance(index, int):
        return None
    if not isinstance(items[index], torch.Tensor):
        return None
    found = []
    for p in shard_choices(items[index], call.n):
        placements = [None] * len(items)
        placements[index] = p
        found.append(call.strategy(p, REPLICATE if p == R else "", arg0=placements))
    return found


def _concat(call: Call) -> list[Strategy] | None:
    """cat / stack along a dim that is not sharded; all Partial -> Partial."""
    tensors = call["tensors"]
    ndims = {t.ndim for t in tensors}
    if len(ndims) != 1 or 0 in ndims:
        return None
    ndim = ndims.pop()
    stack = call.op is aten.stack.default
    dim = norm_dim(call["dim"], ndim + stack)
    found = []
    for d in range(ndim):
        if (stack or d != dim) and all(divisible(t.shape[d], call.n) for t in tensors):
            found.append(call.strategy(Shard(d + (stack and d >= dim)), "", tensors=Shard(d)))
    if all(summable(t) for t in tensors):
        found.append(call.strategy(P, PARTIAL, tensors=P))
    return found


def _index(call: Call) -> list[Strategy] | None:
    """x[indices]: shard a dim x keeps (its None index), or a dim of the broadcast index
    tensors (x replicated)."""
    x, indices = call["self"], list(call["indices"])
    used = [i for i, t in enumerate(indices) if t is not None]
    if not used or any(indices[i].dtype in (torch.bool, torch.uint8) for i in used):
        return None
    shape = torch.broadcast_shapes(*(indices[i].shape for i in used))
    adjacent = used == list(range(used[0], used[-1] + 1))
    free = [d for d in range(x.ndim) if d not in used]
    where_b = sum(d < used[0] for d in free) if adjacent else 0  # output dim of the index dims
    found = []
    for k, d in enumerate(free):
        if divisible(x.shape[d], call.n):
            o = k if adjacent and d < used[0] else k + len(shape)
            found.append(call.strategy(Shard(o), "", self=Shard(d)))
    for j, size in enumerate(shape):
        if divisible(size, call.n):
            per = [broadcast_placement(t, j, len(shape), size) if t is not None else None for t in indices]
            found.append(call.strategy(Shard(where_b + j), "", indices=per))
    if summable(x):
        found.append(call.strategy(P, PARTIAL, self=P))
    return found


def _gather(call: Call) -> list[Strategy] | None:
    x, index = call["self"], call["index"]
    if x.ndim == 0 or index.ndim != x.ndim:
        return None
    dim = norm_dim(call["dim"], x.ndim)
    found = []
    for d in range(x.ndim):
        if d == dim and divisible(index.shape[d], call.n):
            found.append(call.strategy(Shard(d), "", index=Shard(d)))
        elif d != dim and index.shape[d] == x.shape[d] and divisible(x.shape[d], call.n):
            found.append(call.strategy(Shard(d), "", self=Shard(d), index=Shard(d)))
    if summable(x):
        found.append(call.strategy(P, PARTIAL, self=P))
    return found


def _pad(call: Call) -> list[Strategy]:
    x, pad = call["self"], list(call["pad"])
    padded = {x.ndim - 1 - i // 2 for i, p in enumerate(pad) if p != 0}
    linear = call["mode"] == "constant" and not call["value"]
    return mapped(call, dims_except(x.ndim, *padded), linear=linear)


def _diff(call: Call) -> list[Strategy]:
    x = call["self"]
    dim = norm_dim(call["dim"], x.ndim)
    found = [
        call.strategy(Shard(d), "", self=Shard(d), prepend=Shard(d), append=Shard(d))
        for d in range(x.ndim)
        if d != dim and divisible(x.shape[d], call.n)
    ]
    if all(summable(t) for t in call.tensors()):
        found.append(call.by_slot([P] * len(call.slots), P, PARTIAL))
    return found


def _repeat_interleave(call: Call) -> list[Strategy] | None:
    """Any dim: the repeats of an element stay next to it, so rank r's chunk becomes rank r's chunk
    (the repeated dim too, unless ``output_size`` would need a local value)."""
    x, dim = call["self"], call["dim"]
    if dim is None or not isinstance(call["repeats"], int):
        return None
    dim = norm_dim(dim, x.ndim)
    found = [call.strategy(Shard(d), "", self=Shard(d)) for d in range(x.ndim)
             if divisible(x.shape[d], call.n) and (d != dim or call["output_size"] is None)]
    if summable(x):
        found.append(call.strategy(P, PARTIAL, self=P))
    return found


# ---------------------------------------------------------------------------
# The tables.

RULES: dict[Op, Rule] = {
    # view / reshape: a sharded dim leading a merge/split group maps to the group's leading output dim
    **dict.fromkeys([aten.view.default, aten.reshape.default, aten._unsafe_view.default], _view),
    aten.flatten.using_ints: _flatten,  # a view merging dims start..end
    # expand: kept dims follow the input; broadcast or new dims may be sharded from a replicated input
    aten.expand.default: _expand,
    # transpose / permute / t: the shard follows its dim
    **dict.fromkeys([aten.transpose.int, aten.permute.default, aten.t.default], _permute),
    # unsqueeze: the shard follows its dim
    aten.unsqueeze.default: _unsqueeze,
    # squeeze: the shard follows its dim, unless its local size 1 would be squeezed away
    **dict.fromkeys([aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims], _squeeze),
    # slice / narrow: any dim but the sliced one (unless the slice keeps it whole)
    **dict.fromkeys([aten.slice.Tensor, aten.narrow.default], _slice),
    # select: any dim but the selected one
    aten.select.int: _select,
    # split / chunk / unbind: any dim but the split one; every output sharded alike
    **dict.fromkeys([aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
                     aten.unbind.int], _split),
    # getitem on a tuple: the selected element's placement
    operator.getitem: _getitem,
    # cat / stack: every input sharded alike on a dim other than the joined one
    **dict.fromkeys([aten.cat.default, aten.stack.default], _concat),
    # x[indices]: a dim x keeps, or a dim of the index tensors with x replicated
    aten.index.Tensor: _index,
    # gather: a dim other than `dim` sharded on both, or `dim` of the index with x replicated
    aten.gather.default: _gather,
    # pad: any dim that is not padded
    aten.pad.default: _pad,
    # diff: any dim but `dim` (prepend / append sharded alike)
    aten.diff.default: _diff,
    # repeat_interleave along a dim (grouped-query attention's kv heads): any dim keeps its shard
    aten.repeat_interleave.self_int: _repeat_interleave,
}

LOCAL_ARGS: dict[Op, LocalArgs] = {
    # view / reshape / expand: the sharded output dim's size / n
    **dict.fromkeys([aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default],
                    local_size),
}
