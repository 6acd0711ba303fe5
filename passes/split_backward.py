"""Split each stage's backward into input gradients (``B``) and weight gradients (``W``).

``defer_weight_gradients(gm, slots, trainable)`` rewrites every ``linear``,
``addmm`` and ``mm`` whose weight operand is a trainable parameter's
placeholder into the matching op of ``autopar.core.weight_grad``, which
computes the same forward and, in backward, can leave the weight's gradient
for a later ``W`` action. Other uses of a parameter (norm scales, embedding
lookups, biases) keep their gradients in ``B``: they are cheap, and summing a
parameter's contributions from both parts is exact, so a parameter used at
several sites (a tied embedding: looked up in ``B``, projected in ``W``) is
counted once per site.

Invariant: the rewritten graph computes what ``gm`` computes, and one backward
through it without ``weight_grad.collect`` accumulates the same gradients.
"""
from __future__ import annotations

from collections.abc import Container

import torch
import torch.fx as fx

from autopar.core.graph import Slot, SlotKind, copy_module
from autopar.core.weight_grad import split_addmm, split_linear, split_mm

aten = torch.ops.aten
# op -> (its split form, the index of the weight among its arguments)
SPLIT = {aten.linear.default: (split_linear, 1), aten.addmm.default: (split_addmm, 2), aten.mm.default: (split_mm, 1)}


def deferred_weight(node: fx.Node, weights: Container[fx.Node]) -> fx.Node | None:
    """The placeholder among ``weights`` whose gradient the split form of ``node`` leaves for ``W``, or None
    (``node`` is no ``linear`` / ``addmm`` / ``mm`` of such a weight)."""
    if node.op != "call_function" or node.target not in SPLIT or node.kwargs:
        return None
    index = SPLIT[node.target][1]
    weight = node.args[index] if len(node.args) > index else None
    return weight if weight in weights else None


def defer_weight_gradients(gm: fx.GraphModule, slots: list[Slot], trainable: set[str]) -> tuple[fx.GraphModule, int]:
    """A copy of ``gm`` whose weight matmuls can defer their weight gradient; and how many there are."""
    gm = copy_module(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    weights = {node for node, slot in zip(placeholders, slots)
               if slot.kind is SlotKind.PARAM and slot.name in trainable}
    count = 0
    for node in list(gm.graph.nodes):
        if deferred_weight(node, weights) is not None:
            node.target = SPLIT[node.target][0]
            count += 1
    gm.graph.lint()
    gm.recompile()
    return gm, count
