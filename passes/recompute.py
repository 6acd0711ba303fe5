"""Activation recomputation: each recomputed layer's forward outlined into a region that backward runs again.

``recompute(gm, mode_of)`` groups the forward's operators by layer (the entry
of a module list a node's module path runs through, ``transformer.h.3``; a node
a pass inserted, such as a tp collective or ZeRO-3's all-gather, joins the
layer of its users) and outlines every layer ``mode_of(layer)`` recomputes into
one submodule, called through ``autopar.core.recompute_modes.Recompute``: autograd
keeps the region's inputs and the outputs its mode keeps (``"full"``: those
that communicated in forward; ``"selective"``: also matmuls and attention),
and backward runs the region again for the rest. The embeddings, the head and
the loss are not layers and run as before.

A region holds every operator of its layer except ZeRO-3's prefetch, free and
bracket ops, which stay outside (a prefetch replayed in backward would gather a
layer nobody needs). The layer's all-gather is inside, so backward gathers the
layer again, as ZeRO-3 does without recomputation; a region whose inputs are
views of another layer's gathered parameters (freed after their forward use)
is not recomputed, and ``Recomputed.skipped`` says so; nor is one that updates
a graph input in place (a buffer updated in forward, which a second run would
update again) or reads one that a later operator updates.

Invariant: the rewritten graph computes what ``gm`` computes, value for value:
the same operators on the same inputs, random numbers drawn again from the
generator's state at the region's start. Only what autograd keeps between
forward and backward changes. A region that draws random numbers from an
explicit ``torch.Generator`` cannot be replayed and is refused by name.
"""
from __future__ import annotations

import heapq
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.core import zero_ops as _declared  # noqa: F401  (declares the autopar::zero_* ops)
from autopar.core.buffer_writes import storage_of, written_arguments
from autopar.core.expert_ops import ExpertParallel
from autopar.core.graph import origin
from autopar.core.recompute_modes import COMMUNICATING, Recompute
from autopar.passes.lazy_module import graph_module
from autopar.passes.stage_cuts import module_path, node_layer


@dataclass
class Recomputed:
    """The rewritten graph, the mode of every layer it has, and the layers asked for but not recomputed."""

    gm: fx.GraphModule
    modes: dict[str, str]  # layer -> the mode it runs with
    skipped: dict[str, str] = field(default_factory=dict)  # layer -> why it runs without recomputation


def _outside_ops() -> set:
    ns = torch.ops.autopar
    return {ns.zero_prefetch.default, ns.zero_free.default, ns.zero_begin.default, ns.zero_end.default}


def assign_layers(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """The layer of every operator that has one; an inserted node (no module path) takes its users' layer
    when they all share one, and a ``getitem`` its producer's."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"
             or n.op == "call_module" and isinstance(gm.get_submodule(n.target), ExpertParallel)]
    outside = _outside_ops()
    layer = {n: la for n in nodes if (la := node_layer(n)) is not None}
    for n in reversed(nodes):
        if n in layer or module_path(n) or n.target in outside:
            continue
        users = {layer.get(u) for u in n.users if u.target not in outside}
        if len(users) == 1 and None not in users:
            layer[n] = users.pop()
    for n in nodes:
        if n.target is operator.getitem:
            source = n.args[0]
            if source in layer:
                layer[n] = layer[source]
            else:
                layer.pop(n, None)
    return layer


def layers(gm: fx.GraphModule) -> list[str]:
    """The layers of ``gm`` in execution order."""
    return list(dict.fromkeys(assign_layers(gm).values()))


def recompute(gm: fx.GraphModule, mode_of: Callable[[str], str]) -> Recomputed:
    """A copy of ``gm`` whose layers ``mode_of(layer)`` says to recompute ("selective" or "full") run as
    ``Recompute`` regions; the others ("none") run as before (see the module doc)."""
    layer_of = assign_layers(gm)
    modes = {la: mode_of(la) for la in dict.fromkeys(layer_of.values())}
    outside = _outside_ops()
    skipped: dict[str, str] = {}
    while True:
        members = {la: [n for n in gm.graph.nodes if layer_of.get(n) == la and n.target not in outside]
                   for la, mode in modes.items() if mode != "none"}
        for la, nodes in members.items():
            _check_replayable(la, nodes, modes[la])
            why = _reads_other_gathers(nodes) or _updates_placeholders(gm, nodes)
            if why:
                skipped[la] = why
        cyclic = set() if skipped.keys() & members.keys() else _order(gm, members)[1]
        for la in cyclic:
            skipped[la] = "its operators interleave with those outside it (no single region can hold them)"
        if not (skipped.keys() & members.keys()):
            break
        modes.update(dict.fromkeys(skipped, "none"))
    return Recomputed(_outline(gm, members, modes), modes, skipped)


def _check_replayable(layer: str, nodes: list[fx.Node], mode: str) -> None:
    """Refuses a region whose random numbers backward could not draw again."""
    for n in nodes:
        tags = getattr(n.target, "tags", ())
        if torch.Tag.nondeterministic_seeded in tags and n.kwargs.get("generator") is not None:
            where = f" ({origin(n)})" if origin(n) else ""
            raise ValueError(
                f"recompute={mode!r} cannot recompute layer {layer!r}: {n.name} ({n.target}){where} draws random "
                f"numbers from an explicit torch.Generator, whose state backward cannot restore; pass "
                f"recompute={{{layer!r}: 'none', '*': {mode!r}}} to keep this layer's activations, or draw from "
                "the default generator")


def _reads_other_gathers(nodes: list[fx.Node]) -> str:
    """Why a region cannot recompute: an input that views parameters ZeRO-3 gathered outside it ("" if none)."""
    members = set(nodes)
    gather = torch.ops.autopar.zero_all_gather.default
    for n in nodes:
        for arg in n.all_input_nodes:
            source = arg
            while source not in members and source.op == "call_function" and _aliases(source):
                source = source.args[0]
            if source not in members and source.target is gather:
                return (f"it reads parameters ZeRO-3 gathers outside it ({arg.name}), which are freed after their "
                        "forward use")
    return ""


def _updates_placeholders(gm: fx.GraphModule, nodes: list[fx.Node]) -> str:
    """Why a region cannot recompute: it writes a graph input in place (a buffer updated in forward), which
    running it again in backward would write twice, or it reads one that a later operator writes ("" if none)."""
    members = set(nodes)
    for n in nodes:
        for value in written_arguments(n):
            if storage_of(value).op == "placeholder":
                return (f"it updates {storage_of(value).name} in place in forward ({n.name}), which backward "
                        "would update again")
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    written = {storage_of(v): w for w in gm.graph.nodes if w not in members for v in written_arguments(w)}
    end = max(position[n] for n in nodes)
    for n in nodes:
        for arg in n.all_input_nodes:
            source = storage_of(arg)
            if source.op == "placeholder" and source in written and position[written[source]] > end:
                return (f"it reads {source.name}, which {written[source].name} updates in place after it in "
                        "forward")
    return ""


def _aliases(node: fx.Node) -> bool:
    """Whether ``node``'s output may share storage with its first input (a view, a piece of a split)."""
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns) and bool(node.args) \
        and isinstance(node.args[0], fx.Node)


def _units(gm: fx.GraphModule, members: dict[str, list[fx.Node]]) -> tuple[dict[fx.Node, object], dict]:
    """Each node's unit (its layer's region, or itself) and each unit's dependencies on other units."""
    unit: dict[fx.Node, object] = {n: n for n in gm.graph.nodes}
    for la, nodes in members.items():
        for n in nodes:
            unit[n] = ("region", la)
    deps: dict[object, set] = {}
    for n in gm.graph.nodes:
        deps.setdefault(unit[n], set()).update(unit[i] for i in n.all_input_nodes if unit[i] != unit[n])
    return unit, deps


def _order(gm: fx.GraphModule, members: dict[str, list[fx.Node]]) -> tuple[list[object], set[str]]:
    """Units in an order that respects every dependency, each as early as the graph had it; and the layers
    left over in a cycle (non-empty: no such order)."""
    unit, deps = _units(gm, members)
    first: dict[object, int] = {}
    for i, n in enumerate(gm.graph.nodes):
        first.setdefault(unit[n], i)
    waiting = {u: len(d) for u, d in deps.items()}
    users: dict[object, list] = {}
    for u, d in deps.items():
        for v in d:
            users.setdefault(v, []).append(u)
    key = {u: k for k, u in enumerate(deps)}  # ties in graph position never compare units
    ready = [(first[u], key[u], u) for u in deps if not waiting[u]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, u = heapq.heappop(ready)
        order.append(u)
        for v in users.get(u, []):
            waiting[v] -= 1
            if not waiting[v]:
                heapq.heappush(ready, (first[v], key[v], v))
    left = {u[1] for u, w in waiting.items() if w and isinstance(u, tuple)}
    return order, left


def _outline(gm: fx.GraphModule, members: dict[str, list[fx.Node]], modes: dict[str, str]) -> fx.GraphModule:
    """The graph with each layer of ``members`` replaced by a call of its ``Recompute`` region."""
    members = {la: nodes for la, nodes in members.items() if modes[la] != "none"}
    if not members:
        return gm
    order, _ = _order(gm, members)
    member_set = {la: set(nodes) for la, nodes in members.items()}
    zero = {torch.ops.autopar.zero_all_gather.default} | _outside_ops()
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    root = torch.nn.Module()
    env: dict[fx.Node, fx.Node] = {}
    for u in order:
        if isinstance(u, fx.Node):
            if u.op in ("get_attr", "call_module"):
                _copy_attr(gm, root, u.target)
            env[u] = graph.node_copy(u, env.__getitem__)
            continue
        la = u[1]
        nodes, inside = members[la], member_set[la]
        inputs = list(dict.fromkeys(i for n in nodes for i in n.all_input_nodes if i not in inside))
        outputs = [n for n in nodes if any(user not in inside for user in n.users)]
        region = _region(gm, nodes, inputs, outputs)
        communicates = any(n.target in COMMUNICATING or not isinstance(n.target, torch._ops.OpOverload)
                           for n in nodes if n.target is not operator.getitem)
        name = _free_name(root, "recompute_" + la.replace(".", "_"))
        shards = tuple(k for k, i in enumerate(inputs) if any(u in inside and u.target in zero for u in i.users))
        root.add_module(name, Recompute(region, modes[la], la, policy=communicates, by_reference=shards))
        call = graph.call_module(name, tuple(env[i] for i in inputs))
        call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
        for k, o in enumerate(outputs):
            env[o] = graph.call_function(operator.getitem, (call, k))
            env[o].meta = dict(o.meta)
    out = graph_module(root, graph)
    out.graph.lint()
    return out


def _region(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.GraphModule:
    """``nodes`` as a GraphModule of ``inputs`` returning the tuple of ``outputs``."""
    graph = fx.Graph()
    root = torch.nn.Module()
    env: dict[fx.Node, fx.Node] = {}
    for i in inputs:
        env[i] = graph.placeholder(i.name)
        env[i].meta = dict(i.meta)
    for n in nodes:
        if n.op == "call_module":  # an expert-parallel layer: replayed whole (its exchanges included)
            _copy_attr(gm, root, n.target)
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[o] for o in outputs))
    return graph_module(root, graph)


def _copy_attr(src: torch.nn.Module, dst: torch.nn.Module, target: str) -> None:
    *path, name = target.split(".")
    for part in path:
        src = getattr(src, part)
        if not hasattr(dst, part):
            dst.add_module(part, torch.nn.Module())
        dst = getattr(dst, part)
    value = getattr(src, name)
    if isinstance(value, torch.nn.Module):
        dst.add_module(name, value)
    else:
        setattr(dst, name, value)


def _free_name(root: torch.nn.Module, base: str) -> str:
    name, k = base, 1
    while hasattr(root, name):
        name, k = f"{base}_{k}", k + 1
    return name
