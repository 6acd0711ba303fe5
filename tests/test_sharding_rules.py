"""Ground truth for ``passes.sharding_rules``: every strategy of every rule, on real tensors.

For each op in ``RULES`` hypothesis draws shapes (dims that divide by n and
dims that do not, n in {2, 3, 4}) and arguments. Every strategy that
``strategies`` returns is then run over a simulated group of n ranks inside
this process: the inputs are sharded as it says (Shard(d): ``torch.chunk``
along d; Replicate: the full tensor; Partial: random summands adding up to the
full tensor), each rank runs the op (or its ``local_op``) on its shards with
``local_args``, and each rank's result is compared, in float64, with its part
of the op's result on the full tensors (its chunk for Shard; the whole for
Replicate, every rank alike; for Partial the sum over ranks).
"""

from __future__ import annotations

import operator
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.utils._pytree import tree_flatten, tree_unflatten

from passes.sharding_rules import RULES, Strategy, has_rule, local_args, local_op, strategies

aten = torch.ops.aten
R, P = Replicate(), Partial()
F64 = torch.float64
SIZES = [1, 2, 3, 4, 5, 6, 8, 12]
MAX_EXAMPLES = 200 if os.environ.get("AUTOPAR_SLOW") else 12
VALUELESS = {aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default}


# ---------------------------------------------------------------------------
# The simulated group and the check.


class SimulatedGroup:
    """n ranks as n threads of this process; collectives meet at a barrier."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.slots: list[Any] = [None] * n

    def member(self, rank: int) -> "Member":
        return Member(self, rank)

    def reduce(self, rank: int, t: torch.Tensor, combine: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        self.slots[rank] = t
        self.barrier.wait()
        result = combine(torch.stack(self.slots))
        self.barrier.wait()  # every rank has read the slots before any writes again
        return result


class Member:
    def __init__(self, group: SimulatedGroup, rank: int) -> None:
        self.group, self.rank = group, rank

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self.group.reduce(self.rank, t, lambda ts: ts.sum(0))

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        return self.group.reduce(self.rank, t, lambda ts: ts.amax(0))


def shard(t: torch.Tensor, p: Any, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """The n local tensors of ``t`` under placement ``p``."""
    if p is None:  # not read by the op: garbage that would show if it were
        return [torch.full_like(t, float("nan")) if t.is_floating_point() else t] * n
    if isinstance(p, Shard):
        assert t.shape[p.dim] % n == 0, f"Shard({p.dim}) of {tuple(t.shape)} does not divide by {n}"
        return [c.contiguous() for c in t.chunk(n, p.dim)]
    if isinstance(p, Partial):
        assert t.is_floating_point(), f"Partial {t.dtype} tensor"
        parts = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for _ in range(n - 1)]
        return parts + [t - sum(parts, torch.zeros_like(t))]
    assert p == R, p
    return [t.clone() for _ in range(n)]


def close(got: Any, want: Any, what: str, values: bool = True) -> None:
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got)}"
    same = got.shape == want.shape and got.dtype == want.dtype
    assert same, f"{what}: {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"
    if not values:
        return
    tol = {torch.float64: 1e-9, torch.float32: 1e-5}.get(want.dtype, 0)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True, msg=lambda m: f"{what}: {m}")


def reassemble(full: Any, outs: list[Any], placement: Any, n: int, what: str, values: bool) -> None:
    if isinstance(placement, tuple):
        if not placement:
            assert full is None and all(o is None for o in outs), what
            return
        assert isinstance(full, (tuple, list)) and len(full) == len(placement), what
        for i, p in enumerate(placement):
            reassemble(full[i], [o[i] for o in outs], p, n, f"{what}[{i}]", values)
    elif isinstance(placement, Shard):
        assert full.shape[placement.dim] % n == 0, f"{what}: output Shard({placement.dim}) of {tuple(full.shape)}"
        for r, (got, want) in enumerate(zip(outs, full.chunk(n, placement.dim))):
            close(got, want, f"{what} rank {r}", values)
    elif isinstance(placement, Partial):
        close(sum(outs[1:], outs[0]), full, f"{what} sum over ranks", values)
    else:
        for r, got in enumerate(outs):
            close(got, full, f"{what} rank {r}", values)
            close(got, outs[0], f"{what} rank {r} vs rank 0", values)


def run_strategy(op: Any, args: tuple, kwargs: dict, s: Strategy, n: int, gen: torch.Generator) -> list[Any]:
    """Each rank's result of ``op`` under strategy ``s``."""
    leaves, spec = tree_flatten((args, kwargs))
    at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    assert len(s.inputs) == len(at), f"{len(s.inputs)} placements for {len(at)} tensors"
    per_rank = [list(leaves) for _ in range(n)]
    for i, p in zip(at, s.inputs):
        for r, piece in enumerate(shard(leaves[i], p, n, gen)):
            per_rank[r][i] = piece
    group = SimulatedGroup(n)

    def run(rank: int) -> Any:
        a, k = tree_unflatten(per_rank[rank], spec)
        a, k = local_args(op, a, k, s, n, rank)
        fn = local_op(op, s, n, rank, group.member(rank)) or op
        return fn(*a, **k)

    if local_op(op, s, n, 0, group.member(0)) is None:
        return [run(r) for r in range(n)]
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))


def check_op(op: Any, args: tuple, kwargs: dict, n: int, gen: torch.Generator) -> list[Strategy]:
    full = op(*args, **kwargs)
    found = strategies(op, args, kwargs, n)
    first = found[0]
    assert all(p in (R, None) for p in first.inputs), first
    assert all(p == R for p in (first.output if isinstance(first.output, tuple) else (first.output,))), first
    for s in found:
        outs = run_strategy(op, args, kwargs, s, n, gen)
        reassemble(full, outs, s.output, n, f"{op} {s}", op not in VALUELESS)
    return found


# ---------------------------------------------------------------------------
# Drawing arguments.


class Draw:
    """Hypothesis draws plus a seeded generator for tensor values."""

    def __init__(self, data: st.DataObject, n: int) -> None:
        self.data, self.n = data, n
        self.gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))

    def __call__(self, strategy: st.SearchStrategy) -> Any:
        return self.data.draw(strategy)

    def pick(self, *options: Any) -> Any:
        return self(st.sampled_from(options))

    def size(self) -> int:
        return self.pick(*SIZES)

    def shape(self, lo: int = 1, hi: int = 4) -> list[int]:
        return [self.size() for _ in range(self(st.integers(lo, hi)))]

    def dim(self, ndim: int) -> int:
        return self(st.integers(-ndim, ndim - 1))

    def floats(self, shape: Any, positive: bool = False) -> torch.Tensor:
        t = torch.randn(list(shape), generator=self.gen, dtype=F64)
        return t.abs() + 0.5 if positive else t

    def ints(self, shape: Any, high: int) -> torch.Tensor:
        return torch.randint(0, high, list(shape), generator=self.gen)

    def bools(self, shape: Any) -> torch.Tensor:
        return torch.rand(list(shape), generator=self.gen) < 0.5

    def broadcastable(self, shape: list[int]) -> list[int]:
        """A shape that broadcasts to ``shape``: leading dims dropped, some dims 1."""
        kept = shape[self(st.integers(0, len(shape))):]
        return [1 if self(st.booleans()) else s for s in kept]

    def pair(self, lo: int = 0) -> tuple[list[int], list[int]]:
        """Two shapes that broadcast together, either side broadcasting."""
        shape = self.shape(lo)
        other = self.broadcastable(shape)
        return (shape, other) if self(st.booleans()) else (other, shape)


Case = Callable[[Draw, Any], "tuple[tuple, dict]"]
CASES: dict[Any, Case] = {}


def case(*ops: Any) -> Callable[[Case], Case]:
    def register(fn: Case) -> Case:
        for op in ops:
            assert op not in CASES, op
            CASES[op] = fn
        return fn

    return register


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
    p = d.pick(0.0, 0.3)  # a random mask cannot be compared; p > 0 runs in eval mode
    return (d.floats(d.shape()), p, p == 0.0 and d(st.booleans())), {}


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


@case(aten.flatten.using_ints)
def _flatten(d: Draw, op: Any) -> tuple[tuple, dict]:
    shape = d.shape(1, 4)
    start = d(st.integers(0, len(shape) - 1))
    end = d(st.integers(start, len(shape) - 1))
    return (d.floats(shape), start - len(shape) if d(st.booleans()) else start, end), {}


@case(aten.view.default, aten.reshape.default, aten._unsafe_view.default)
def _view(d: Draw, op: Any) -> tuple[tuple, dict]:
    # build both shapes from groups of factors, so that dims merge and split
    groups = [[d.size() for _ in range(d(st.integers(1, 2)))] for _ in range(d(st.integers(1, 3)))]
    a, b = [], []
    for g in groups:
        merged = 1
        for s in g:
            merged *= s
        a, b = (a + g, b + [merged]) if d(st.booleans()) else (a + [merged], b + g)
    if d(st.booleans()):
        b[d(st.integers(0, len(b) - 1))] = -1
    return (d.floats(a), b), {}


@case(aten.expand.default)
def _expand(d: Draw, op: Any) -> tuple[tuple, dict]:
    out = d.shape()
    shape = d.broadcastable(out)
    size = [s if i < len(out) - len(shape) or shape[i - len(out) + len(shape)] == 1 or d(st.booleans()) else -1
            for i, s in enumerate(out)]
    return (d.floats(shape), size), {}


@case(aten.transpose.int, aten.permute.default, aten.t.default)
def _permute(d: Draw, op: Any) -> tuple[tuple, dict]:
    if op is aten.t.default:
        return (d.floats(d.shape(0, 2)),), {}
    x = d.floats(d.shape())
    if op is aten.transpose.int:
        return (x, d.dim(x.ndim), d.dim(x.ndim)), {}
    return (x, d(st.permutations(range(x.ndim)))), {}


@case(aten.unsqueeze.default)
def _unsqueeze(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape(0))
    return (x, d(st.integers(-x.ndim - 1, x.ndim))), {}


@case(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def _squeeze(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats([d.pick(1, d.n, 2 * d.n, 5) for _ in range(d(st.integers(1, 4)))])
    if op is aten.squeeze.default:
        return (x,), {}
    if op is aten.squeeze.dim:
        return (x, d.dim(x.ndim)), {}
    return (x, sorted(set(d(st.lists(st.integers(0, x.ndim - 1), max_size=x.ndim))))), {}


@case(aten.slice.Tensor)
def _slice(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape())
    dim = d.dim(x.ndim)
    if d(st.booleans()):
        return (x, dim, 0, 2**63 - 1), {}
    size = x.shape[dim]
    return (x, dim, d(st.integers(0, size)), d(st.integers(0, size + 2)), d.pick(1, 2)), {}


@case(aten.narrow.default)
def _narrow(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape())
    dim = d.dim(x.ndim)
    start = d.pick(0, d(st.integers(0, x.shape[dim])))
    return (x, dim, start, d.pick(x.shape[dim] - start, d(st.integers(0, x.shape[dim] - start)))), {}


@case(aten.select.int)
def _select(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape())
    dim = d.dim(x.ndim)
    return (x, dim, d(st.integers(-x.shape[dim], x.shape[dim] - 1))), {}


@case(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)
def _split(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape())
    dim = d.dim(x.ndim)
    size = x.shape[dim]
    if op is aten.unbind.int:
        return (x, dim), {}
    if op is aten.split_with_sizes.default:
        cut = sorted(d(st.lists(st.integers(0, size), max_size=3)))
        return (x, [b - a for a, b in zip([0, *cut], [*cut, size])], dim), {}
    return (x, d(st.integers(1, size + 1)), dim), {}


@case(operator.getitem)
def _getitem(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape())
    items = torch.split(x, d(st.integers(1, x.shape[0])), 0)
    return (items, d(st.integers(0, len(items) - 1))), {}


@case(aten.cat.default, aten.stack.default)
def _concat(d: Draw, op: Any) -> tuple[tuple, dict]:
    shape = d.shape()
    dim = d.dim(len(shape) + (op is aten.stack.default))
    count = d(st.integers(1, 3))
    if op is aten.stack.default:
        return ([d.floats(shape) for _ in range(count)], dim), {}
    shapes = [shape[:dim % len(shape)] + [d.size()] + shape[dim % len(shape) + 1:] for _ in range(count)]
    return ([d.floats(s) for s in shapes], dim), {}


@case(aten.index.Tensor)
def _index(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape(1, 4))
    used = d(st.lists(st.integers(0, x.ndim - 1), min_size=1, max_size=x.ndim, unique=True))
    shape = d.shape(1, 2)
    indices: list[Any] = [None] * (max(used) + 1)
    for i in used:
        indices[i] = d.ints(d.broadcastable(shape), x.shape[i])
    return (x, indices), {}


@case(aten.gather.default)
def _gather(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape())
    dim = d.dim(x.ndim)
    shape = [s if d(st.integers(0, 3)) else d(st.integers(1, s)) for s in x.shape]
    shape[dim] = d.size()
    return (x, dim, d.ints(shape, x.shape[dim])), {}


@case(aten.pad.default)
def _pad(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape(2, 4))
    mode = d.pick("constant", "replicate")
    pairs = d(st.integers(1, min(2, x.ndim - 1))) if mode == "constant" else (1 if x.ndim == 2 else 2)
    pads = [d(st.integers(0, 2)) for _ in range(2 * pairs)]
    value = d.pick(None, 0.0, 1.5) if mode == "constant" else None
    return (x, pads, mode, value), {}


@case(aten.diff.default)
def _diff(d: Draw, op: Any) -> tuple[tuple, dict]:
    shape = d.shape()
    dim = d.dim(len(shape))

    def extra() -> torch.Tensor | None:  # a prepend / append: any length along dim
        if not d(st.booleans()):
            return None
        return d.floats(shape[:dim % len(shape)] + [d.size()] + shape[dim % len(shape) + 1:])

    return (d.floats(shape), 1, dim, extra(), extra()), {}


@case(aten.cumsum.default, aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
def _along(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape())
    extra = (False,) if op in (aten._softmax.default, aten._log_softmax.default) else ()
    return (x, d.dim(x.ndim), *extra), {}


@case(aten.sum.default, aten.mean.default, aten.max.default, aten.min.default)
def _reduce_all(d: Draw, op: Any) -> tuple[tuple, dict]:
    return (d.floats(d.shape(0)),), {}


@case(aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default)
def _reduce_dims(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape())
    dims = d(st.lists(st.integers(-x.ndim, x.ndim - 1), max_size=x.ndim, unique_by=lambda i: i % x.ndim))
    return (x, dims, d(st.booleans())), {}


@case(aten.max.dim, aten.min.dim)
def _reduce_dim(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape())
    return (x, d.dim(x.ndim), d(st.booleans())), {}


@case(aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default)
def _norm(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape())
    normalized = list(x.shape[x.ndim - d(st.integers(1, x.ndim)):])
    weight = d.floats(normalized) if d(st.booleans()) or op is aten.native_layer_norm.default else None
    if op is aten.rms_norm.default:
        return (x, normalized, weight, 1e-6), {}
    bias = d.floats(normalized) if d(st.booleans()) or op is aten.native_layer_norm.default else None
    return (x, normalized, weight, bias, 1e-5), {}


@case(aten.scaled_dot_product_attention.default)
def _sdpa(d: Draw, op: Any) -> tuple[tuple, dict]:
    batch = [d.size() for _ in range(d(st.integers(1, 2)))]  # (B,) or (B, H)
    length, source, e = d.size(), d.size(), d.pick(2, 4)
    gqa = len(batch) == 2 and d(st.booleans())
    kv_batch = batch[:-1] + [d.pick(1, batch[-1])] if gqa and batch[-1] % 2 == 0 else list(batch)
    if gqa and batch[-1] % kv_batch[-1]:
        kv_batch = list(batch)
    q, k, v = d.floats(batch + [length, e]), d.floats(kv_batch + [source, e]), d.floats(kv_batch + [source, e])
    kwargs: dict[str, Any] = {"enable_gqa": gqa} if gqa else {}
    mask = d.pick("none", "bool", "float", "causal")
    if mask == "causal":
        return (q, k, v, None, 0.0, True), kwargs
    if mask != "none":
        shape = d.broadcastable(batch) + [d.pick(1, length), source]
        kwargs["attn_mask"] = d.bools(shape) | (torch.arange(source) == 0) if mask == "bool" else d.floats(shape)
    if d(st.booleans()):
        kwargs["scale"] = 0.3
    return (q, k, v), kwargs


@case(aten.embedding.default)
def _embedding(d: Draw, op: Any) -> tuple[tuple, dict]:
    weight = d.floats([d.size() * d.pick(1, d.n), d.size()])
    ids = d.ints(d.shape(0, 3), weight.shape[0])
    return ((weight, ids, d(st.integers(0, weight.shape[0] - 1))) if d(st.booleans()) else (weight, ids)), {}


@case(aten.cross_entropy_loss.default, aten.nll_loss.default)
def _loss(d: Draw, op: Any) -> tuple[tuple, dict]:
    nll = op is aten.nll_loss.default
    classes = d.size() * d.pick(1, d.n)
    batch = [d.size() * d.pick(1, d.n) for _ in range(d(st.integers(0, 1 if nll else 2)))]  # (), (N,) or (N, d1)
    x = d.floats(batch[:1] + [classes] + batch[1:])
    kwargs: dict[str, Any] = {"reduction": d.pick(0, 1, 2)}
    if not nll and d(st.integers(0, 3)) == 0:
        target = torch.softmax(d.floats(x.shape), 1 if x.ndim > 1 else 0)
    else:
        target = d.ints(batch, classes)
        if target.ndim and d(st.booleans()):
            target = target.masked_fill(d.bools(batch), -100)
    if d(st.booleans()):
        kwargs["weight"] = d.floats([classes], positive=True)
    if not nll and d(st.booleans()):
        kwargs["label_smoothing"] = 0.1
    return (torch.log_softmax(x, 1 if x.ndim > 1 else 0) if nll else x, target), kwargs


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


# ---------------------------------------------------------------------------
# The property test, over every rule.


def test_every_rule_has_a_ground_truth_case() -> None:
    assert set(CASES) == set(RULES), (
        f"rules without a case: {sorted(map(str, set(RULES) - set(CASES)))}; "
        f"cases without a rule: {sorted(map(str, set(CASES) - set(RULES)))}"
    )


@pytest.mark.parametrize("op", sorted(CASES, key=str), ids=str)
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_strategy_is_sound(op: Any, data: st.DataObject) -> None:
    n = data.draw(st.sampled_from([2, 3, 4]), label="n")
    d = Draw(data, n)
    args, kwargs = CASES[op](d, op)
    check_op(op, args, kwargs, n, d.gen)


# ---------------------------------------------------------------------------
# The strategies that matter, pinned down.


def _has(found: list[Strategy], inputs: tuple, output: Any) -> Strategy:
    matches = [s for s in found if s.inputs == inputs and s.output == output]
    assert matches, f"no strategy {inputs} -> {output} among {found}"
    return matches[0]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_linear_column_and_row_parallel() -> None:
    x, w, b = torch.randn(4, 6, 8, dtype=F64), torch.randn(12, 8, dtype=F64), torch.randn(12, dtype=F64)
    found = check_op(aten.linear.default, (x, w, b), {}, 2, _gen())
    assert _has(found, (R, Shard(0), Shard(0)), Shard(2)).note == "column-parallel"
    assert _has(found, (Shard(2), Shard(1), P), P).note == "row-parallel"
    found = check_op(aten.linear.default, (x, w), {}, 4, _gen())
    _has(found, (R, Shard(0)), Shard(2))
    _has(found, (Shard(2), Shard(1)), P)
    _has(found, (Shard(0), R), Shard(0))  # batch


def test_addmm_with_in_out_weight_like_gpt2_conv1d() -> None:
    bias, x, w = torch.randn(12, dtype=F64), torch.randn(6, 8, dtype=F64), torch.randn(8, 12, dtype=F64)
    found = check_op(aten.addmm.default, (bias, x, w), {}, 2, _gen())
    assert _has(found, (Shard(0), R, Shard(1)), Shard(1)).note == "column-parallel"
    assert _has(found, (P, Shard(1), Shard(0)), P).note == "row-parallel"


def test_sdpa_per_head() -> None:
    q, k, v = (torch.randn(2, 4, 6, 8, dtype=F64) for _ in range(3))
    for mask, mask_p in [(torch.randn(2, 1, 6, 6, dtype=F64), R), (torch.randn(2, 4, 6, 6, dtype=F64), Shard(1))]:
        found = check_op(aten.scaled_dot_product_attention.default, (q, k, v, mask), {}, 2, _gen())
        assert _has(found, (Shard(1), Shard(1), Shard(1), mask_p), Shard(1)).note == "heads"
    found = check_op(aten.scaled_dot_product_attention.default, (q, k, v), {"is_causal": True}, 4, _gen())
    _has(found, (Shard(1),) * 3, Shard(1))
    assert not [s for s in found if s.output == Shard(2)]  # causal: query positions stay whole
    kv = torch.randn(2, 2, 6, 8, dtype=F64)  # grouped-query attention: 4 query heads, 2 kv heads
    found = check_op(aten.scaled_dot_product_attention.default, (q, kv, kv), {"enable_gqa": True}, 2, _gen())
    _has(found, (Shard(1),) * 3, Shard(1))


def test_view_keeps_heads_sharded() -> None:
    x = torch.randn(2, 5, 4 * 3, dtype=F64)  # (B, S, H*D) with H=4, D=3
    found = check_op(aten.view.default, (x, [2, 5, 4, 3]), {}, 2, _gen())
    _has(found, (Shard(2),), Shard(2))
    x = torch.randn(2, 5, 3 * 4, dtype=F64)  # H=3 does not divide by 2 although H*D does
    found = check_op(aten.view.default, (x, [2, 5, 3, 4]), {}, 2, _gen())
    assert not [s for s in found if s.inputs == (Shard(2),)]
    found = check_op(aten.view.default, (torch.randn(2, 5, 4, 3, dtype=F64), [2, 5, -1]), {}, 2, _gen())
    _has(found, (Shard(2),), Shard(2))


def test_embedding_vocab_parallel() -> None:
    weight = torch.randn(12, 6, dtype=F64)
    ids = torch.tensor([[0, 5, 11, 6, 2, 8], [3, 3, 9, 1, 10, 4]])
    found = check_op(aten.embedding.default, (weight, ids), {}, 3, _gen())
    s = _has(found, (Shard(0), R), P)
    assert s.note == "vocab-parallel" and local_op(aten.embedding.default, s, 3, 1) is not None
    _has(found, (Shard(1), R), Shard(2))
    _has(found, (R, Shard(1)), Shard(1))


def test_cross_entropy_vocab_parallel() -> None:
    logits = torch.randn(6, 12, dtype=F64)
    target = torch.tensor([0, 11, 5, -100, 7, 4])
    for reduction in (0, 1, 2):
        found = check_op(aten.cross_entropy_loss.default, (logits, target), {"reduction": reduction}, 3, _gen())
        assert _has(found, (Shard(1), R), R).note == "vocab-parallel"
        _has(found, (Shard(0), Shard(0)), Shard(0) if reduction == 0 else P)


def test_partial_propagation() -> None:
    a, b = torch.randn(4, 6, dtype=F64), torch.randn(6, 4, dtype=F64)
    _has(check_op(aten.mm.default, (a, b), {}, 2, _gen()), (P, R), P)
    _has(check_op(aten.mm.default, (a, b), {}, 2, _gen()), (R, P), P)
    found = check_op(aten.add.Tensor, (a, a), {}, 2, _gen())
    _has(found, (P, P), P)
    assert not [s for s in found if s.inputs in ((P, R), (R, P))]
    assert not [s for s in check_op(aten.add.Tensor, (a, 1.0), {}, 2, _gen()) if P in s.inputs]
    _has(check_op(aten.mul.Tensor, (a, a), {}, 2, _gen()), (P, R), P)
    assert not [s for s in check_op(aten.mul.Tensor, (a, a), {}, 2, _gen()) if s.inputs == (P, P)]
    for op, args in [(aten.neg.default, (a,)), (aten.clone.default, (a,)), (aten.view.default, (a, [24])),
                     (aten.reshape.default, (a, [2, 12])), (aten.transpose.int, (a, 0, 1)), (aten.sum.default, (a,))]:
        _has(check_op(op, args, {}, 2, _gen()), (P,), P)
    assert not [s for s in check_op(aten.exp.default, (a,), {}, 2, _gen()) if P in s.inputs]


def test_reductions_over_the_sharded_dim() -> None:
    x = torch.randn(4, 6, dtype=F64)
    _has(check_op(aten.sum.dim_IntList, (x, [1]), {}, 2, _gen()), (Shard(1),), P)
    s = _has(check_op(aten.mean.dim, (x, [1]), {}, 3, _gen()), (Shard(1),), P)
    assert local_op(aten.mean.dim, s, 3, 0) is not None
    assert not [s for s in check_op(aten.amax.default, (x, [1]), {}, 2, _gen()) if s.inputs == (Shard(1),)]


def test_getitem_reads_only_its_element() -> None:
    parts = torch.split(torch.randn(6, 4, dtype=F64), [2, 4])
    found = check_op(operator.getitem, (parts, 1), {}, 2, _gen())
    _has(found, (None, Shard(0)), Shard(0))
    assert found[0].inputs == (None, R)


def test_ops_without_rules_replicate_only() -> None:
    x = torch.randn(4, 4, dtype=F64)
    assert not has_rule(aten.tril.default) and has_rule(aten.linear.default) and has_rule(operator.getitem)
    assert strategies(aten.tril.default, (x,), {}, 2) == [Strategy((R,), R, "replicate")]
    assert strategies(aten.sort.default, (x,), {}, 2)[0].output == (R, R)
    assert strategies(aten.unsafe_split.Tensor, (x, 1), {}, 2)[0].output == (R, R, R, R)


def test_strategies_read_only_shapes() -> None:
    """Rules run on meta tensors too (the graph carries fake ones)."""
    x, w = torch.empty(2, 6, 8, device="meta"), torch.empty(12, 8, device="meta")
    found = strategies(aten.linear.default, (x, w), {}, 2)
    _has(found, (R, Shard(0)), Shard(2))


# ---------------------------------------------------------------------------
# The rules on real captured graphs (slow: exports Hugging Face models).

# ops these models produce that run replicated by design
_REPLICATED_BY_DESIGN = {aten.scalar_tensor.default}


def _tiny_models() -> tuple[dict[str, tuple[torch.nn.Module, dict]], torch.Tensor, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 96, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    common = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64)
    decoder = dict(num_key_value_heads=2, **common)
    return {
        "gpt2": (transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=96, n_embd=32, n_head=4, n_layer=1, n_positions=16)), {"use_cache": False}),
        "llama": (transformers.LlamaForCausalLM(transformers.LlamaConfig(**decoder)), {"use_cache": False}),
        "mistral": (transformers.MistralForCausalLM(transformers.MistralConfig(**decoder)), {"use_cache": False}),
        "qwen2": (transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**decoder)), {"use_cache": False}),
        "bert": (transformers.BertForMaskedLM(transformers.BertConfig(**common)), {}),
        "opt": (transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=96, hidden_size=32, num_attention_heads=4, num_hidden_layers=1, ffn_dim=64,
            word_embed_proj_dim=32)), {"use_cache": False}),
    }, ids, mask


class _WithLoss(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, extra: dict) -> None:
        super().__init__()
        self.model, self.extra = model, extra

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask, labels=ids, **self.extra).loss


@pytest.mark.slow
def test_rules_cover_exported_models() -> None:
    """Every op of the exported train-mode graphs has a rule, and the rules run on the
    graphs' fake tensors; the projections offer column- and row-parallel strategies."""
    models, ids, mask = _tiny_models()
    for name, (model, extra) in models.items():
        graph = torch.export.export(_WithLoss(model.train(), extra), (ids, mask), strict=False).graph
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
            assert has_rule(node.target) or node.target in _REPLICATED_BY_DESIGN, f"{name}: no rule for {node.target}"
            found = strategies(node.target, args, kwargs, 2)
            if node.target in (aten.linear.default, aten.addmm.default):
                notes = {s.note for s in found}
                assert {"column-parallel", "row-parallel"} <= notes, f"{name}: {node.format_node()} {notes}"
