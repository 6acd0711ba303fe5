"""Dropout under context parallelism: each ``aten.dropout`` on a value with a sequence dim of the local length
becomes ``autopar::cp_dropout`` (``autopar/core/cp_dropout.py``): the rows of the whole sequence's mask at the
rank's positions, so the cp ranks together drop what one device drops.

Precondition: the rank's graph after ``passes/context_parallel.py`` (values hold ``local`` tokens of each
sequence). Dropout that is off (``train`` False or ``p`` 0) is left alone; a dropping one on a value without
a dim of the local length at a sequence dim (dim 1, or dim 2 of a 4-dim value) is refused by name: no rows
of a whole sequence could be chosen for it.

Invariant: with the cp ranks seeded as one device is, each rank's dropout output is the rows of one device's.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar.core.cp_dropout import cp_dropout
from autopar.passes.context_masks import refused
from autopar.passes.context_checks import sequence_dims

aten = torch.ops.aten
DROPOUT = aten.dropout.default


def whole_sequence_dropout(gm: fx.GraphModule, local: int, axis: str = "cp") -> int:
    """Rewrites ``gm``'s dropping dropouts in place (module doc); returns how many."""
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        if node.target is not DROPOUT:
            continue
        x, p, train = (list(node.args) + [node.kwargs.get("p"), node.kwargs.get("train")])[:3]
        if not train or not p:
            continue
        shape = tuple(x.meta["val"].shape)
        dims = [d for d in sequence_dims(shape) if shape[d] == local]
        if not dims:
            raise refused(node, f"it drops (p={p}) a value of shape {list(shape)} with no sequence dim of the "
                                f"local length {local}: no rows of the whole sequence's mask fit it; set it to 0")
        with graph.inserting_before(node):
            both = graph.call_function(cp_dropout._opoverload, (x, float(p), dims[0], axis))
            both.meta["val"] = (x.meta["val"], x.meta["val"])
            out = graph.call_function(operator.getitem, (both, 0))
            out.meta = dict(node.meta)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        count += 1
    graph.lint()
    gm.recompile()
    return count
