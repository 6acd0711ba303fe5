"""What one rank's or one microbatch's share of the batch cannot compute alone, refused by name
(``compiler._capture`` runs ``check_samples_apart`` where dp x cp ranks or microbatches split the batch).

A single device computes on the whole batch; each dp rank, and each microbatch, on its rows of it. An op that
computes along the batch dim (dim 0 of a value whose dim 0 is the inputs' batch) sees that share only: a softmax
or a running sum over the samples, a reduction over them that leaves other dims (``x - x.mean(0)``), a sort or
pick along them, a product summing over them (``x.T @ x``) or relating them to each other (``x @ x.T``,
``cdist``: an in-batch contrastive loss). Refused, naming the node. A reduction over every dim (the loss's sum
or mean, its count) is the runtime's to combine (``passes/global_count.py``); BatchNorm's statistics are each
share's own, as documented (docs/decisions.md). ``check_no_share_statistics`` refuses a statistic of a share's
whole (``x.abs().max()``, ``x.mean()``, ``x.norm()``: one number from all its values) combined with that share's
values again (``x / x.abs().max()``, ``x - x.mean()``, ``w = mask / mask.sum()``), where dp, microbatches or cp
split the batch or the sequence: each share's number is its own, not the whole batch's.

Invariant: a graph that passes computes, on each share of the batch, the rows of the single-device values for
those samples, for the ops checked here; what stays uncaught is named in docs/decisions.md.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.core.errors import UnsupportedError
from autopar.core.graph import SlotKind, origin
from autopar.passes.context_checks import (ALONG_DIM_IS_LOCAL, CONVOLUTIONS, MOVES, PRODUCTS, REDUCTIONS,
                                           SCANS, dims_argument, live_nodes, moved_dims, summed)
from autopar.passes.global_count import LOSSES, PASS_THROUGH

aten = torch.ops.aten
DISTANCES = {aten.cdist.default, aten._cdist_forward.default}  # (x1 (P, D), x2 (R, D)) -> (P, R)
RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
            aten.unflatten.int}  # (the tokens flattened, (B * S, H), and back)


def check_samples_apart(graph: fx.Graph, kinds: dict[fx.Node, SlotKind], batch: int, split: str) -> None:
    """Refuses the first live node of ``graph`` (captured on ``batch`` samples, a share of the batch that
    ``split`` names) that computes along the samples (the module doc)."""
    if batch <= 1:
        return  # one sample: nothing to mix
    live = live_nodes(graph)
    rows, derived = _rows(graph, kinds, batch)
    samples = {n for n in rows if _dim0(n) == batch}
    for node in graph.nodes:
        if node not in live or not isinstance(node.target, torch._ops.OpOverload) or node.target.namespace != "aten":
            continue
        why = _along_samples(node, samples, derived, batch)
        if why:
            raise UnsupportedError(f"{split} splits the batch, and node {node.name} ({node.target}){_at(node)} {why}: "
                                   f"on each share of {batch} samples it sees that share only, where one device "
                                   f"sees the whole batch; compute it per sample, or run without splitting the "
                                   f"batch (dp=1 and microbatches=1)")


def check_no_share_statistics(graph: fx.Graph, kinds: dict[fx.Node, SlotKind], batch: int, split: str) -> None:
    """Refuses the first live node of ``graph`` (captured on one share of the batch, ``batch`` samples, that
    ``split`` names) that combines a statistic of the share's whole with the share's values (the module doc).
    Statistics combined only with each other (the loss's sum over its count) are the runtime's to combine."""
    if batch < 1:
        return  # (no input with a batch dim)
    live = live_nodes(graph)
    rows, _ = _rows(graph, kinds, batch)
    statistic: dict[fx.Node, fx.Node] = {}  # a value computed from a statistic of the share -> that statistic
    for node in graph.nodes:
        if node not in live or node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        held = [statistic[i] for i in inputs if i in statistic]
        values = [i for i in inputs if i in rows and _numel(i) > 1]
        if held and values:
            stat = held[0]
            raise UnsupportedError(
                f"{split}, and node {node.name} ({node.target}){_at(node)} combines {values[0].name} with "
                f"{stat.name} ({stat.target}){_at(stat)}, one number computed from all of {values[0].name}'s "
                f"share: each share computes its own, where one device computes it over the whole batch; "
                f"compute it per sample (x.abs().amax(-1, keepdim=True)), or, for a loss weighted by a count "
                f"(mask / mask.sum()), divide the weighted sum by the count ((loss * mask).sum() / mask.sum(), "
                f"which the shares combine exactly)")
        if held:
            statistic[node] = held[0]
        elif values and _numel(node) == 1 and node not in rows:  # (not one sample's one value)
            statistic[node] = node


def sums_over_samples(graph: fx.Graph, kinds: dict[fx.Node, SlotKind], batch: int) -> list[fx.Node]:
    """The sums over the samples (``x.sum()``, a loss with ``reduction="sum"``) that a scalar output (the loss)
    is an affine function of without a division by a count of the inputs: the runtime averages each share's
    loss, as the contract's mean over the batch is averaged, so such a sum comes out divided by the shares."""
    if batch <= 1:
        return []
    rows, derived = _rows(graph, kinds, batch)
    output = next(n for n in graph.nodes if n.op == "output")
    outputs: list[fx.Node] = []
    fx.node.map_arg(output.args[0], outputs.append)
    stack = [v for v in outputs if isinstance(v.meta.get("val"), torch.Tensor) and v.meta["val"].dim() == 0]
    found, seen = [], set()
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if n.target in (aten.sum.default, aten.sum.dim_IntList) and _in(n.args[0], rows) \
                and _dim0(n.args[0]) == batch:
            found.append(n)
        elif n.target in LOSSES and (n.args[3] if len(n.args) > 3 else n.kwargs.get("reduction", 1)) == 2 \
                and _in(n.args[0], rows):
            found.append(n)
        elif n.target in PASS_THROUGH:
            stack.append(n.args[0])
        elif n.target in (aten.add.Tensor, aten.sub.Tensor):
            stack.extend(n.args[:2])
        elif n.target in (aten.mul.Tensor, aten.div.Tensor) and not _in(n.args[1], derived):
            stack.append(n.args[0])  # (scaled by a number or the model's state; a division by a count stops)
    return found


def _rows(graph: fx.Graph, kinds: dict[fx.Node, SlotKind], batch: int) -> tuple[set[fx.Node], set[fx.Node]]:
    """(the values whose dim 0 runs over the samples, or over the samples' tokens flattened: the inputs with the
    batch at dim 0, then what keeps its input's dim 0 or reshapes it by a multiple of the batch; every value
    computed from the inputs). Sizes that match by chance (as many experts as samples, counted from the tokens)
    are not the samples."""
    rows: set[fx.Node] = set()
    derived: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder":
            if kinds.get(n) is SlotKind.INPUT:
                derived.add(n)
                if _dim0(n) == batch:
                    rows.add(n)
            continue
        inputs = n.all_input_nodes
        if not any(i in derived for i in inputs):
            continue
        derived.add(n)
        if not isinstance(n.meta.get("val"), torch.Tensor):
            if any(i in rows for i in inputs):  # (a tuple: its items are read by getitem)
                rows.add(n)
            continue
        d = _dim0(n)
        kept = any(i in rows and (_dim0(i) == d or not isinstance(i.meta.get("val"), torch.Tensor)) for i in inputs)
        reshaped = n.target in RESHAPES and d and d % batch == 0 and any(i in rows for i in inputs)
        if d and (kept or reshaped):
            rows.add(n)
    return rows, derived


def _numel(n: fx.Node) -> int:
    """The elements of ``n``'s value (of its largest item for a tuple; 0: not a tensor, or known only at run
    time)."""
    val = n.meta.get("val")
    items = val if isinstance(val, (tuple, list)) else [val]
    sizes = [t.numel() for t in items if isinstance(t, torch.Tensor)]
    return max(sizes) if sizes and all(isinstance(s, int) for s in sizes) else 0


def _at(node: fx.Node) -> str:
    return f" ({origin(node)})" if origin(node) else ""


def _dim0(n: object) -> int:
    """Dim 0 of ``n``'s value (0: none, or a size known only at run time)."""
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() == 0 or not isinstance(val.shape[0], int):
        return 0
    return val.shape[0]


def _along_samples(node: fx.Node, samples: set[fx.Node], derived: set[fx.Node], batch: int) -> str:
    """How ``node`` computes along the samples ("" when it does not)."""
    if node.target in PRODUCTS or node.target is aten.einsum.default:
        if any(_in(f, samples) and d == 0 for f, d in summed(node)):
            return "sums over the samples (a product contracting the batch dim, such as x.T @ x)"
        a, b = _factors(node)
        if _in(a, samples) and a.meta["val"].dim() == 2 and _in(b, derived) and b.meta["val"].dim() == 2 \
                and b.meta["val"].shape[1] == batch:
            return "relates the samples to each other (a product such as x @ x.T, an in-batch similarity)"
        return ""
    if node.target in DISTANCES:
        if all(_in(x, samples) and x.meta["val"].dim() == 2 for x in node.args[:2]):
            return "relates the samples to each other (pairwise distances over the batch)"
        return ""
    x = node.args[0] if node.args else None
    if not _in(x, samples) or node.target in ALONG_DIM_IS_LOCAL - {aten.select.int} | CONVOLUTIONS:
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
        return (list(node.args[1]) + [None, None])[:2]
    at = PRODUCTS[node.target]
    return node.args[at], node.args[at + 1]


def _in(x: object, values: set[fx.Node]) -> bool:
    return isinstance(x, fx.Node) and x in values
