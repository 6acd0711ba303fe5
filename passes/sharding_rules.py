"""Per-ATen-op sharding rules for one mesh axis (the tensor-parallel axis).

``strategies(op, args, kwargs, n)`` lists the ways one op can run when its
tensors are laid out over an axis of ``n`` ranks: each ``Strategy`` names a
placement (``Shard(dim)``, ``Replicate()``, ``Partial()``) for every tensor
input and for every output. ``local_args`` rewrites the shape-like arguments a
rank passes to the op (view sizes, creation sizes, arange bounds), and
``local_op`` supplies a replacement callable for the few strategies the op
cannot compute on shards by itself (vocab-parallel embedding and
cross-entropy, a mean over a sharded dim, ...).

Invariant: every strategy returned is sound. Sharding the inputs as it says,
running the op locally on each rank (``(local_op(...) or op)(*local_args(...))``)
and reassembling the per-rank results as the output placement says gives the
op's result on the full tensors. ``tests/test_sharding_rules.py`` checks this
against real tensors for every entry of ``RULES``.

Conventions:
- ``Shard(d)`` always carries a non-negative dim, and a sharded dim is split
  into ``n`` equal contiguous chunks (rank r holds chunk r): only dims whose
  size divides by ``n`` are ever sharded; uneven shards are the solver's job.
- ``Partial()`` means "each rank holds a summand; the full value is the sum
  over ranks". Only floating-point (or complex) tensors are ever Partial.
- ``Strategy.inputs`` has one entry per tensor in the pytree-flattened
  ``(args, kwargs)``. The entry is ``None`` only for a tensor the op never
  reads: the tuple elements that ``operator.getitem`` does not select.
- The first strategy is always the all-Replicate one; an op without a rule
  gets only that one, never a guess.
- Random ops (dropout, attention with dropout_p > 0) are sound on the
  condition that the lowering has each rank draw its part of one random mask
  (all of the same mask when replicated); the rules cover only their shapes.

The matmul family lives here, written as einsum strings and derived by one
function (``einsum_strategies``); pointwise and creation rules live in
``passes/sharding_rules_ops.py``, shape rules (views, slicing, concatenation,
indexing) in ``passes/sharding_rules_shape.py``, reduction, normalization,
attention, embedding and loss rules in ``passes/sharding_rules_nn.py``; each
adds its entries to the same tables.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, Union

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.fx.experimental.symbolic_shapes import statically_known_true

__all__ = [
    "Strategy", "Collectives", "Call", "RULES", "LOCAL_ARGS", "LOCAL_OPS",
    "strategies", "local_args", "local_op", "has_rule", "einsum_strategies",
    "explicit_equation", "broadcast_placement", "divisible", "summable", "shard_choices",
]

aten = torch.ops.aten

Op = Union[torch._ops.OpOverload, Callable[..., Any]]
Output = Union[Placement, tuple[Placement, ...]]
Ref = Union[str, tuple[str, int]]  # an argument name, or (list argument name, index)

R = Replicate()
P = Partial()

# Notes. Most are descriptive; LOCAL_OPS is keyed on (op, note).
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
    ``local_op`` keys its replacements on it.
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


Rule = Callable[[Call], "list[Strategy] | None"]
LocalArgs = Callable[[Call, Strategy, int], "tuple[tuple, dict]"]
LocalOpFactory = Callable[[Op, int, int, "Collectives | None"], Callable[..., Any]]


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


def _letters(k: int) -> str:
    """``k`` letters for batch dims, distinct from the lowercase ones the equations use."""
    return string.ascii_uppercase[:k]


def _mm(call: Call) -> list[Strategy]:
    return einsum_strategies(call, "mk,kn->mn", ["self", "mat2"])


def _bmm(call: Call) -> list[Strategy]:
    return einsum_strategies(call, "bmk,bkn->bmn", ["self", "mat2"])


def _addmm(call: Call) -> list[Strategy]:
    return einsum_strategies(call, "mk,kn->mn", ["mat1", "mat2"], bias="self")


def _baddbmm(call: Call) -> list[Strategy]:
    return einsum_strategies(call, "bmk,bkn->bmn", ["batch1", "batch2"], bias="self")


def _linear(call: Call) -> list[Strategy] | None:
    x, w = call["input"], call["weight"]
    if x.ndim == 0 or w.ndim not in (1, 2):
        return None
    batch = _letters(x.ndim - 1)
    equation = f"{batch}k,nk->{batch}n" if w.ndim == 2 else f"{batch}k,k->{batch}"
    return einsum_strategies(call, equation, ["input", "weight"], None if call["bias"] is None else "bias")


def _matmul(call: Call) -> list[Strategy] | None:
    a, b = call["self"], call["other"]
    if a.ndim == 0 or b.ndim == 0:
        return None
    batch_a, batch_b = max(a.ndim - 2, 0), max(b.ndim - 2, 0)
    batch = _letters(max(batch_a, batch_b))
    la = batch[len(batch) - batch_a :] + ("mk" if a.ndim >= 2 else "k")
    lb = batch[len(batch) - batch_b :] + ("kn" if b.ndim >= 2 else "k")
    out = batch + ("m" if a.ndim >= 2 else "") + ("n" if b.ndim >= 2 else "")
    return einsum_strategies(call, f"{la},{lb}->{out}", ["self", "other"])


def _einsum(call: Call) -> list[Strategy] | None:
    tensors = call["tensors"]
    equation = explicit_equation(call["equation"], [t.ndim for t in tensors])
    if equation is None:
        return None
    return einsum_strategies(call, equation, [("tensors", i) for i in range(len(tensors))])


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


RULES: dict[Op, Rule] = {
    aten.mm.default: _mm,  # "mk,kn->mn"
    aten.bmm.default: _bmm,  # "bmk,bkn->bmn"
    aten.addmm.default: _addmm,  # bias + "mk,kn->mn" (GPT-2 Conv1D: weight is (in, out))
    aten.baddbmm.default: _baddbmm,  # bias + "bmk,bkn->bmn"
    aten.linear.default: _linear,  # "...k,nk->...n" + bias "n" (weight is (out, in))
    aten.matmul.default: _matmul,  # "...mk,...kn->...mn", batch dims broadcast, 1-D operands squeezed
    aten.einsum.default: _einsum,  # the equation itself, ellipses spelled out
}

# op -> function(call, strategy, rank) returning the local (args, kwargs); ops absent here
# run with their arguments unchanged.
LOCAL_ARGS: dict[Op, LocalArgs] = {}

# (op, note) -> factory(op, n, rank, collectives) returning the callable a rank runs in
# place of the op, for strategies the op cannot compute on shards by itself.
LOCAL_OPS: dict[tuple[Op, str], LocalOpFactory] = {}


# ---------------------------------------------------------------------------
# The public entry points.


def has_rule(op: Op) -> bool:
    """Whether ``op`` has a sharding rule (otherwise it only runs replicated)."""
    return op in RULES


def strategies(op: Op, args: Sequence[Any], kwargs: dict[str, Any], n: int) -> list[Strategy]:
    """Every valid strategy for ``op`` applied to ``(args, kwargs)`` on an axis of ``n``
    ranks, the all-Replicate one first. Tensors in ``args`` / ``kwargs`` may be real,
    fake or meta: only their shapes and dtypes are read."""
    call = Call(op, args, kwargs, n)
    rule = RULES.get(op)
    found = (rule(call) or []) if rule is not None else []
    replicated = [s for s in found if _is_replicate(s)]
    if replicated:
        first = Strategy(replicated[0].inputs, replicated[0].output, REPLICATE)
    else:
        output = _replicate_like(found[0].output) if found else _replicated_output(call)
        first = call.strategy(output, REPLICATE)
    unique: dict[tuple, Strategy] = {}
    for s in [first, *found]:
        if len(s.inputs) != len(call.slots):
            raise AssertionError(f"rule for {op} gave {len(s.inputs)} input placements for {len(call.slots)} tensors")
        unique.setdefault((s.inputs, s.output), s)
    return list(unique.values())


def local_args(
    op: Op, args: Sequence[Any], kwargs: dict[str, Any], strategy: Strategy, n: int, rank: int
) -> tuple[tuple, dict]:
    """The ``(args, kwargs)`` rank ``rank`` calls the op with under ``strategy``: shape-like
    arguments rewritten to local sizes, every tensor passed through as given (so pass the
    local shards, or substitute them afterwards)."""
    rewrite = LOCAL_ARGS.get(op)
    if rewrite is None:
        return tuple(args), dict(kwargs)
    return rewrite(Call(op, args, kwargs, n), strategy, rank)


def local_op(
    op: Op, strategy: Strategy, n: int, rank: int, collectives: Collectives | None = None
) -> Callable[..., Any] | None:
    """The callable rank ``rank`` runs instead of ``op`` under ``strategy``, called with
    ``local_args``; None when the op itself runs on the shards. Some replacements
    communicate through ``collectives`` (vocab-parallel cross-entropy, a loss mean over a
    sharded batch) and need it bound to the tp axis."""
    make = LOCAL_OPS.get((op, strategy.note))
    return None if make is None else make(op, n, rank, collectives)


def _is_replicate(s: Strategy) -> bool:
    outputs = s.output if isinstance(s.output, tuple) else (s.output,)
    return all(p is None or p == R for p in s.inputs) and all(p == R for p in outputs)


def _replicate_like(output: Output) -> Output:
    return tuple(R for _ in output) if isinstance(output, tuple) else R


def _replicated_output(call: Call) -> Output:
    """All-Replicate output for an op without a (matching) rule, shaped by its schema."""
    schema = getattr(call.op, "_schema", None)
    if schema is None:
        return R
    returns = [r.type for r in schema.returns]
    if len(returns) == 1 and isinstance(returns[0], torch.TensorType):
        return R
    outputs: list[Placement] = []
    for t in returns:
        if isinstance(t, torch.TensorType):
            outputs.append(R)
        elif isinstance(t, torch.ListType) and isinstance(t.getElementType(), torch.TensorType):
            outputs += [R] * len(_run_on_meta(call))
    return tuple(outputs)


def _run_on_meta(call: Call) -> Any:
    """The op run on meta copies of its tensors (to count a tensor-list result)."""
    def meta(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.empty(v.shape, dtype=v.dtype, device="meta")
        if isinstance(v, (list, tuple)):
            return type(v)(meta(x) for x in v)
        return v

    return call.op(*meta(call.args), **{k: meta(v) for k, v in call.kwargs.items()})


# The other rules add themselves to RULES / LOCAL_ARGS / LOCAL_OPS on import:
# sharding_rules_ops, which imports sharding_rules_shape and sharding_rules_nn at its
# end (they use its building blocks, so importing them from here would fail when
# sharding_rules_ops is the first module imported).
import passes.sharding_rules_ops  # noqa: E402,F401

