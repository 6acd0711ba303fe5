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
  Scalar ops between the sum and the division (casts, scaling, adding a
  constant, ``clamp``/``clamp_min``/``clamp_max``, ``maximum``/``minimum`` with
  a constant) are applied to the whole batch's sum, as one device applies them:
  ``(x * m).sum() / m.sum().clamp(min=1)`` is exact.

Two forms are first written as such a division, computing the same on one
device: ``a.mean() / m.mean()`` with ``a`` and ``m`` of one size is
``a.sum() / m.sum()``, and ``x[mask].mean()`` (a boolean mask of the inputs) is
``x[mask].sum()`` over the number of elements selected.

The counts are kept as a graph of the user inputs (``LossCounts``); the runtime
feeds ``c`` = the ops above applied to the count summed over all parts, over
the number of parts, so the average of the parts is ``num / count`` over the
whole batch. Terms that are not reached through affine ops (sums, differences,
scaling by constants, casts) cannot be rewritten so; a warning names them, and
so does a division on that path by a value of the inputs alone that is not
such a count (each part would be divided by its own).

Invariant: the rewritten graph, fed ``c`` = the count of its own inputs,
computes what the captured graph computes (``Captured.run`` feeds exactly that).
"""
from __future__ import annotations

import warnings

import torch
import torch.fx as fx

from autopar.core.graph import Captured, Slot, SlotKind, origin, placeholder_kinds, placeholders_of
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
# scalar ops on a count that are applied to the whole batch's count: bounds by numbers, or by a constant tensor
BOUNDS = {aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default}
EXTREMES = {aten.maximum.default: aten.clamp_min.default, aten.minimum.default: aten.clamp_max.default}
ARITHMETIC = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor}  # with a number


def normalize_by_global_count(captured: Captured) -> LossCounts | None:
    """Rewrites ``captured`` in place (see the module doc); the counts' graph, or None when nothing is counted."""
    graph = captured.gm.graph
    kinds = placeholder_kinds(graph, captured.slots)
    as_sums(graph, kinds)
    output = next(n for n in graph.nodes if n.op == "output")
    averaged = [v for v in list(output.args[0])[len(captured.mutated_buffers):] if _is_scalar(v)]
    found = [_terms(v, kinds) for v in averaged]
    terms = list(dict.fromkeys(t for ts, _ in found for t in ts))
    for node in dict.fromkeys(d for _, ds in found for d in ds):
        warnings.warn(f"the loss divides by {node.args[1].name}, computed from the inputs alone, in {node.name}, "
                      f"which is not a count autopar can take over the whole batch: each microbatch and "
                      f"data-parallel rank divides by its own, so the loss differs from the whole batch's when "
                      f"the parts differ; write the denominator as a sum of the inputs (mask.sum(), optionally "
                      f"clamped: mask.sum().clamp(min=1)) and the numerator as a sum{_where(node)}", stacklevel=3)
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
    counts, finish = fx.Graph(), fx.Graph()
    env = {ph: counts.placeholder(ph.name) for ph, kind in kinds.items() if kind is SlotKind.INPUT}
    results, dtypes, finished = [], [], []
    totals = [finish.placeholder(f"total_{i}") for i in range(len(terms))]
    for i, (term, total) in enumerate(zip(terms, totals)):
        chain = _count_chain(term.args[1], kinds) if term.target is aten.div.Tensor else []
        finished.append(_finish(finish, total, chain, captured))
        dtype = term.meta["val"].dtype
        with graph.inserting_after(last):
            c = last = graph.placeholder(f"loss_count_{i}")
        c.meta["val"] = term.meta["val"].new_empty(())
        results.append(_rewrite(graph, term, c, counts, env, chain))
        dtypes.append(dtype)
        captured.slots.append(Slot(SlotKind.INPUT, c.name, index=sum(s.kind is SlotKind.INPUT for s in captured.slots)))
        captured.input_dtypes.append(dtype)
    counts.output(tuple(results))
    finish.output(tuple(finished))
    graph.lint()
    captured.gm.recompile()
    return LossCounts(graph_module(captured.gm, counts), dtypes, [t.name for t in terms],
                      graph_module(torch.nn.Module(), finish))


def _rewrite(graph: fx.Graph, term: fx.Node, c: fx.Node, counts: fx.Graph, env: dict,
             chain: list[fx.Node]) -> fx.Node:
    """Divides ``term``'s numerator by ``c``; returns the node of ``counts`` that computes its count (for a
    division, the sum at the bottom of ``chain``, the ops above it being the finish's)."""
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
        found = _copy(chain[-1], counts, env)
        term.args = (term.args[0], c)
    return counts.call_function(aten._to_copy.default, (found,), {"dtype": torch.float64})


def as_sums(graph: fx.Graph, kinds: dict) -> None:
    """Writes ``a.mean() / m.mean()`` (one size, ``m`` of the inputs alone) as ``a.sum() / m.sum()`` and
    ``x[mask].mean()`` (a boolean ``mask`` of the inputs alone) as ``x[mask].sum()`` over the number of elements
    selected, in place: the same values on one device, as divisions by a count."""
    erased = set()
    for node in list(graph.nodes):
        if node.op != "call_function" or node in erased:
            continue
        if node.target is aten.div.Tensor and all(_plain_mean(a) for a in node.args[:2]) \
                and _static_numel(node.args[0].args[0]) == _static_numel(node.args[1].args[0]) is not None \
                and _only_inputs(node.args[1], kinds):
            means = node.args[:2]
            node.args = tuple(_insert(graph, node, aten.sum.default, (m.args[0],), m.meta["val"]) for m in means)
            for m in dict.fromkeys(means):
                if not m.users:
                    graph.erase_node(m)
                    erased.add(m)
        elif _plain_mean(node) and _selected(node.args[0], kinds):
            x, (mask,) = node.args[0].args  # x (*mask.shape, *rest), mask bool
            total = _insert(graph, node, aten.sum.default, (node.args[0],), node.meta["val"])
            count = _insert(graph, node, aten.sum.default, (mask,), mask.meta["val"].new_empty((), dtype=torch.int64))
            rest = x.meta["val"].shape[mask.meta["val"].dim():].numel()
            if rest != 1:
                count = _insert(graph, node, aten.mul.Scalar, (count, rest), count.meta["val"])
            mean = _insert(graph, node, aten.div.Tensor, (total, count), node.meta["val"])
            node.replace_all_uses_with(mean)
            graph.erase_node(node)


def _plain_mean(node: object) -> bool:
    """A zero-dim ``mean`` over all of one tensor, with no dtype of its own."""
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target is aten.mean.default
            and len(node.args) == 1 and not node.kwargs and _zero_dim(node))


def _static_numel(node: fx.Node) -> int | None:
    """The number of elements of ``node``'s value where its shape is known at capture, else None."""
    numel = node.meta["val"].numel()
    return numel if isinstance(numel, int) else None


def _selected(node: fx.Node, kinds: dict) -> bool:
    """``x[mask]`` with one boolean ``mask`` computed from user inputs alone."""
    if node.op != "call_function" or node.target is not aten.index.Tensor or len(node.args[1]) != 1:
        return False
    mask = node.args[1][0]
    return isinstance(mask, fx.Node) and mask.meta["val"].dtype is torch.bool and _only_inputs(mask, kinds)


def _insert(graph: fx.Graph, before: fx.Node, target: object, args: tuple, val: torch.Tensor) -> fx.Node:
    """A new ``target(*args)`` before ``before``, with its meta (the source line) and the value ``val``."""
    with graph.inserting_before(before):
        new = graph.call_function(target, args)
    new.meta = {**before.meta, "val": val}
    return new


def _terms(value: fx.Node, kinds: dict) -> tuple[list[fx.Node], list[fx.Node]]:
    """The count-normalized terms an averaged scalar ``value`` is an affine function of, and the divisions on
    that path by a value of the inputs alone that is not a count (each part would divide by its own)."""
    found, unknown, stack, seen = [], [], [value], set()
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
            elif node.target is aten.div.Tensor and _of_batch(b, kinds):
                unknown.append(node)
    return found, unknown


def _counted_mean(node: fx.Node, kinds: dict) -> str | None:
    """"loss" or "div" when ``node`` is a mean over a count of the inputs that this pass can rewrite, else None."""
    if node.op != "call_function":
        return None
    if node.target in LOSSES:
        target = _arg(node, "target")
        mean = _class_mean(node) and _arg(node, "weight") is None
        return "loss" if mean and _only_inputs(target, kinds) else None
    denominator = node.args[1] if node.target is aten.div.Tensor else None
    if isinstance(denominator, fx.Node) and _zero_dim(denominator) and _count_chain(denominator, kinds) \
            and not _is_mean(node.args[0]):
        return "div"
    return None


def _is_mean(node: object) -> bool:
    """A mean over this part's elements (seen through casts): not a sum the whole batch's count can divide."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in PASS_THROUGH:
        node = node.args[0]
    return isinstance(node, fx.Node) and node.target in (aten.mean.default, aten.mean.dim)


def _class_mean(node: fx.Node) -> bool:
    """A mean-reduced loss over class targets (probability targets count every row: nothing to rewrite)."""
    if node.op != "call_function" or node.target not in LOSSES:
        return False
    target = _arg(node, "target")
    classes = isinstance(target, fx.Node) and not target.meta["val"].dtype.is_floating_point
    return classes and _arg(node, "reduction") == MEAN


def _weighted_mean(node: fx.Node) -> bool:
    return _class_mean(node) and _arg(node, "weight") is not None


def _count_chain(node: fx.Node, kinds: dict) -> list[fx.Node]:
    """``node`` down to a sum that depends on user inputs and on no parameter or buffer, through scalar ops
    (``PASS_THROUGH``, ``BOUNDS`` by numbers, ``EXTREMES`` with a constant); empty when it is no such count."""
    chain = [node]
    while node.op == "call_function" and node.target not in SUMS:
        numbers = not any(isinstance(a, fx.Node) for a in node.args[1:])
        if node.target in PASS_THROUGH or (node.target in BOUNDS | ARITHMETIC and numbers):
            node = node.args[0]
        elif node.target in EXTREMES and _is_constant(node.args[1], kinds):
            node = node.args[0]
        elif node.target in EXTREMES and _is_constant(node.args[0], kinds):
            node = node.args[1]
        else:
            return []
        if not isinstance(node, fx.Node):
            return []
        chain.append(node)
    return chain if node.op == "call_function" and _only_inputs(node, kinds) else []


def _finish(graph: fx.Graph, total: fx.Node, chain: list[fx.Node], captured: Captured) -> fx.Node:
    """The ops of ``chain`` (``_count_chain``'s, top first) above its sum applied in ``graph`` to ``total``, the
    whole batch's sum, then cast to float64."""
    value = total
    for i in reversed(range(len(chain) - 1)):
        node, below = chain[i], chain[i + 1]
        if node.target in EXTREMES:
            bound = node.args[1] if node.args[0] is below else node.args[0]
            value = graph.call_function(EXTREMES[node.target], (value, _constant(bound, captured)))
        else:
            value = graph.call_function(node.target, (value, *node.args[1:]), dict(node.kwargs))
    return graph.call_function(aten._to_copy.default, (value,), {"dtype": torch.float64})


def _constant(node: fx.Node, captured: Captured) -> float:
    """The number a constant tensor of the graph holds (one lifted by the capture, or made in it)."""
    names = {n: s.name for n, s in zip([n for n in captured.gm.graph.nodes if n.op == "placeholder"],
                                       captured.slots)}

    def value(n: object) -> object:
        if not isinstance(n, fx.Node):
            return n
        if n.op == "placeholder":
            return captured.constants[names[n]]
        if n.op == "get_attr":
            return getattr(captured.gm, n.target)
        return n.target(*fx.node.map_aggregate(n.args, value), **fx.node.map_aggregate(n.kwargs, value))
    return float(value(node))


def _is_constant(value: object, kinds: dict) -> bool:
    """A one-element tensor computed from constants alone (``torch.tensor(1.0)`` in the loss)."""
    if not isinstance(value, fx.Node) or value.meta.get("val") is None or value.meta["val"].numel() != 1:
        return False
    return all(kinds.get(p) is SlotKind.CONSTANT for p in placeholders_of(value))


def _only_inputs(node: object, kinds: dict) -> bool:
    """``node`` is computed from user inputs and from no parameter, buffer or constant tensor."""
    sources = {kinds.get(p) for p in placeholders_of(node)} if isinstance(node, fx.Node) else set()
    return sources == {"input"}


def _of_batch(node: object, kinds: dict) -> bool:
    """``node`` is computed from user inputs, maybe constants, and no parameter or buffer."""
    sources = {kinds.get(p) for p in placeholders_of(node)} if isinstance(node, fx.Node) else set()
    return SlotKind.INPUT in sources and sources <= {SlotKind.INPUT, SlotKind.CONSTANT}


def _depends_on_inputs_or_state(value: object, kinds: dict) -> bool:
    return isinstance(value, fx.Node) and bool(placeholders_of(value))


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
