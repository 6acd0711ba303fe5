"""Sharding rules for the general ops: pointwise ops (with dropout, dtype
conversions and the metadata assertion) and creation ops (*_like, new_*,
factories, arange).

Every strategy is sound on real tensors, as ``tests/test_sharding_rules.py``
checks for each entry.
"""

from __future__ import annotations


import torch
from torch.distributed.tensor import Shard

from autopar.passes.rules.base import (
    PARTIAL, Call, Collectives, LocalArgs, LocalOp, Op, Output, P, R, Rule, Strategy, broadcast_placement,
    dims_except, divide_at, divisible, first_tensor, local_size, mapped, shard_choices, summable,
)

aten = torch.ops.aten

SHARD_RANGE = "shard-range"  # arange split into n consecutive ranges
ONE_MASK = "part-of-one-mask-{}"  # dropout on Shard(d): each rank applies its part of one full-size mask
MAX_DIMS = 8


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


# ---------------------------------------------------------------------------
# Pointwise ops.


def _dropout(call: Call) -> list[Strategy]:
    identity = not call["train"] or call["p"] == 0
    found = mapped(call, dims_except(first_tensor(call).ndim), linear=identity)
    if identity:
        return found
    if first_tensor(call).ndim > MAX_DIMS:
        return []
    return [Strategy(s.inputs, s.output, ONE_MASK.format(s.output.dim)) for s in found]


def _part_of_one_mask(dim: int) -> LocalOp:
    def dropout_part(call: Call, rank: int, collectives: Collectives | None) -> torch.Tensor:
        """Draws the mask of the whole tensor (every rank of the axis draws the same numbers: the runtime
        seeds them alike) and applies this rank's part: the ranks together drop what one device,
        or the replicated op, would."""
        x, p = call["input"], call["p"]
        shape = list(x.shape)
        shape[dim] *= call.n
        noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p).div_(1 - p)
        return x * noise.chunk(call.n, dim)[rank]

    dropout_part.__name__ = dropout_part.__qualname__ = f"dropout_part_{dim}"
    return LocalOp(dropout_part)


for _dim in range(MAX_DIMS):  # module-level names: a LocalOp pickles by name
    globals()[f"dropout_part_{_dim}"] = _part_of_one_mask(_dim)


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
    return mapped(call, dims_except(call["a"].ndim), linear=True, outputs=0)


def _local_metadata(call: Call, strategy: Strategy) -> tuple[tuple, dict]:
    placement, size = strategy.inputs[0], call["size"]
    if not isinstance(placement, Shard) or size is None:
        return call.args, call.kwargs
    return call.replace(size=divide_at(size, placement.dim, call.n))


# ---------------------------------------------------------------------------
# Creation ops.


def _like(call: Call) -> list[Strategy]:
    """*_like: the output takes the input's shards; a Partial input gives a Replicate output."""
    found = mapped(call, dims_except(call["self"].ndim), linear=False)
    return found + ([call.strategy(R, "", self=P)] if summable(call["self"]) else [])


def _shardable_size(call: Call) -> list[Output]:
    return [R, *(Shard(d) for d, s in enumerate(call["size"]) if divisible(s, call.n))]


def _new(call: Call) -> list[Strategy]:
    """new_*(x, size): x lends only dtype and device, so any placement of it will do."""
    choices = shard_choices(call["self"], call.n)
    return [call.strategy(out, "", self=p) for out in _shardable_size(call) for p in choices]


def _factory(call: Call) -> list[Strategy]:
    return [call.strategy(out) for out in _shardable_size(call)]


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


@LocalOp
def shard_range(call: Call, rank: int, collectives: Collectives | None) -> torch.Tensor:
    """arange split into n consecutive ranges: rank r produces the r-th (arange(end) has no
    start to shift, so it runs as arange(start, end))."""
    start, end, step = _arange_bounds(call)
    chunk = -((start - end) // step) // call.n
    low = start + rank * chunk * step
    if call.op is aten.arange.default:
        return aten.arange.start(low, low + chunk * step, **call.kwargs)
    return call.run(start=low, end=low + chunk * step)


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

RULES: dict[Op, Rule] = {
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
}

# op -> the function giving a rank's (args, kwargs): shape-like arguments at local sizes
LOCAL_ARGS: dict[Op, LocalArgs] = {
    **dict.fromkeys([aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
                     aten.ones.default, aten.zeros.default, aten.full.default, aten.empty.memory_format], local_size),
    aten._assert_tensor_metadata.default: _local_metadata,
}

# (op, note) -> what a rank runs in place of the op under that strategy
LOCAL_OPS: dict[tuple[Op, str], LocalOp] = {
    # arange: each rank produces its own range
    **{(op, SHARD_RANGE): shard_range for op in (aten.arange.default, aten.arange.start, aten.arange.start_step)},
    # dropout on a sharded dim: this rank's part of one mask
    **{(aten.dropout.default, ONE_MASK.format(d)): globals()[f"dropout_part_{d}"] for d in range(MAX_DIMS)},
}
