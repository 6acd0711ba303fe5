"""Device arguments: a graph captured on one device runs on another.

``torch.export`` writes the device the model was captured on into the graph:
``arange(..., device=cpu)`` for position ids, ``to(x, device=cpu)`` for RoPE's
tables, ``_assert_tensor_metadata(x, device=cpu)``, a ``LocalOp``'s device
argument. ``retarget_device`` rewrites every such argument from the capture's
device to the one a rank computes on, in the graph and in every graph nested
in it (a recomputed layer's region), and moves the tensors its ``get_attr``
nodes read. Invariant: the graph computes what it computed, on ``target``.
"""
from __future__ import annotations

import torch
import torch.fx as fx


def same_device(a: torch.device, b: torch.device) -> bool:
    """``a`` and ``b`` name one device (an index left out matches any index of the type)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def retarget_device(gm: fx.GraphModule, source: torch.device, target: torch.device) -> int:
    """Points ``gm``'s device arguments and tensor attributes on ``source`` at ``target``, in place; returns
    how many it changed (0 when ``source`` is ``target``)."""
    if source == target:
        return 0
    changed = 0

    def move(value: object) -> object:
        nonlocal changed
        if isinstance(value, torch.device) and same_device(value, source):
            changed += 1
            return target
        return value

    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            node.args = fx.node.map_aggregate(node.args, move)
            node.kwargs = fx.node.map_aggregate(node.kwargs, move)
            if node.op == "get_attr":
                changed += _move_attribute(module, node.target, source, target)
        module.recompile()
    return changed


def _move_attribute(module: torch.nn.Module, target_name: str, source: torch.device, target: torch.device) -> int:
    *path, name = target_name.split(".")
    for part in path:
        module = getattr(module, part)
    value = getattr(module, name)
    if not isinstance(value, torch.Tensor) or not same_device(value.device, source):
        return 0
    moved = value.to(target)
    if isinstance(value, torch.nn.Parameter):
        moved = torch.nn.Parameter(moved, requires_grad=value.requires_grad)
    setattr(module, name, moved)
    return 1
