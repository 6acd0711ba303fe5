"""Inductor regions: the ATen ops of a rank's graph that inductor may fuse, outlined into ``Inductor`` calls.

``inductor_regions(gm)`` groups the graph's compilable nodes (pure ATen ops on tensors: no autopar op, no
write, no random op, no data-dependent output shape, nothing a write reaches through views) into regions,
one or more per layer (a child of a module list, ``model.layers.7``) and outside the layers, and replaces each
region of two or more ops by a call of an ``autopar.core.inductor.Inductor`` module holding the region's graph.
Tensor parallelism's collectives (``FUNCTIONAL``: ``all_reduce``, ``grad_all_reduce``, sequence parallelism's
``reduce_scatter`` and a plain ``all_gather``) join the region of the op they reduce (of their users, for a
parameter; one of a value computed outside the regions stays outside), so a layer and its collectives are one region, compiled
with them as torch's functional collectives (``autopar/core/functional_collectives.py``). Sequence
parallelism's ``all_gather_rs`` stays outside: its saved-tensor hooks re-gather in backward what it gathered. A recomputed layer's region (``Recompute``) is
outlined inside, without its collectives (its recomputation keeps what communicated in forward), so that
backward's recomputation runs the compiled code too.

A region lies between two consecutive side effects of the graph that stay outside (a ZeRO gather or free, an
exchange, a random draw, a write): it is called where its last node was, so what it reads is still there and
what it computes is not moved across what communicates outside it. Regions never form a cycle with what stays
outside: every node carries a depth, the number of times a path from the inputs to it leaves a region-able
stretch of one layer (through a node that stays outside, or into another layer); a region is the nodes of one
layer at one depth between two side effects. A path that leaves a region and comes back to the same layer
arrives one depth deeper, so no region depends on itself.

Invariant: the graph computes what it computed; every node that stays outside keeps its order relative to
the others that stay outside (collectives, exchanges, the weight-gradient matmuls of a split backward), and
the collectives inside regions keep theirs relative to those outside.
"""
from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from autopar.core.functional_collectives import FUNCTIONAL
from autopar.core.inductor import Inductor
from autopar.core.recompute_modes import Recompute
from autopar.passes.blocks import block_of

PREFIX = "inductor_"
aten = torch.ops.aten
_NOT_COMPILED = {aten._local_scalar_dense.default, aten.item.default}  # (a Python number)
_UNLISTED = {aten._assert_tensor_metadata.default}  # left outside and not listed: it checks, computes nothing
# ops tagged random or data-dependent in general, but not at these arguments
_EXCEPT = {
    aten.scaled_dot_product_attention.default: lambda n: not _arg(n, 3, "dropout_p", 0.0),  # no dropout
    aten.index.Tensor: lambda n: all(i is None or i.meta["val"].dtype != torch.bool for i in n.args[1]),  # no mask
}


def _arg(node: fx.Node, i: int, name: str, default: object) -> object:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


@dataclass
class Regions:
    """What ``inductor_regions`` outlined in one graph (nested recomputed layers included)."""

    regions: int = 0
    distinct: set[str] = field(default_factory=set)  # the regions' structures
    compiled_ops: int = 0
    outside: Counter = field(default_factory=Counter)  # ops left outside the regions, by kind
    collectives: Counter = field(default_factory=Counter)  # tp's collectives inside them, by kind

    def add(self, other: Regions) -> None:
        self.regions += other.regions
        self.distinct |= other.distinct
        self.compiled_ops += other.compiled_ops
        self.outside.update(other.outside)
        self.collectives.update(other.collectives)


def compilable(node: fx.Node) -> bool:
    """Whether inductor may take ``node``: a pure ATen op (or a pick from one) on tensors."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and compilable(node.args[0])
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or op.namespace not in ("aten", "prims") or op in _NOT_COMPILED:
        return False
    if op._schema.is_mutable:
        return False
    if any(t in op.tags for t in (torch.Tag.nondeterministic_seeded, torch.Tag.dynamic_output_shape)):
        if op not in _EXCEPT or not _EXCEPT[op](node):
            return False
    vals = node.meta.get("val")
    vals = vals if isinstance(vals, (tuple, list)) else [vals]
    return all(isinstance(v, torch.Tensor) for v in vals) and bool(vals)


def _pure(node: fx.Node) -> bool:
    """An ATen op without a side effect (no write, no random draw), or a pick from a result."""
    op = node.target
    if op is operator.getitem:
        return True
    return (isinstance(op, torch._ops.OpOverload) and op.namespace in ("aten", "prims") and not op._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in op.tags)


def _written_through(graph: fx.Graph) -> set[fx.Node]:
    """Nodes a write reaches: the written arguments of mutating ops and the views they are views of."""
    reached: set[fx.Node] = set()
    for node in graph.nodes:
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or not op._schema.is_mutable:
            continue
        for arg, formal in zip(node.args, op._schema.arguments):
            if formal.alias_info is not None and formal.alias_info.is_write and isinstance(arg, fx.Node):
                _views_back(arg, reached)
    return reached


def _views_back(node: fx.Node, reached: set[fx.Node]) -> None:
    while isinstance(node, fx.Node) and node not in reached:
        reached.add(node)
        op = node.target
        if not (isinstance(op, torch._ops.OpOverload) and op._schema.returns and op._schema.returns[0].alias_info):
            return
        node = node.args[0]


def _depths(graph: fx.Graph, layer: dict[fx.Node, str | None]) -> dict[fx.Node, int]:
    """Each node's depth (see the module doc), as late as its users allow: a node's depth is at least its
    inputs', one more where it enters a region-able stretch from outside it or from another layer. The least
    such depths first, then each raised as far as its users' allow, so that what a layer's later ops read from
    earlier (rotary angles computed once for every layer) joins their region."""
    def step(p: fx.Node, n: fx.Node) -> int:  # how much deeper n is than its input p, at least
        return int(n in layer and (p not in layer or layer[p] != layer[n]))

    depth: dict[fx.Node, int] = {}
    for node in graph.nodes:
        depth[node] = max((depth[p] + step(p, node) for p in node.all_input_nodes), default=0)
    top = max(depth.values(), default=0)
    for node in reversed(graph.nodes):
        if node.users:
            depth[node] = min(depth[u] - step(node, u) for u in node.users)
        else:
            depth[node] = top if node not in layer else depth[node]
    for node in graph.nodes:  # a pick stays with the op it picks from
        if node.target is operator.getitem and node in layer:
            depth[node] = depth[node.args[0]]
    return depth


def _kind(node: fx.Node, gm: fx.GraphModule) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__
    return getattr(node.target, "__name__", str(node.target)).replace("autopar_passes_rules_", "")


def _sink_frees(graph: fx.Graph) -> None:
    """Moves each ZeRO ``zero_free`` down to just before the next node with a side effect (or the output), so
    that a layer's last ops after its parameters' last use (the residual add) join the layer's region instead of
    being cut off by the free. The buffer is released a little later, but no gather, exchange or write comes
    between the free's old place and its new one, so the gathered bytes peak where they did."""
    free = torch.ops.autopar.zero_free.default
    for node in [n for n in graph.nodes if n.target is free]:
        after = node.next
        while after.op != "output" and (after.op not in ("call_function", "call_module") or _pure(after)
                                        or after.target in _UNLISTED or after.target is free):
            after = after.next
        if after is not node.next:
            after.prepend(node)


def inductor_regions(gm: fx.GraphModule, *, collectives: bool = True) -> Regions:
    """Outlines ``gm``'s regions into ``Inductor`` submodules, in place (see the module doc); ``collectives``:
    whether a region may hold tp's all-reduces (not in a recomputed layer, whose recomputation keeps what
    communicated in forward)."""
    found = Regions()
    for node in gm.graph.nodes:  # recomputed layers first: their regions are outlined inside them
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), Recompute):
            found.add(inductor_regions(gm.get_submodule(node.target).region, collectives=False))
    _sink_frees(gm.graph)
    written = _written_through(gm.graph)
    layer: dict[fx.Node, str | None] = {}  # the layer of each node a region may take
    epoch: dict[fx.Node, int] = {}  # side effects before it: a region lies between two (called at its last node)
    count = 0
    entering: list[fx.Node] = []  # collectives of the graph's inputs (a parameter's grad_all_reduce)
    for node in gm.graph.nodes:
        if node.target is operator.getitem and node.args[0] in layer:  # (with the op it picks from)
            layer[node] = layer[node.args[0]]
        elif compilable(node) and node not in written and node.target is not operator.getitem:
            block = block_of(node)
            layer[node] = block[1] if block else None
        elif collectives and node.target in FUNCTIONAL and (node.args[0] in layer or node.args[0].op == "placeholder"):
            layer[node] = layer.get(node.args[0])  # in its input's layer; a parameter's in its users' (below)
            if node.args[0] not in layer:
                entering.append(node)
        elif node.op in ("call_function", "call_module") and node.target not in _UNLISTED:
            found.outside[_kind(node, gm)] += 1
            count += not _pure(node)
        epoch[node] = count
    for node in entering:
        users = {layer[u] for u in node.users if u in layer}
        layer[node] = users.pop() if len(users) == 1 else None
    depth = _depths(gm.graph, layer)
    groups: dict[tuple[str | None, int, int], dict[fx.Node, None]] = {}
    for node in layer:
        groups.setdefault((layer[node], depth[node], epoch[node]), {})[node] = None
    partitions = []
    for nodes in groups.values():
        ops = [n for n in nodes if n.target is not operator.getitem]
        if len(ops) >= 2:
            partitions.append(nodes)
        else:
            found.outside.update(_kind(n, gm) for n in ops)
    if not partitions:
        return found
    fuse_by_partitions(gm, partitions, prefix=PREFIX, always_return_tuple=True)
    for i in range(len(partitions)):
        name = f"{PREFIX}{i}"
        region = Inductor(getattr(gm, name))
        setattr(gm, name, region)
        found.regions += 1
        found.distinct.add(region.key)
        found.compiled_ops += sum(1 for n in region.region.graph.nodes
                                  if n.op == "call_function" and n.target is not operator.getitem)
        found.collectives.update(_kind(n, gm) for n in region.region.graph.nodes if n.target in FUNCTIONAL)
    gm.recompile()
    return found
