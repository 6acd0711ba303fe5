"""Per-ATen-op sharding rules for one mesh axis (the tensor-parallel axis): one registry.

``strategies(op, args, kwargs, n)`` lists the ways one op can run when its
tensors are laid out over an axis of ``n`` ranks: each ``Strategy`` names a
placement (``Shard(dim)``, ``Replicate()``, ``Partial()``) for every tensor
input and for every output. ``local_args`` rewrites the shape-like arguments a
rank passes to the op (view sizes, creation sizes), and ``replacement`` /
``local_op`` supply what a rank runs instead for the few strategies the op
cannot compute on shards by itself (an arange split into ranges, vocab-parallel
embedding and cross-entropy, a mean over a sharded dim, ...).

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

The tables: the matmul family in ``matmul.py`` (einsum strings), pointwise and
creation ops in ``ops.py``, shape ops (views, slicing, concatenation, indexing)
in ``shape.py``, reductions, normalization, attention, embedding and losses in
``nn.py``; the vocabulary they are written in is ``base.py``. Each module
exports plain dicts (``RULES``, and ``LOCAL_ARGS`` / ``LOCAL_OPS`` where it has
any); they are merged here, once, and an op registered twice is an error. A new
rule goes into the table of its family, with a ground-truth case in
``tests/harness/``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch.distributed.tensor.placement_types import Placement

from autopar.passes.rules import matmul, nn, ops, shape
from autopar.passes.rules.base import REPLICATE, Call, Collectives, LocalArgs, LocalOp, Op, Output, R, Rule, Strategy

__all__ = [
    "Strategy", "Collectives", "LocalOp", "RULES", "LOCAL_ARGS", "LOCAL_OPS", "SUMS_INSIDE",
    "strategies", "local_args", "replacement", "local_op", "has_rule",
]


def _merge(kind: str, *tables: Mapping[Any, Any]) -> dict[Any, Any]:
    """One table from several; a key in two of them is an error."""
    merged: dict[Any, Any] = {}
    for table in tables:
        twice = merged.keys() & table.keys()
        if twice:
            raise AssertionError(f"{kind} registered twice: {sorted(map(str, twice))}")
        merged.update(table)
    return merged


# op -> rule(call) returning the strategies that apply (None or [] when none does)
RULES: dict[Op, Rule] = _merge("sharding rules", matmul.RULES, ops.RULES, shape.RULES, nn.RULES)

# op -> function(call, strategy) returning the local (args, kwargs); ops absent here
# run with their arguments unchanged.
LOCAL_ARGS: dict[Op, LocalArgs] = _merge("local arguments", ops.LOCAL_ARGS, shape.LOCAL_ARGS)

# (op, note) -> the LocalOp a rank runs in place of the op, for strategies the op
# cannot compute on shards by itself.
LOCAL_OPS: dict[tuple[Op, str], LocalOp] = _merge("local ops", ops.LOCAL_OPS, nn.LOCAL_OPS)

# local ops that add values of several ranks inside (the solver weighs their precision)
SUMS_INSIDE = nn.SUMS_INSIDE


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


def local_args(op: Op, args: Sequence[Any], kwargs: dict[str, Any], strategy: Strategy, n: int) -> tuple[tuple, dict]:
    """The ``(args, kwargs)`` every rank calls the op with under ``strategy``: shape-like
    arguments rewritten to local sizes, every tensor passed through as given (so pass the
    local shards, or substitute them afterwards). They never depend on the rank: what does
    is a local op's."""
    rewrite = LOCAL_ARGS.get(op)
    if rewrite is None:
        return tuple(args), dict(kwargs)
    return rewrite(Call(op, args, kwargs, n), strategy)


def replacement(op: Op, strategy: Strategy) -> LocalOp | None:
    """The ``LocalOp`` that runs instead of ``op`` under ``strategy``; None when the op itself
    runs on the shards. The lowering calls it once and puts the result into the graph."""
    return LOCAL_OPS.get((op, strategy.note))


def local_op(
    op: Op, strategy: Strategy, n: int, rank: int, collectives: Collectives | None = None
) -> Callable[..., Any] | None:
    """The callable rank ``rank`` runs instead of ``op`` under ``strategy``, called with
    ``local_args``; None when the op itself runs on the shards. Some replacements
    communicate through ``collectives`` (vocab-parallel cross-entropy, a loss mean over a
    sharded batch)."""
    found = replacement(op, strategy)
    return None if found is None else found.bind(op, n, rank, collectives)


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