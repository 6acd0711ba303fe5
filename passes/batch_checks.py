"""What one rank's or one microbatch's share of the batch cannot compute alone, refused by name
(``compiler._capture`` runs ``check_samples_apart`` where dp x cp ranks or microbatches split the batch).

A single device computes on the whole batch; each dp rank, and each microbatch, on its rows of it. An op that
computes along the batch dim (dim 0 of a value whose dim 0 is the inputs' batch) sees that share only: a softmax
or a running sum over the samples, a reduction over them that leaves other dims (``x - x.mean(0)``), a sort or
pick along them, a product summing over them (``x.T @ x``) or relating them to each other (``x @ x.T``,
``cdist``: an in-batch contrastive loss). Refused, naming the node. A reduction over every dim (the loss's sum
or mean, its count) is the runtime's to combine (``passes/global_count.py``); BatchNorm's statistics are each
share's own, as documented (docs/decisions.md).

Invariant: a graph that passes computes, on each share of the batch, the rows of the single-device values for
those samples, for the ops checked here; what stays uncaught is named in docs/decisions.md.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.core.errors import UnsupportedError
from autopar.core.graph import SlotKind, origin
from autopar.passes.context_checks import (ALONG_DIM_IS_LOCAL, CONVOLUTIONS, MOVES, PRODUCTS, REDUCTIONS,
                                           SCANS, dims_argument, live_nodes, model_state, moved_dims, summed)

aten = torch.ops.aten
DISTANCES = {aten.cdist.default, aten._cdist_forward.default}  # (x1 (P, D), x2 (R, D)) -> (P, R)
VIEWS = {aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default, aten.reshape.default,
         aten._unsafe_view.default, aten.detach.default, aten.alias.default, aten.expand.default,
         aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.contiguous.default}


def check_samples_apart(graph: fx.Graph, kinds: dict[fx.Node, SlotKind], batch: int, split: str) -> None:
    """Refuses the first live node of ``graph`` (captured on ``batch`` samples, a share of the batch that
    ``split`` names) that computes along the samples (the module doc)."""
    if batch <= 1:
        return  # one sample: nothing to mix
    live = live_nodes(graph)
    for node in graph.nodes:
        if node not in live or not isinstance(node.target, torch._ops.OpOverload) or node.target.namespace != "aten":
            continue
        why = _along_samples(node, kinds, batch)
        if why:
            where = f" ({origin(node)})" if origin(node) else ""
            raise UnsupportedError(f"{split} splits the batch, and node {node.name} ({node.target}){where} {why}: "
                                   f"on each share of {batch} samples it sees that share only, where one device "
                                   f"sees the whole batch; compute it per sample, or run without splitting the "
                                   f"batch (dp=1 and microbatches=1)")


def _along_samples(node: fx.Node, kinds: dict[fx.Node, SlotKind], batch: int) -> str:
    """How ``node`` computes along the samples ("" when it does not)."""
    if node.target in PRODUCTS or node.target is aten.einsum.default:
        if any(_samples(f, kinds, batch) and d == 0 for f, d in summed(node)):
            return "sums over the samples (a product contracting the batch dim, such as x.T @ x)"
        a, b = _factors(node)
        if _samples(a, kinds, batch) and a.meta["val"].dim() == 2 and _columns_are_samples(b, kinds, batch):
            return "relates the samples to each other (a product such as x @ x.T, an in-batch similarity)"
        return ""
    if node.target in DISTANCES:
        x1, x2 = node.args[:2]
        if all(_samples(x, kinds, batch) and x.meta["val"].dim() == 2 for x in (x1, x2)):
            return "relates the samples to each other (pairwise distances over the batch)"
        return ""
    x = node.args[0] if node.args else None
    if not _samples(x, kinds, batch) or node.target in ALONG_DIM_IS_LOCAL - {aten.select.int} | CONVOLUTIONS:
        return ""
    rank = x.meta["val"].dim()
    if node.target in MOVES:
        return "moves or orders values along the samples" if 0 in moved_dims(node, tuple(x.meta["val"].shape),
                                                                              -1) else ""
    if node.target is aten.select.int:
        return "takes one sample" if node.args[1] % rank == 0 else ""
    dims = dims_argument(node, rank)
    if node.target in REDUCTIONS:
        dims = dims or list(range(rank))  # (no dims: all of them)
        return "" if set(dims) == set(range(rank)) or 0 not in dims else \
            "reduces over the samples but not over every dim"
    if 0 in dims:
        kind = "accumulates" if node.target in SCANS else "computes"
        return f"{kind} along the samples (dim 0)"
    return ""


def _factors(node: fx.Node) -> tuple[object, object]:
    if node.target is aten.einsum.default:
        return (node.args[1] + [None, None])[:2]
    at = PRODUCTS[node.target]
    return node.args[at], node.args[at + 1]


def _samples(x: object, kinds: dict[fx.Node, SlotKind], batch: int) -> bool:
    """Whether ``x`` is a value whose dim 0 holds the samples (dim 0 the batch, not the model's state)."""
    return isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor) and x.meta["val"].dim() >= 1 \
        and x.meta["val"].shape[0] == batch and not _from_state(x, kinds)


def _columns_are_samples(b: object, kinds: dict[fx.Node, SlotKind], batch: int) -> bool:
    """Whether a product's second factor (D, R) has the samples as its columns: the batch's values transposed."""
    return isinstance(b, fx.Node) and isinstance(b.meta.get("val"), torch.Tensor) and b.meta["val"].dim() == 2 \
        and b.meta["val"].shape[1] == batch and not _from_state(b, kinds)


def _from_state(x: fx.Node, kinds: dict[fx.Node, SlotKind]) -> bool:
    """Whether ``x`` is the model's state (a parameter, buffer or constant), or a view or copy of it."""
    while x.op == "call_function" and x.target in VIEWS and isinstance(x.args[0], fx.Node):
        x = x.args[0]
    return model_state(x, kinds)
