"""The ground-truth harness of the sharding rules (``passes.rules``).

``check_op`` runs every strategy that ``strategies`` returns over a simulated
group of n ranks inside this process: the inputs are sharded as it says
(Shard(d): ``torch.chunk`` along d; Replicate: the full tensor; Partial: random
summands adding up to the full tensor), each rank runs the op (or its
``local_op``) on its shards with ``local_args``, and each rank's result is
compared, in float64, with its part of the op's result on the full tensors (its
chunk for Shard; the whole for Replicate, every rank alike; for Partial the sum
over ranks). ``Draw`` draws shapes and arguments with hypothesis; ``cases``
makes the ``@case(op, ...)`` decorator of a table of cases (``harness.cases``).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.passes.rules import Strategy, local_args, local_op, strategies

aten = torch.ops.aten
R, P = Replicate(), Partial()
F64 = torch.float64
SIZES = [1, 2, 3, 4, 5, 6, 8, 12]
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
        if op in RANDOM:  # (the ranks of an axis are seeded alike)
            torch.manual_seed(0)
        a, k = tree_unflatten(per_rank[rank], spec)
        a, k = local_args(op, a, k, s, n)
        fn = local_op(op, s, n, rank, group.member(rank)) or op
        return fn(*a, **k)

    if local_op(op, s, n, 0, group.member(0)) is None or op in RANDOM:
        return [run(r) for r in range(n)]
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))


RANDOM = {torch.ops.aten.dropout.default}  # ops that draw random numbers: each run starts from one seed


def check_op(op: Any, args: tuple, kwargs: dict, n: int, gen: torch.Generator) -> list[Strategy]:
    if op in RANDOM:
        torch.manual_seed(0)
    full = op(*args, **kwargs)
    found = strategies(op, args, kwargs, n)
    first = found[0]
    assert all(p in (R, None) for p in first.inputs), first
    assert all(p == R for p in (first.output if isinstance(first.output, tuple) else (first.output,))), first
    for s in found:
        outs = run_strategy(op, args, kwargs, s, n, gen)
        reassemble(full, outs, s.output, n, f"{op} {s}", op not in VALUELESS)
    return found


def has(found: list[Strategy], inputs: tuple, output: Any) -> Strategy:
    """The strategy of ``found`` with these input and output placements (it must be there)."""
    matches = [s for s in found if s.inputs == inputs and s.output == output]
    assert matches, f"no strategy {inputs} -> {output} among {found}"
    return matches[0]


def seeded() -> torch.Generator:
    """A generator with a fixed seed, for the pinned tests."""
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


def cases(table: dict[Any, Case]) -> Callable[..., Callable[[Case], Case]]:
    """The decorator ``@case(op, ...)`` that enters a case into ``table`` for each op (once)."""

    def case(*ops: Any) -> Callable[[Case], Case]:
        def register(fn: Case) -> Case:
            for op in ops:
                assert op not in table, op
                table[op] = fn
            return fn

        return register

    return case
