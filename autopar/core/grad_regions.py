"""Grad-mode regions of an export inlined: a ``torch.no_grad()`` block inside forward.

torch.export keeps such a block as ``wrap_with_set_grad_enabled(False, submodule, *inputs)``, a call into a
submodule the sharding, pipeline and recomputation passes do not look into (tp failed with "does not belong to
this Graph", pp with a ``KeyError``). ``inline_grad_regions`` copies each region's ops into the graph in its
place and detaches each value the region returns (for ``enabled=False``): the same values forward, and no
gradient through them backward, as the block has on one device.

Invariant: the graph computes the same values and gradients, and holds no ``wrap_with_set_grad_enabled``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

REGION = torch.ops.higher_order.wrap_with_set_grad_enabled


def inline_grad_regions(gm: fx.GraphModule) -> int:
    """Inlines every grad-mode region of ``gm`` (nested ones too); how many there were."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not REGION:
            continue
        enabled, holder, *inputs = node.args
        body: fx.GraphModule = getattr(gm, holder.target)
        count += 1 + inline_grad_regions(body)
        values = _copy_body(gm, body, inputs, node, detach=not enabled)
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise NotImplementedError(f"internal error: a grad-mode region's result used by {user.format_node()}")
            user.replace_all_uses_with(values[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not holder.users:
            gm.graph.erase_node(holder)
            delattr(gm, holder.target)
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _copy_body(gm: fx.GraphModule, body: fx.GraphModule, inputs: list, at: fx.Node, detach: bool) -> list:
    """``body``'s ops copied into ``gm`` before ``at`` on ``inputs``; the values it returns (detached)."""
    env: dict[fx.Node, object] = dict(zip([n for n in body.graph.nodes if n.op == "placeholder"], inputs))
    out: list = []
    with gm.graph.inserting_before(at):
        for n in body.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                out = list(fx.node.map_arg(n.args[0], lambda x: env[x]))
                break
            if n.op == "get_attr":
                name = _free_name(gm, n.target)
                setattr(gm, name, getattr(body, n.target))
                env[n] = gm.graph.get_attr(name)
                env[n].meta = dict(n.meta)
                continue
            env[n] = gm.graph.node_copy(n, lambda x: env[x])
        if detach:
            out = [_detached(gm, v) for v in out]
    return out


def _detached(gm: fx.GraphModule, value: object) -> object:
    if not isinstance(value, fx.Node) or not isinstance(value.meta.get("val"), torch.Tensor):
        return value
    node = gm.graph.call_function(torch.ops.aten.detach.default, (value,))
    node.meta = {**value.meta, "val": value.meta["val"].detach()}
    return node


def _free_name(gm: fx.GraphModule, name: str) -> str:
    base, i = name.replace(".", "_"), 0
    while hasattr(gm, f"{base}_{i}"):
        i += 1
    return f"{base}_{i}"
