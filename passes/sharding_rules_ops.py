"""Sharding rules for the general ops: pointwise ops, creation ops and shape ops,
with the building blocks they are written with (``_mapped``, ``_except`` and
``_first`` serve the rules of ``passes.sharding_rules_nn`` too).

The entries are added to ``RULES``, ``LOCAL_ARGS`` and ``LOCAL_OPS`` of
``passes.sharding_rules`` (import that module, not this one), and keep its
invariant: every strategy is sound on real tensors, as
``tests/test_sharding_rules.py`` checks for each entry.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch.distributed.tensor import Shard

from passes.sharding_rules import (
    LOCAL_ARGS,
    LOCAL_OPS,
    PARTIAL,
    REPLICATE,
    RULES,
    Call,
    Collectives,
    Op,
    Output,
    P,
    R,
    Rule,
    Strategy,
    broadcast_placement,
    divisible,
    norm_dim,
    shard_choices,
    summable,
)

aten = torch.ops.aten

SHARD_RANGE = "shard-range"  # arange split into n consecutive ranges


# ---------------------------------------------------------------------------
# Building blocks.


def _broadcast(call: Call, note: str = "") -> list[Strategy]:
    """Elementwise ops: shard one dim of the broadcast output; each tensor that has that
    dim at full size is sharded on it, the others (size 1 or missing) replicated."""
    tensors = call.tensors()
    out = torch.broadcast_shapes(*(t.shape for t in tensors))
    return [
        call.by_slot([broadcast_placement(t, o, len(out), size) for t in tensors], Shard(o), note)
        for o, size in enumerate(out)
        if divisible(size, call.n)
    ]


def _mapped(call: Call, dims: dict[int, int], *, linear: bool, outputs: int | None = None) -> list[Strategy]:
    """Ops with one main tensor (the first): main ``Shard(d)`` -> output ``Shard(dims[d])``
    for each listed d that divides; with ``linear``, main Partial -> Partial. Other tensors
    are Replicate. ``outputs``: None for one output, else the number of outputs."""
    name = call.slots[0][0]
    x = call.tensor(name)

    def out(p: Any) -> Output:
        return p if outputs is None else tuple([p] * outputs)

    found = [
        call.strategy(out(Shard(o)), "", **{name: Shard(d)}) for d, o in dims.items() if divisible(x.shape[d], call.n)
    ]
    if linear and summable(x):
        found.append(call.strategy(out(P), PARTIAL, **{name: P}))
    return found


def _except(ndim: int, *skip: int) -> dict[int, int]:
    """The identity dim map without the dims in ``skip``."""
    return {d: d for d in range(ndim) if d not in skip}


def _first(call: Call) -> torch.Tensor:
    return call.tensor(call.slots[0][0])


# ---------------------------------------------------------------------------
# Pointwise ops.


def _dropout(call: Call) -> list[Strategy]:
    identity = not call["train"] or call["p"] == 0
    return _mapped(call, _except(_first(call).ndim), linear=identity)


def _additive(call: Call) -> list[Strategy]:
    found = _broadcast(call)
    tensors = call.tensors()
    if isinstance(call["other"], torch.Tensor) and all(summable(t) for t in tensors):
        found.append(call.by_slot([P] * len(tensors), P, PARTIAL))
    return found


def _linear_in(*names: str) -> Rule:
    """Elementwise ops linear in each named operand taken alone (the others Replicate)."""

    def rule(call: Call) -> list[Strategy]:
        found = _broadcast(call)
        for name in names:
            if isinstance(call[name], torch.Tensor) and summable(call[name]):
                found.append(call.strategy(P, PARTIAL, **{name: P}))
        return found

    return rule


def _where(call: Call) -> list[Strategy]:
    found = _broadcast(call)
    if summable(call["self"]) and summable(call["other"]):
        found.append(call.strategy(P, PARTIAL, self=P, other=P))
    return found


def _masked_fill(call: Call) -> list[Strategy]:
    found = _broadcast(call)
    if call["value"] == 0 and summable(call["self"]):
        found.append(call.strategy(P, PARTIAL, self=P))
    return found


def _convert(call: Call) -> list[Strategy]:
    """Conversions: the output follows ``self``; Partial passes only float -> float;
    ``other`` (to.other, type_as) only gives a dtype, so any placement of it will do."""
    x, other = call["self"], call.get("other")
    dtype = other.dtype if isinstance(other, torch.Tensor) else call.get("dtype", x.dtype)
    pairs = [(Shard(d), Shard(d)) for d, s in enumerate(x.shape) if divisible(s, call.n)]
    if summable(x) and summable(dtype):
        pairs.append((P, P))
    others = shard_choices(other, call.n) if isinstance(other, torch.Tensor) else [R]
    return [call.strategy(out, "", self=p, other=q) for p, out in [(R, R), *pairs] for q in others]


def _assert_metadata(call: Call) -> list[Strategy] | None:
    if call["stride"] is not None:
        return None
    return _mapped(call, _except(call["a"].ndim), linear=True, outputs=0)


def _local_metadata(call: Call, strategy: Strategy, rank: int) -> tuple[tuple, dict]:
    placement, size = strategy.inputs[0], call["size"]
    if not isinstance(placement, Shard) or size is None:
        return call.args, call.kwargs
    return call.replace(size=_divide_at(size, placement.dim, call.n))


def _divide_at(size: Any, dim: int, n: int) -> list:
    size = list(size)
    if size[dim] != -1:
        size[dim] = size[dim] // n
    return size


# ---------------------------------------------------------------------------
# Creation ops.


def _like(call: Call) -> list[Strategy]:
    """*_like: the output takes the input's shards; a Partial input gives a Replicate output."""
    found = _mapped(call, _except(call["self"].ndim), linear=False)
    return found + ([call.strategy(R, "", self=P)] if summable(call["self"]) else [])


def _shardable_size(call: Call) -> list[Output]:
    return [R, *(Shard(d) for d, s in enumerate(call["size"]) if divisible(s, call.n))]


def _new(call: Call) -> list[Strategy]:
    """new_*(x, size): x lends only dtype and device, so any placement of it will do."""
    choices = shard_choices(call["self"], call.n)
    return [call.strategy(out, "", self=p) for out in _shardable_size(call) for p in choices]


def _factory(call: Call) -> list[Strategy]:
    return [call.strategy(out) for out in _shardable_size(call)]


def _local_size(call: Call, strategy: Strategy, rank: int) -> tuple[tuple, dict]:
    """Size-taking ops (view, expand, new_*, factories): the sharded output dim's size / n."""
    name = "shape" if call.op is aten.reshape.default else "size"
    if not isinstance(strategy.output, Shard):
        return call.args, call.kwargs
    return call.replace(**{name: _divide_at(call[name], strategy.output.dim, call.n)})


def _arange_bounds(call: Call) -> tuple[int, int, int] | None:
    start, end, step = call.get("start", 0), call["end"], call.get("step", 1)
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end, step))
    return (start, end, step) if ints and step != 0 else None


def _arange(call: Call) -> list[Strategy] | None:
    bounds = _arange_bounds(call)
    if bounds is None:
        return None
    start, end, step = bounds
    length = max(0, -((start - end) // step))
    return [call.strategy(Shard(0), SHARD_RANGE)] if divisible(length, call.n) else []


def _local_range(call: Call, strategy: Strategy, rank: int) -> tuple[tuple, dict]:
    if strategy.note != SHARD_RANGE:
        return call.args, call.kwargs
    start, end, step = _arange_bounds(call)
    chunk = -((start - end) // step) // call.n
    low = start + rank * chunk * step
    return call.replace(start=low, end=low + chunk * step)


def _local_arange(op: Op, n: int, rank: int, collectives: Collectives | None) -> Callable[..., Any]:
    """arange(end) has no start to shift: rank r runs arange(r * end/n, (r+1) * end/n)."""

    def arange(end: int, **kwargs: Any) -> torch.Tensor:
        chunk = end // n
        return aten.arange.start(rank * chunk, (rank + 1) * chunk, **kwargs)

    return arange


# ---------------------------------------------------------------------------
# Shape ops.


def _view(call: Call) -> list[Strategy] | None:
    """A sharded input dim that leads its group of merged / split dims maps to the
    leading dim of the matching output group, when that one divides too."""
    x = call["self"]
    sizes = list(call["shape" if call.op is aten.reshape.default else "size"])
    if not all(isinstance(s, int) for s in (*x.shape, *sizes)):
        return None
    out = _infer_sizes(x.numel(), sizes)
    found = [call.strategy(P, PARTIAL, self=P)] if summable(x) else []
    for ins, outs in _view_groups(list(x.shape), out):
        if divisible(x.shape[ins[0]], call.n) and divisible(out[outs[0]], call.n):
            found.append(call.strategy(Shard(outs[0]), "", self=Shard(ins[0])))
    return found


def _flatten(call: Call) -> list[Strategy] | None:
    """flatten(start, end) is the view that merges dims start..end (the same dim mapping)."""
    x = call["self"]
    if x.ndim == 0 or not all(isinstance(s, int) for s in x.shape):
        return None
    start, end = norm_dim(call["start_dim"], x.ndim), norm_dim(call["end_dim"], x.ndim)
    merged = 1
    for size in x.shape[start : end + 1]:
        merged *= size
    out = [*x.shape[:start], merged, *x.shape[end + 1 :]]
    found = [call.strategy(P, PARTIAL, self=P)] if summable(x) else []
    for ins, outs in _view_groups(list(x.shape), out):
        if divisible(x.shape[ins[0]], call.n) and divisible(out[outs[0]], call.n):
            found.append(call.strategy(Shard(outs[0]), "", self=Shard(ins[0])))
    return found


def _infer_sizes(numel: int, sizes: list[int]) -> list[int]:
    if -1 in sizes:
        known = 1
        for s in sizes:
            known *= s if s != -1 else 1
        sizes = [numel // known if s == -1 else s for s in sizes]
    return sizes


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
    return _mapped(call, {perm[o]: o for o in range(len(perm))}, linear=True)


def _unsqueeze(call: Call) -> list[Strategy]:
    x = call["self"]
    at = norm_dim(call["dim"], x.ndim + 1)
    return _mapped(call, {d: d + (d >= at) for d in range(x.ndim)}, linear=True)


def _squeeze(call: Call) -> list[Strategy]:
    """A sharded dim is never size 1, but its local size may be: then a squeeze that
    names it (or names every dim) would drop it locally, so it stays unsharded."""
    x = call["self"]
    named = call.get("dim", list(range(x.ndim)))
    named = {norm_dim(d, x.ndim) for d in ([named] if isinstance(named, int) else named)}
    kept = [d for d in range(x.ndim) if not (d in named and x.shape[d] == 1)]
    dims = {d: kept.index(d) for d in kept if d not in named or x.shape[d] // call.n != 1}
    return _mapped(call, dims, linear=True)


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
    return _mapped(call, _except(x.ndim) if whole else _except(x.ndim, dim), linear=True)


def _select(call: Call) -> list[Strategy]:
    x = call["self"]
    dim = norm_dim(call["dim"], x.ndim)
    return _mapped(call, {d: d - (d > dim) for d in range(x.ndim) if d != dim}, linear=True)


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
        return _mapped(call, {d: d - (d > dim) for d in range(x.ndim) if d != dim}, linear=True, outputs=size)
    if call.op is aten.split_with_sizes.default:
        count = len(call["split_sizes"])
    else:
        piece = call["split_size"] if call.op is aten.split.Tensor else -(-size // call["chunks"])
        count = max(1, -(-size // piece))
    return _mapped(call, _except(x.ndim, dim), linear=True, outputs=count)


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
    return _mapped(call, _except(x.ndim, *padded), linear=linear)


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


# ---------------------------------------------------------------------------
# The tables.

_POINTWISE = [
    aten.abs.default, aten.cos.default, aten.sin.default, aten.exp.default, aten.log.default,
    aten.tanh.default, aten.sqrt.default, aten.rsqrt.default, aten.sigmoid.default,
    aten.relu.default, aten.gelu.default, aten.silu.default, aten.erf.default,
    aten.reciprocal.default, aten.logical_not.default, aten.bitwise_not.default,
    aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar,
    aten.clamp.default, aten.clamp.Tensor,
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor, aten.lt.Scalar,
    aten.le.Tensor, aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar,
    aten.logical_and.default, aten.logical_or.default, aten.logical_xor.default,
    aten.__and__.Tensor, aten.__or__.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
    aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar, aten.div.Tensor_mode,
    aten.masked_fill.Tensor, aten.where.ScalarOther, aten.where.ScalarSelf,
]

OP_RULES: dict[Op, Rule] = {
    # elementwise with broadcasting: shard any output dim; operands with it at size 1 replicate
    **dict.fromkeys(_POINTWISE, _broadcast),
    # dropout: as elementwise; the lowering keeps each rank's random mask the matching part of one mask
    aten.dropout.default: _dropout,
    # a + b, a - b, b - a: also Partial when both operands are Partial
    **dict.fromkeys([aten.add.Tensor, aten.sub.Tensor, aten.rsub.Tensor], _additive),
    # a * b: also Partial with either operand Partial and the other Replicate
    **dict.fromkeys([aten.mul.Tensor, aten.mul.Scalar], _linear_in("self", "other")),
    # a / b: also Partial with the numerator Partial
    **dict.fromkeys([aten.div.Tensor, aten.div.Scalar], _linear_in("self")),
    # where(c, a, b): also Partial with a and b Partial
    aten.where.self: _where,
    # masked_fill(x, mask, v): also Partial with x Partial when v == 0
    aten.masked_fill.Scalar: _masked_fill,
    # identity-like and negation: also Partial -> Partial
    **dict.fromkeys([aten.neg.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
                     aten.detach.default], _linear_in("self")),
    # dtype / device conversions: Partial only float -> float; `other` only lends a dtype
    **dict.fromkeys([aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten.to.other,
                     aten._to_copy.default, aten.type_as.default], _convert),
    # metadata assertion: passes through, its size rewritten to local sizes
    aten._assert_tensor_metadata.default: _assert_metadata,
    # *_like: the output takes the input's shards
    **dict.fromkeys([aten.ones_like.default, aten.zeros_like.default, aten.full_like.default,
                     aten.empty_like.default], _like),
    # new_*(x, size): output Replicate or sharded (local sizes); x's placement is free
    **dict.fromkeys([aten.new_ones.default, aten.new_zeros.default, aten.new_full.default,
                     aten.new_empty.default], _new),
    # factories: output Replicate or sharded (local sizes)
    **dict.fromkeys([aten.ones.default, aten.zeros.default, aten.full.default,
                     aten.empty.memory_format], _factory),
    # arange: Replicate, or Shard(0) with each rank producing its own range
    **dict.fromkeys([aten.arange.default, aten.arange.start, aten.arange.start_step], _arange),
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
}

OP_LOCAL_ARGS: dict[Op, Callable[[Call, Strategy, int], tuple[tuple, dict]]] = {
    **dict.fromkeys([aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
                     aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
                     aten.ones.default, aten.zeros.default, aten.full.default, aten.empty.memory_format], _local_size),
    **dict.fromkeys([aten.arange.start, aten.arange.start_step], _local_range),
    aten._assert_tensor_metadata.default: _local_metadata,
}

OP_LOCAL_OPS: dict[tuple[Op, str], Callable[..., Callable[..., Any]]] = {
    (aten.arange.default, SHARD_RANGE): _local_arange,
}

RULES.update(OP_RULES)
LOCAL_ARGS.update(OP_LOCAL_ARGS)
LOCAL_OPS.update(OP_LOCAL_OPS)

# The reduction, normalization, attention, embedding and loss rules use the blocks
# above, so they are imported here, once those exist: this works in any import order.
import passes.sharding_rules_nn  # noqa: E402,F401
