"""The vocabulary the sharding rules are written in: ``Strategy``, ``Call`` (one
application of an op, its arguments by schema name), placements and notes, the
einsum engine that derives every matmul-like rule, the blocks the other rules
are built from (``mapped``, ``dims_except``, ``local_size``), and ``LocalOp``,
the form of a replacement a rank runs in place of an op.

The tables themselves live in the modules of ``passes.rules`` (one per family
of ops), which ``passes/rules/__init__.py`` assembles into one registry.
"""

from __future__ import annotations

import functools
import string
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, Union

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.fx.experimental.symbolic_shapes import statically_known_true

from autopar.core.collectives import AxisCollectives, axis_index

__all__ = [
    "Strategy", "Collectives", "Call", "LocalOp", "Rule", "LocalArgs", "einsum_strategies",
    "explicit_equation", "broadcast_placement", "divisible", "summable", "shard_choices",
    "norm_dim", "mapped", "dims_except", "first_tensor", "local_size", "divide_at",
]

aten = torch.ops.aten

Op = Union[torch._ops.OpOverload, Callable[..., Any]]
Output = Union[Placement, tuple[Placement, ...]]
Ref = Union[str, tuple[str, int]]  # an argument name, or (list argument name, index)

R = Replicate()
P = Partial()

# Notes. Most are descriptive; the tables of local ops are keyed on (op, note).
REPLICATE = "replicate"
PARTIAL = "partial"  # a Partial input flows through an op linear in it
BATCH = "batch"  # a dim every operand has
SPLIT_ROWS = "split-rows"  # a dim of the output only the first operand has
COLUMN_PARALLEL = "column-parallel"  # a dim of the output only later operands have
ROW_PARALLEL = "row-parallel"  # a contracted dim: the output is Partial
VOCAB_PARALLEL = "vocab-parallel"  # embedding / cross-entropy over a sharded vocabulary
MEAN_OF_SHARDS = "mean-of-shards"  # local mean over a sharded dim, divided by n
BATCH_MEAN = "batch-mean"  # loss mean over a sharded batch: sum / all-reduced count


@dataclass(frozen=True)
class Strategy:
    """One way to run an op on one mesh axis.

    ``inputs``: a placement per tensor argument in pytree-flattened
    ``(args, kwargs)`` order (None: the op does not read that tensor).
    ``output``: a placement, or a tuple of them when the op returns several
    tensors (``()`` when it returns none). ``Shard`` dims are non-negative.
    ``note``: what the strategy is ("column-parallel", "row-parallel", ...);
    the tables of local ops key their replacements on it.
    """

    inputs: tuple[Placement | None, ...]
    output: Output
    note: str = ""


class Collectives(Protocol):
    """What a replacement local op may call on the tp axis (run time binds a process group)."""

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor: ...


def divisible(size: int | torch.SymInt, n: int) -> bool:
    """True when ``size`` is positive and known to divide by ``n``."""
    if isinstance(size, int):
        return size > 0 and size % n == 0
    return statically_known_true(size % n == 0) and statically_known_true(size > 0)


def summable(t: torch.Tensor | torch.dtype) -> bool:
    """Whether a tensor of this dtype may be Partial (a sum of per-rank summands)."""
    dtype = t if isinstance(t, torch.dtype) else t.dtype
    return dtype.is_floating_point or dtype.is_complex


def norm_dim(dim: int, ndim: int) -> int:
    """``dim`` made non-negative for a tensor of ``ndim`` dims (0-dim tensors take 0 and -1)."""
    return dim % max(ndim, 1)


def shard_choices(t: torch.Tensor, n: int) -> list[Placement]:
    """Every placement a tensor of this shape may have: R, Shard(d) for dims dividing by n, P."""
    return [R, *(Shard(d) for d, s in enumerate(t.shape) if divisible(s, n))] + ([P] if summable(t) else [])


class Call:
    """One application of an op, its arguments bound to the names of the op's schema."""

    def __init__(self, op: Op, args: Sequence[Any], kwargs: dict[str, Any], n: int) -> None:
        self.op, self.args, self.kwargs, self.n = op, tuple(args), dict(kwargs), n
        schema = getattr(op, "_schema", None)
        self.params = list(schema.arguments) if schema is not None else []
        names = [p.name for p in self.params] or [f"arg{i}" for i in range(len(self.args))]
        self.positional = names[: len(self.args)]
        self.slots: list[tuple[str, int | None]] = []  # one per tensor leaf, in pytree order
        for name, value in [*zip(self.positional, self.args), *self.kwargs.items()]:
            if isinstance(value, torch.Tensor):
                self.slots.append((name, None))
            elif isinstance(value, (list, tuple)):
                self.slots += [(name, i) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]

    def __getitem__(self, name: str) -> Any:
        if name in self.kwargs:
            return self.kwargs[name]
        if name in self.positional:
            return self.args[self.positional.index(name)]
        for p in self.params:
            if p.name == name:
                return p.default_value if p.has_default_value() else None
        raise KeyError(f"{self.op} has no argument {name!r}")

    def get(self, name: str, default: Any = None) -> Any:
        """The named argument, or ``default`` when the op has no such argument or it is None."""
        try:
            value = self[name]
        except KeyError:
            return default
        return default if value is None else value

    def tensor(self, ref: Ref) -> torch.Tensor:
        return self[ref] if isinstance(ref, str) else self[ref[0]][ref[1]]

    def tensors(self) -> list[torch.Tensor]:
        return [self.tensor(name if i is None else (name, i)) for name, i in self.slots]

    def strategy(self, output: Output, note: str = "", /, **placements: Any) -> Strategy:
        """A strategy from placements by argument name; a list argument takes a list
        indexed like the argument, or one placement for all its tensors. Unnamed tensors
        are Replicate."""
        inputs = []
        for name, i in self.slots:
            p = placements.get(name, R)
            inputs.append(p[i] if i is not None and isinstance(p, (list, tuple)) else p)
        return Strategy(tuple(inputs), output, note)

    def by_slot(self, inputs: Sequence[Placement | None], output: Output, note: str = "") -> Strategy:
        """A strategy from one placement per tensor slot."""
        return Strategy(tuple(inputs), output, note)

    def replace(self, **values: Any) -> tuple[tuple, dict]:
        """(args, kwargs) with the named arguments replaced, positional ones in place."""
        args, kwargs = list(self.args), dict(self.kwargs)
        for name, value in values.items():
            if name in self.positional:
                args[self.positional.index(name)] = value
            else:
                kwargs[name] = value
        return tuple(args), kwargs

    def run(self, **values: Any) -> Any:
        """The op applied to its arguments, the named ones replaced."""
        args, kwargs = self.replace(**values)
        return self.op(*args, **kwargs)


Rule = Callable[[Call], "list[Strategy] | None"]
LocalArgs = Callable[[Call, Strategy], "tuple[tuple, dict]"]


# ---------------------------------------------------------------------------
# The einsum engine: one function derives the strategies of every matmul-like op.


def einsum_strategies(
    call: Call, equation: str, operands: Sequence[Ref], bias: Ref | None = None
) -> list[Strategy]:
    """Strategies of ``bias + einsum(equation, *operands)``.

    ``equation`` is explicit ("mk,kn->mn"), one letter per dim, no ellipsis.
    An operand whose dim has size 1 where the letter is larger broadcasts: it
    is Replicate when that letter is sharded. ``bias`` (addmm's ``self``)
    broadcasts against the output from the right. For each letter whose size
    divides by n:
    - in the output: operands holding it are sharded on it, the others
      replicated; the output is sharded on it (batch / column-parallel);
    - contracted: operands holding it are sharded on it, the output and the
      bias are Partial (row-parallel).
    Then Partial propagation: one operand Partial, the others Replicate, the
    bias Partial -> Partial output.
    """
    lhs, out = equation.split("->")
    letters = lhs.split(",")
    tensors = [call.tensor(r) for r in operands]
    if len(letters) != len(tensors) or any(len(ls) != t.ndim for ls, t in zip(letters, tensors)):
        return []
    size: dict[str, Any] = {}
    for ls, t in zip(letters, tensors):
        for letter, s in zip(ls, t.shape):
            if size.get(letter, 1) == 1:
                size[letter] = s
    bias_t = None if bias is None else call.tensor(bias)
    partial_ok = all(summable(t) for t in tensors) and (bias_t is None or summable(bias_t))

    def make(placements: list[Placement], bias_p: Placement, output: Placement, note: str) -> Strategy:
        by_ref: dict[Ref, Placement] = dict(zip(operands, placements))
        if bias is not None:
            by_ref[bias] = bias_p
        return call.by_slot([by_ref.get(name if i is None else (name, i), R) for name, i in call.slots], output, note)

    found = []
    for letter in dict.fromkeys("".join(letters)):
        if not divisible(size[letter], call.n):
            continue
        holds = [letter in ls and t.shape[ls.index(letter)] == size[letter] for ls, t in zip(letters, tensors)]
        placements = [Shard(ls.index(letter)) if h else R for ls, h in zip(letters, holds)]
        if letter in out:
            o = out.index(letter)
            note = BATCH if all(holds) else SPLIT_ROWS if holds[0] else COLUMN_PARALLEL
            found.append(make(placements, broadcast_placement(bias_t, o, len(out), size[letter]), Shard(o), note))
        elif partial_ok:
            found.append(make(placements, P, P, ROW_PARALLEL))
    if partial_ok:
        for i in range(len(tensors)):
            found.append(make([P if j == i else R for j in range(len(tensors))], P, P, PARTIAL))
    return found


def broadcast_placement(t: torch.Tensor | None, out_dim: int, out_ndim: int, size: Any) -> Placement:
    """The placement of a tensor broadcast (from the right) against an output of ``out_ndim``
    dims sharded on ``out_dim`` of size ``size``: sharded on its matching dim when it has it at
    full size, Replicate when it has it at size 1 or not at all."""
    if t is None:
        return R
    d = out_dim - (out_ndim - t.ndim)
    return Shard(d) if d >= 0 and t.shape[d] == size else R


def explicit_equation(equation: str, ndims: Sequence[int]) -> str | None:
    """An einsum equation with its ellipses spelled out as letters and its output
    made explicit; None when an operand repeats a letter (a diagonal)."""
    equation = equation.replace(" ", "")
    lhs, arrow, out = equation.partition("->")
    operands = lhs.split(",")
    if len(operands) != len(ndims):
        return None
    used = set(equation) - set(".,->")
    spare = [c for c in string.ascii_letters if c not in used]
    n_ell = max((nd - len(op.replace("...", "")) for op, nd in zip(operands, ndims) if "..." in op), default=0)
    ell = "".join(spare[:n_ell])
    expanded = []
    for op, nd in zip(operands, ndims):
        if "..." in op:
            k = nd - len(op.replace("...", ""))
            op = op.replace("...", ell[len(ell) - k :] if k else "")
        if len(set(op)) != len(op) or len(op) != nd:
            return None
        expanded.append(op)
    if not arrow:
        once = sorted(c for c in set("".join(expanded)) - set(ell) if "".join(expanded).count(c) == 1)
        out = ell + "".join(once)
    else:
        out = out.replace("...", ell)
    return ",".join(expanded) + "->" + out



# ---------------------------------------------------------------------------
# Blocks the rules of several tables are built from.


def mapped(call: Call, dims: dict[int, int], *, linear: bool, outputs: int | None = None) -> list[Strategy]:
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


def dims_except(ndim: int, *skip: int) -> dict[int, int]:
    """The identity dim map without the dims in ``skip``."""
    return {d: d for d in range(ndim) if d not in skip}


def first_tensor(call: Call) -> torch.Tensor:
    return call.tensor(call.slots[0][0])


def local_size(call: Call, strategy: Strategy) -> tuple[tuple, dict]:
    """Size-taking ops (view, expand, new_*, factories): the sharded output dim's size / n."""
    name = "shape" if call.op is aten.reshape.default else "size"
    if not isinstance(strategy.output, Shard):
        return call.args, call.kwargs
    return call.replace(**{name: divide_at(call[name], strategy.output.dim, call.n)})


def divide_at(size: Any, dim: int, n: int) -> list:
    """``size`` with entry ``dim`` divided by ``n`` (-1, "infer", left as it is)."""
    size = list(size)
    if size[dim] != -1:
        size[dim] = size[dim] // n
    return size


# ---------------------------------------------------------------------------
# Local replacements.


class LocalOp:
    """What a rank runs in place of an op, for a strategy the op cannot compute on shards by
    itself (vocab-parallel cross-entropy, a mean over a sharded dim, ...). Written as a
    module-level ``@LocalOp def name(call, rank, collectives)``, ``call`` binding the op's
    local arguments.

    The lowering resolves the replacement and puts the ``LocalOp`` itself into the graph,
    called as ``name(op, axis, n, *args, **kwargs)``: the lowered graph is one graph for all
    ranks of the axis, so the rank's index on ``axis`` and the axis's collectives are read
    from the runtime's binding when it runs. ``bind`` gives the callable of one rank, for
    collectives of one's own (tests). A ``LocalOp`` pickles by reference, like a function.
    """

    def __init__(self, fn: Callable[[Call, int, "Collectives | None"], Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def bind(self, op: Op, n: int, rank: int, collectives: Collectives | None) -> Callable[..., Any]:
        """The callable rank ``rank`` (of ``n``) runs instead of ``op``."""
        return lambda *args, **kwargs: self.fn(Call(op, args, kwargs, n), rank, collectives)

    def __call__(self, op: Op, axis: str, n: int, *args: Any, **kwargs: Any) -> Any:
        return self.fn(Call(op, args, kwargs, n), axis_index(axis), AxisCollectives(axis))

    def __reduce__(self) -> str:
        return self.__qualname__

    def __repr__(self) -> str:
        return f"<local op {self.__module__}.{self.__qualname__}>"
