"""The placeholders a graph writes in place: how a forward that updates its buffers shows in an export.

``torch.export`` reports some buffer updates as ``BUFFER_MUTATION`` outputs (the
new value returned, the graph functional) and keeps others as in-place
operators on the buffer's placeholder: ``self.count += 1`` is an ``aten.add_``
on it, BatchNorm's running statistics are updated inside ``aten.batch_norm``.
``written_placeholders`` finds the second kind: an operator whose schema marks
an argument as written (``Tensor(a!)``: ``add_``, ``copy_``, ``index_put_``),
or one of the batch-norm family, which updates its running statistics without
saying so in its schema, applied to a placeholder or to a view of one.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

_aten = torch.ops.aten
# op -> (the positions of the statistics it updates, the position of the flag that says it does, or None: always)
_UPDATES_STATISTICS = {
    _aten.batch_norm.default: ((3, 4), 5),
    _aten.native_batch_norm.default: ((3, 4), 5),
    _aten._batch_norm_impl_index.default: ((3, 4), 5),
    _aten.instance_norm.default: ((3, 4), 5),
    _aten.cudnn_batch_norm.default: ((3, 4), 5),
    _aten.miopen_batch_norm.default: ((3, 4), 5),
    _aten.batch_norm_update_stats.default: ((1, 2), None),
}


def written_arguments(node: fx.Node) -> list[fx.Node]:
    """The graph values ``node`` writes in place (empty for a functional operator)."""
    if node.op != "call_function":
        return []
    found = _statistics_written(node)
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = node.args[i] if i < len(node.args) and not arg.kwarg_only else node.kwargs.get(arg.name)
                found += [v for v in (value if isinstance(value, (list, tuple)) else [value])
                          if isinstance(v, fx.Node)]
    return found


def _statistics_written(node: fx.Node) -> list[fx.Node]:
    rule = _UPDATES_STATISTICS.get(node.target)
    if rule is None:
        return []
    positions, flag = rule
    if flag is not None and not (len(node.args) > flag and node.args[flag] is True):
        return []
    return [node.args[i] for i in positions if i < len(node.args) and isinstance(node.args[i], fx.Node)]


def storage_of(value: fx.Node) -> fx.Node:
    """The value whose storage ``value`` shares: back through views (and in-place results) to where it began."""
    while value.op == "call_function" and value.args and isinstance(value.args[0], fx.Node) and _aliases(value):
        value = value.args[0]
    return value


def _aliases(node: fx.Node) -> bool:
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return (schema is not None and bool(schema.arguments) and schema.arguments[0].alias_info is not None
            and any(r.alias_info is not None for r in schema.returns))


def written_placeholders(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """``{placeholder: the first node writing it in place}`` for every placeholder of ``gm`` written in place."""
    written: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        for value in written_arguments(node):
            source = storage_of(value)
            if source.op == "placeholder":
                written.setdefault(source, node)
    return written
