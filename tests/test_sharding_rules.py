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

This file holds that harness, the cases of the matmul, pointwise and creation
ops, and the property tests over every case. The shape ops' cases are in
``test_sharding_rules_shapes.py`` and the nn ops' cases in ``test_sharding_rules_nn.py``,
each with pinned tests of the strategies that matter (those of matmul and pointwise
ops in the nn file); both import the harness from here.
"""

from __future__ import annotations

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

from passes.sharding_rules import RULES, Strategy, local_args, local_op, strategies

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


def _has(found: list[Strategy], inputs: tuple, output: Any) -> Strategy:
    matches = [s for s in found if s.inputs == inputs and s.output == output]
    assert matches, f"no strategy {inputs} -> {output} among {found}"
    return matches[0]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


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


# The shape and nn cases add themselves to CASES on import (of the harness above, which
# exists by now); importing them here makes CASES complete for the tests below.
import test_sharding_rules_nn  # noqa: E402,F401
import test_sharding_rules_shapes  # noqa: E402,F401


# ---------------------------------------------------------------------------
# The property test, over every rule.


def test_every_rule_has_a_ground_truth_case() -> None:
    assert set(CASES) == set(RULES), (
        f"rules without a case: {sorted(map(str, set(RULES) - set(CASES)))}; "
        f"cases without a rule: {sorted(map(str, set(CASES) - set(RULES)))}"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize the property test over CASES at collection, when every case module has
    been imported, even one that pytest imported first (and so imported this file)."""
    if metafunc.definition.name == "test_every_strategy_is_sound":
        metafunc.parametrize("op", sorted(CASES, key=str), ids=str)


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_strategy_is_sound(op: Any, data: st.DataObject) -> None:  # op: see pytest_generate_tests
    n = data.draw(st.sampled_from([2, 3, 4]), label="n")
    d = Draw(data, n)
    args, kwargs = CASES[op](d, op)
    check_op(op, args, kwargs, n, d.gen)
