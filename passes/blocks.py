"""Repeated blocks: transformer layers and other modules that occur several times identically.

``repeated_blocks(gm)`` maps every compute node of a repeated block to the
matching node of the first such block, so an analysis can decide once per
block kind and reuse the answer (the solver ties their variables). Blocks are
the children of module lists (a path component that is an index, such as
``model.layers.7``); two blocks match when their node sequences have the same
ops on the same shapes and dtypes.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.passes.stage_cuts import module_path


def block_of(node: fx.Node) -> tuple[str, str] | None:
    """(family, block): ``("model.layers.*", "model.layers.7")`` for a node inside layer 7."""
    for path in module_path(node):
        parts = path.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                return ".".join(parts[:i] + ["*"]), ".".join(parts[: i + 1])
    return None


def _describe(val: object) -> object:
    if isinstance(val, fx.Node):
        val = val.meta.get("val")
    if isinstance(val, (tuple, list)):
        return tuple(_describe(v) for v in val)
    return (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else repr(val)


def _signature(node: fx.Node) -> tuple:
    """The op, its arguments (tensors by shape and dtype, the rest by value) and its result."""
    return (str(node.target), _describe(node.args), _describe(tuple(node.kwargs.items())), _describe(node))


def repeated_blocks(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """``{node: its counterpart in the first identical block}`` for nodes of every later identical block."""
    blocks: dict[str, list[fx.Node]] = {}
    family_of: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        found = block_of(node)
        if found is not None:
            family_of[found[1]] = found[0]
            blocks.setdefault(found[1], []).append(node)
    first: dict[tuple, list[fx.Node]] = {}
    mapping: dict[fx.Node, fx.Node] = {}
    for block, nodes in blocks.items():
        key = (family_of[block], tuple(_signature(n) for n in nodes))
        if key not in first:
            first[key] = nodes
            continue
        mapping.update(zip(nodes, first[key]))
    return mapping
