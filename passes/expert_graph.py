"""What the expert-parallel rewrites (``expert_parallel.py``, ``expert_grouped.py``) ask of a graph: which ops
keep an expert's rows apart, and the nodes a node reaches."""
from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx

from autopar.core.errors import UnsupportedError

aten = torch.ops.aten
# dtype casts and copies (between y_e * w_e and acc, between an expert's ops)
CONVERSIONS = {aten._to_copy.default, aten.to.dtype, aten.clone.default, aten.alias.default}
VIEWS = {aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten.expand.default}
MATMULS = {  # op -> (the argument of rows, the arguments that must not depend on the rows: weights, bias)
    aten.linear.default: (0, (1, 2)), aten.mm.default: (0, (1,)), aten.matmul.default: (0, (1,)),
    aten.addmm.default: (1, (0, 2)),
}
SPLITS = {  # op -> the index of its dim argument (default 0): row-wise when that dim is not the rows'
    aten.split.Tensor: 2, aten.split_with_sizes.default: 2, aten.chunk.default: 2, aten.slice.Tensor: 1,
    aten.narrow.default: 1,
}


def check_rowwise(nd: fx.Node, rows: set[fx.Node], e: int, where: str,
                  refused: Callable[[str, str], UnsupportedError]) -> None:
    """Each row of an expert's output must depend on the same row of its input only; else ``refused(where,
    why)`` is raised."""
    target = nd.target
    if target is operator.getitem or target in CONVERSIONS:
        return
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return
    if target in MATMULS:
        row, others = MATMULS[target]
        args = nd.args
        if args[row] in rows and not any(isinstance(args[i], fx.Node) and args[i] in rows for i in others
                                         if i < len(args)):
            return
    if target in SPLITS:
        i = SPLITS[target]
        dim = nd.args[i] if len(nd.args) > i else nd.kwargs.get("dim", 0)
        if dim not in (0, -nd.args[0].meta["val"].dim()):
            return
    raise refused(where, f"expert {e} computes {nd.format_node()}, which may mix tokens; expert parallelism "
                         "runs each expert on the rows routed to it only")


def descendants(node: fx.Node) -> set[fx.Node]:
    return _closure(node, lambda nd: list(nd.users))


def ancestors(node: fx.Node) -> set[fx.Node]:
    return _closure(node, lambda nd: nd.all_input_nodes)


def _closure(node: fx.Node, step: Callable[[fx.Node], list[fx.Node]]) -> set[fx.Node]:
    """The nodes reached from ``node`` by repeated ``step`` (its users, or its inputs), ``node`` not included."""
    seen, stack = set(), step(node)
    while stack:
        nd = stack.pop()
        if nd not in seen:
            seen.add(nd)
            stack.extend(step(nd))
    return seen
