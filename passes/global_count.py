"""Losses normalized by a count of their inputs are divided by the whole batch's count instead.

autopar averages the scalar outputs of a graph (the loss) over microbatches and
data-parallel ranks with equal weight. That equals the whole batch's value when
each part's value is a mean over the same number of items, not when the
number depends on the data: a cross-entropy with ``ignore_index`` (padding, a
prompt left out of supervised fine-tuning, Hugging Face's ``labels=`` loss) or
a masked mean ``(x * mask).sum() / mask.sum()``. ``normalize_by_global_count``
finds each such term on the linear path to a scalar output and rewrites it:

- ``cross_entropy_loss`` / ``nll_loss`` with ``reduction="mean"`` and class
  targets becomes the same op with ``reduction="sum"``, divided by a new graph
  input ``c``; its count is the number of targets that are not ``ignore_index``;
- ``div(num, count)``, where ``count`` is a sum over the user inputs alone (no
  parameter or buffer), divides ``num`` by ``c`` instead; its count is that sum.

The counts are kept as a graph of the user inputs (``LossCounts``); the runtime
feeds ``c`` = the count summed over all parts / the number of parts, so the
average of the parts is ``num / count`` over the whole batch.
Terms that are not reached through affine ops (sums, differences, scaling by
constants, casts) cannot be rewritten so; a warning names them.

Invariant: the rewritten graph, fed ``c`` = the count of its own inputs,
computes what the captured graph computes (``Captured.run`` feeds exactly that).
"""
from __future__ import annotations

import warnings

import torch
import torch.fx as fx

from autopar.core.graph import Captured, Slot, SlotKind, origin
from autopar.core.loss_count import LossCounts
from autopar.passes.lazy_module import graph_module

aten = torch.ops.aten
LOSSES = (aten.cross_entropy_loss.default, aten.nll_loss.default)
MEAN, SUM = 1, 2
# ops through which a scalar output is an affine function of its first argument
PASS_THROUGH = {aten.neg.default, aten.alias.default, aten.clone.default, aten._to_copy.default, aten.to.dtype,
                aten.to.dtype_layout, aten.view.default, aten.reshape.default, aten.squeeze.default,
                aten.mul.Scalar, aten.div.Scalar, aten.add.Scalar, aten.sub.Scalar, aten.detach.default}
SUMS = {aten.sum.default, aten.sum.dim_IntList, aten.count_nonzero.default, aten.count_nonzero.dim_IntList}


def normalize_by_global_count(captured: Captured) -> LossCounts | None:
    """Rewrites ``captured`` in place (see the module doc); the counts' graph, or None when nothing is counted."""
    graph = captured.gm.graph
    kinds = dict(zip([n for n in graph.nodes if n.op == "placeholder"], [s.kind for s in captured.slots]))
    output = next(n for n in graph.nodes if n.op == "output")
    averaged = [v for v in list(output.args[0])[len(captured.mutated_buffers):] if _is_scalar(v)]
    terms = [t for v in averaged for t in _terms(v, kinds)]
    terms = list(dict.fromkeys(terms))
    for node in graph.nodes:
        if node not in terms and (_counted_mean(node, kinds) is not None or _weighted_mean(node)):
            why = ("has class weights" if _weighted_mean(node)
                   else "is not an affine part of a scalar output (the loss)")
            warnings.warn(f"the loss term {node.name} ({node.target}) is a mean over a count of the inputs that "
                          f"{why}: each microbatch and data-parallel rank weighs equally in it, whatever its count, "
                          f"so it differs from the whole batch's mean when the parts count differently{_where(node)}",
                          stacklevel=3)
    if not terms:
        return None
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    counts = fx.Graph()
    env = {ph: counts.placeholder(ph.name) for ph, kind in kinds.items() if kind is SlotKind.INPUT}
    results, dtypes = [], []
    for i, term in enumerate(terms):
        dtype = term.meta["val"].dtype
        with graph.inserting_after(last):
            c = last = graph.placeholder(f"loss_count_{i}")
        c.meta["val"] = term.meta["val"].new_empty(())
        results.append(_rewrite(graph, term, c, counts, env))
        dtypes.append(dtype)
        captured.slots.append(Slot(SlotKind.INPUT, c.name, index=sum(s.kind is SlotKind.INPUT for s in captured.slots)))
        captured.input_dtypes.append(dtype)
    counts.output(tuple(results))
    graph.lint()
    captured.gm.recompile()
    return LossCounts(graph_module(captured.gm, counts), dtypes, [t.name for t in terms])


def _rewrite(graph: fx.Graph, term: fx.Node, c: fx.Node, counts: fx.Graph, env: dict) -> fx.Node:
    """Divides ``term``'s numerator by ``c``; returns the node of ``counts`` that computes its count."""
    if term.target in LOSSES:
        target, ignore = _arg(term, "target"), _arg(term, "ignore_index")
        args = [_arg(term, a.name) for a in term.target._schema.arguments]
        args[3] = SUM
        term.args, term.kwargs = tuple(args), {}
        with graph.inserting_after(term):
            mean = graph.call_function(aten.div.Tensor, (term, c))
        mean.meta = {**term.meta, "val": term.meta["val"]}
        term.replace_all_uses_with(mean, delete_user_cb=lambda user: user is not mean)
        counted = counts.call_function(aten.ne.Scalar, (_copy(target, counts, env), ignore))
        found = counts.call_function(aten.sum.default, (counted,))
    else:
        found = _copy(term.args[1], counts, env)
        term.args = (term.args[0], c)
    return counts.call_function(aten._to_copy.default, (found,), {"dtype": torch.float64})


def _terms(value: fx.Node, kinds: dict) -> list[fx.Node]:
    """The count-normalized terms an averaged scalar ``value`` is an affine function of."""
    found, stack, seen = [], [value], set()
    while stack:
        node = stack.pop()
        if not isinstance(node, fx.Node) or node in seen or node.op != "call_function":
            continue
        seen.add(node)
        if _counted_mean(node, kinds) is not None:
            found.append(node)
        elif node.target in PASS_THROUGH:
            stack.append(node.args[0])
        elif node.target in (aten.add.Tensor, aten.sub.Tensor):
            stack.extend(node.args[:2])
        elif node.target in (aten.mul.Tensor, aten.div.Tensor):
            a, b = node.args[:2]
            if not _depends_on_inputs_or_state(b, kinds):
                stack.append(a)
            elif node.target is aten.mul.Tensor and not _depends_on_inputs_or_state(a, kinds):
                stack.append(b)
    return found


def _counted_mean(node: fx.Node, kinds: dict) -> str | None:
    """"loss" or "div" when ``node`` is a mean over a count of the inputs that this pass can rewrite, else None."""
    if node.op != "call_function":
        return None
    if node.target in LOSSES:
        target = _arg(node, "target")
        mean = _class_mean(node) and _arg(node, "weight") is None
        return "loss" if mean and _only_inputs(target, kinds) else None
    denominator = node.args[1] if node.target is aten.div.Tensor else None
    if isinstance(denominator, fx.Node) and _zero_dim(denominator) and _is_count(denominator, kinds):
        return "div"
    return None


def _class_mean(node: fx.Node) -> bool:
    """A mean-reduced loss over class targets (probability targets count every row: nothing to rewrite)."""
    if node.op != "call_function" or node.target not in LOSSES:
        return False
    target = _arg(node, "target")
    classes = isinstance(target, fx.Node) and not target.meta["val"].dtype.is_floating_point
    return classes and _arg(node, "reduction") == MEAN


def _weighted_mean(node: fx.Node) -> bool:
    return _class_mean(node) and _arg(node, "weight") is not None


def _is_count(node: fx.Node, kinds: dict) -> bool:
    """A sum that depends on user inputs and on no parameter or buffer (seen through casts)."""
    while node.op == "call_function" and node.target in PASS_THROUGH:
        node = node.args[0]
    return node.op == "call_function" and node.target in SUMS and _only_inputs(node, kinds)


def _only_inputs(node: object, kinds: dict) -> bool:
    """``node`` is computed from user inputs and from no parameter, buffer or constant tensor."""
    sources = {kinds.get(p) for p in _placeholders(node)} if isinstance(node, fx.Node) else set()
    return sources == {"input"}


def _depends_on_inputs_or_state(value: object, kinds: dict) -> bool:
    return isinstance(value, fx.Node) and bool(_placeholders(value))


def _placeholders(node: fx.Node) -> set[fx.Node]:
    found, stack, seen = set(), [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            found.add(n)
        stack.extend(n.all_input_nodes)
    return found


def _copy(node: object, counts: fx.Graph, env: dict) -> object:
    """``node`` and what it is computed from, copied into ``counts`` (user inputs map to its placeholders)."""
    if not isinstance(node, fx.Node):
        return node
    if node not in env:
        for dep in node.all_input_nodes:
            _copy(dep, counts, env)
        env[node] = counts.node_copy(node, lambda n: env[n])
    return env[node]


def _arg(node: fx.Node, name: str) -> object:
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name, a.default_value)
    raise KeyError(name)


def _zero_dim(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _is_scalar(value: object) -> bool:
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point()


def _where(node: fx.Node) -> str:
    return f"; {origin(node)}" if origin(node) else ""
