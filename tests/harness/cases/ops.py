"""Ground-truth cases of the matmul, pointwise and creation ops: each draws the arguments of its ops."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

from harness.rules import F64, Case, Draw, aten, cases


CASES: dict[Any, Case] = {}
case = cases(CASES)


@case(aten.abs.default, aten.cos.default, aten.sin.default, aten.exp.default, aten.tanh.default,
      aten.sigmoid.default, aten.relu.default, aten.silu.default, aten.erf.default, aten.neg.default,
      aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default)
def _unary(d: Draw, op: Any) -> tuple[tuple, dict]:
    return (d.floats(d.shape(0)),), {}


@case(aten.log.default, aten.sqrt.default, aten.rsqrt.default, aten.reciprocal.default)
def _unary_positive(d: Draw, op: Any) -> tuple[tuple, dict]:
    return (d.floats(d.shape(0), positive=True),), {}


@case(aten.gelu.default)
def _gelu(d: Draw, op: Any) -> tuple[tuple, dict]:
    return (d.floats(d.shape(0)),), {"approximate": d.pick("none", "tanh")}


@case(aten.logical_not.default, aten.bitwise_not.default)
def _unary_bool(d: Draw, op: Any) -> tuple[tuple, dict]:
    return (d.bools(d.shape(0)),), {}


@case(aten.pow.Tensor_Scalar)
def _pow_scalar(d: Draw, op: Any) -> tuple[tuple, dict]:
    return (d.floats(d.shape(0), positive=True), d.pick(2, 0.5, -1.0, 3)), {}


@case(aten.pow.Tensor_Tensor)
def _pow_tensor(d: Draw, op: Any) -> tuple[tuple, dict]:
    a, b = d.pair()
    return (d.floats(a, positive=True), d.floats(b)), {}


@case(aten.pow.Scalar)
def _pow_base(d: Draw, op: Any) -> tuple[tuple, dict]:
    return (d.pick(2.0, 0.5), d.floats(d.shape(0))), {}


@case(aten.clamp.default)
def _clamp(d: Draw, op: Any) -> tuple[tuple, dict]:
    return (d.floats(d.shape(0)),), d.pick({"min": -0.5}, {"max": 0.3}, {"min": -0.2, "max": 0.7})


@case(aten.clamp.Tensor)
def _clamp_tensor(d: Draw, op: Any) -> tuple[tuple, dict]:
    shape = d.shape()
    bound = d.floats(d.broadcastable(shape))
    return (d.floats(shape),), {d.pick("min", "max"): bound}


@case(aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor, aten.ge.Tensor)
def _compare(d: Draw, op: Any) -> tuple[tuple, dict]:
    a, b = d.pair()
    x = d.floats(a).round()
    return (x, d.floats(b).round()), {}


@case(aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar)
def _compare_scalar(d: Draw, op: Any) -> tuple[tuple, dict]:
    return (d.floats(d.shape(0)).round(), d.pick(0, 1.0)), {}


@case(aten.logical_and.default, aten.logical_or.default, aten.logical_xor.default, aten.__and__.Tensor,
      aten.__or__.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor)
def _logical(d: Draw, op: Any) -> tuple[tuple, dict]:
    a, b = d.pair()
    return (d.bools(a), d.bools(b)), {}


@case(aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar)
def _scalar_arith(d: Draw, op: Any) -> tuple[tuple, dict]:
    return (d.floats(d.shape(0)), d.pick(1.0, 3)), d.pick({}, {"alpha": 2})


@case(aten.add.Tensor, aten.sub.Tensor, aten.rsub.Tensor)
def _additive(d: Draw, op: Any) -> tuple[tuple, dict]:
    a, b = d.pair()
    other = d.pick("tensor", "0-dim") if op is aten.rsub.Tensor else d.pick("tensor", "scalar", "0-dim")
    b = d.floats(b) if other == "tensor" else 2.5 if other == "scalar" else d.floats([])
    return (d.floats(a), b), d.pick({}, {"alpha": 2})


@case(aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar)
def _product(d: Draw, op: Any) -> tuple[tuple, dict]:
    a, b = d.pair()
    scalar = op in (aten.mul.Scalar, aten.div.Scalar) or d(st.booleans())
    return (d.floats(a), 4.0 if scalar else d.floats(b, positive=True)), {}


@case(aten.div.Tensor_mode)
def _div_mode(d: Draw, op: Any) -> tuple[tuple, dict]:
    a, b = d.pair()
    return (d.floats(a), d.floats(b, positive=True)), {"rounding_mode": d.pick("trunc", "floor")}


@case(aten.where.self)
def _where(d: Draw, op: Any) -> tuple[tuple, dict]:
    shape = d.shape()
    return (d.bools(d.broadcastable(shape)), d.floats(d.broadcastable(shape)), d.floats(shape)), {}


@case(aten.where.ScalarOther, aten.where.ScalarSelf)
def _where_scalar(d: Draw, op: Any) -> tuple[tuple, dict]:
    a, b = d.pair()
    x = d.floats(b)
    return ((d.bools(a), x, 0.0) if op is aten.where.ScalarOther else (d.bools(a), -1.0, x)), {}


@case(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _masked_fill(d: Draw, op: Any) -> tuple[tuple, dict]:
    shape = d.shape()
    value = d.pick(0.0, -1e4)
    value = torch.tensor(value, dtype=F64) if op is aten.masked_fill.Tensor else value
    return (d.floats(shape), d.bools(d.broadcastable(shape)), value), {}


@case(aten.dropout.default)
def _dropout(d: Draw, op: Any) -> tuple[tuple, dict]:
    p = d.pick(0.0, 0.3)  # the harness draws the same random numbers for the whole tensor and for each rank
    return (d.floats(d.shape()), p, d(st.booleans())), {}


@case(aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten._to_copy.default)
def _to(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape(0))
    dtype = d.pick(F64, torch.float32, torch.int64)
    if op is aten.to.dtype:
        return (x, dtype), {}
    if op is aten.to.device:
        return (x, torch.device("cpu"), dtype), {}
    return (x,), {"dtype": dtype, "layout": torch.strided, "device": torch.device("cpu")}


@case(aten.to.other, aten.type_as.default)
def _to_other(d: Draw, op: Any) -> tuple[tuple, dict]:
    other = d.floats(d.shape(0)).to(d.pick(F64, torch.float32, torch.int64))
    return (d.floats(d.shape(0)), other), {}


@case(aten._assert_tensor_metadata.default)
def _assert_metadata(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape(0))
    kwargs = {"dtype": F64, "device": torch.device("cpu"), "layout": torch.strided}
    if d(st.booleans()):
        kwargs["size"] = list(x.shape)
    if d(st.booleans()):
        kwargs["stride"] = list(x.stride())
    return (x,), kwargs


@case(aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default, aten.full_like.default)
def _like(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape(0))
    return ((x, 2.5) if op is aten.full_like.default else (x,)), d.pick({}, {"dtype": torch.int64})


@case(aten.new_ones.default, aten.new_zeros.default, aten.new_empty.default, aten.new_full.default)
def _new(d: Draw, op: Any) -> tuple[tuple, dict]:
    x, size = d.floats(d.shape(0)), d.shape(0)
    return ((x, size, 1.5) if op is aten.new_full.default else (x, size)), d.pick({}, {"dtype": torch.bool})


@case(aten.ones.default, aten.zeros.default, aten.empty.memory_format, aten.full.default)
def _factory(d: Draw, op: Any) -> tuple[tuple, dict]:
    size = d.shape(0)
    return ((size, 1.5) if op is aten.full.default else (size,)), {"dtype": F64}


@case(aten.arange.default, aten.arange.start, aten.arange.start_step)
def _arange(d: Draw, op: Any) -> tuple[tuple, dict]:
    kwargs = d.pick({}, {"dtype": F64})
    length = d.size() * d.pick(1, d.n)
    if op is aten.arange.default:
        return (length,), kwargs
    start = d(st.integers(-5, 5))
    if op is aten.arange.start:
        return (start, start + length), kwargs
    step = d.pick(1, 2, 3, -2)
    return (start, start + length * step - d(st.integers(0, abs(step) - 1)) * (1 if step > 0 else -1), step), kwargs


@case(aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default)
def _mm(d: Draw, op: Any) -> tuple[tuple, dict]:
    batched = op in (aten.bmm.default, aten.baddbmm.default)
    b, m, k, n = d.size(), d.size(), d.size(), d.size()
    a, w = d.floats([b, m, k] if batched else [m, k]), d.floats([b, k, n] if batched else [k, n])
    if op in (aten.mm.default, aten.bmm.default):
        return (a, w), {}
    bias = d.floats(d.broadcastable([b, m, n] if batched else [m, n]))
    return (bias, a, w), d.pick({}, {"beta": 0.5, "alpha": 2.0})


@case(aten.linear.default)
def _linear(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape(1, 3))
    k, n = x.shape[-1], d.size()
    weight = d.floats([n, k] if d(st.integers(0, 3)) else [k])
    bias = d.floats(weight.shape[:1]) if weight.ndim == 2 and d(st.booleans()) else None
    return ((x, weight, bias) if bias is not None or d(st.booleans()) else (x, weight)), {}


@case(aten.matmul.default)
def _matmul(d: Draw, op: Any) -> tuple[tuple, dict]:
    k = d.size()
    batch_a, batch_b = d.pair(0)
    a = batch_a[-d(st.integers(0, 2)):] if batch_a and d(st.booleans()) else batch_a
    shape_a = [k] if d(st.integers(0, 4)) == 0 else a + [d.size(), k]
    shape_b = [k] if d(st.integers(0, 4)) == 0 else batch_b + [k, d.size()]
    return (d.floats(shape_a), d.floats(shape_b)), {}


EINSUMS = ["ij,jk->ik", "bij,bjk->bik", "ij,j->i", "i,i->", "bhqd,bhkd->bhqk", "...ij,jk->...ik",
           "ij->j", "ij,ij->ij", "ij,kj", "ii->i", "bi,i,ij->bj"]


@case(aten.einsum.default)
def _einsum(d: Draw, op: Any) -> tuple[tuple, dict]:
    equation = d.pick(*EINSUMS)
    sizes = {c: d.size() for c in "bhijkqd"}
    batch = d.shape(0, 2)
    operands = equation.split("->")[0].split(",")
    shapes = [(batch if "..." in o else []) + [sizes[c] for c in o.replace("...", "")] for o in operands]
    return (equation, [d.floats(s) for s in shapes]), {}
