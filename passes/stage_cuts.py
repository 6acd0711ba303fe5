"""Pipeline stage cutting: one captured graph -> ``n`` stage graphs.

``choose_split_points`` picks cuts at module boundaries (the first node of a
module in the user's model) — between the entries of module lists, such as
transformer layers, when there are enough of them — balancing estimated FLOPs
per stage and, among nearly balanced cuts, preferring the one where the fewest
bytes cross.
``split_stages`` cuts at given module names. Cuts are named by module so that
every graph of the same model (with or without the loss, any batch size) is cut
the same way and each parameter lives on the same stages.

Invariant: the stages composed compute what the graph computes. Stage ``s``
receives ``boundary[s-1]`` (every value made before the cut and used after it,
in graph order) and returns ``boundary[s]`` (then, on the last stage, the
graph's outputs). A value needed several stages later is relayed through the
stages between, so in backward its gradient is the sum of every consumer's
contribution. A parameter used by several stages is a placeholder of each.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from autopar.core.errors import UnsupportedError
from autopar.core.graph import PREFIX, Boundary, Captured, Slot, SlotKind, StageGraph
from autopar.passes.cost import annotate_costs, requires_grad, tensor_bytes
from autopar.passes.lazy_module import graph_module


def module_path(node: fx.Node) -> list[str]:
    """The user-model module paths enclosing ``node``, outermost first (the capture wrapper stripped)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for path, _ in stack.values()]
    return [p.removeprefix(PREFIX) for p in paths if p.startswith(PREFIX)]


def node_layer(node: fx.Node) -> str | None:
    """``"transformer.h.3"`` for a node inside entry 3 of a module list, else None."""
    for path in module_path(node):
        parts = path.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                return ".".join(parts[: i + 1])
    return None


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_module")]  # (modules: expert layers)


def module_starts(gm: fx.GraphModule) -> dict[str, int]:
    """``{module path: index of its first node}`` among the graph's compute nodes."""
    starts: dict[str, int] = {}
    for i, node in enumerate(_compute_nodes(gm)):
        for path in module_path(node):
            starts.setdefault(path, i)
    return starts


def _crossing_bytes(nodes: list[fx.Node]) -> list[int]:
    """``out[p]``: bytes of values made before compute node ``p`` and used at or after it."""
    index = {n: i for i, n in enumerate(nodes)}
    delta = [0] * (len(nodes) + 2)
    for i, node in enumerate(nodes):
        last = max((index[u] for u in node.users if u in index), default=-1)
        if last > i:
            b = tensor_bytes(node.meta.get("val"))
            delta[i + 1] += b
            delta[last + 1] -= b
    out, run = [], 0
    for p in range(len(nodes)):
        run += delta[p]
        out.append(run)
    return out


def choose_split_points(gm: fx.GraphModule, n_stages: int) -> list[str]:
    """``n_stages - 1`` module names to cut before, balancing FLOPs, preferring few crossing bytes."""
    if n_stages == 1:
        return []
    annotate_costs(gm)
    nodes = _compute_nodes(gm)
    starts = module_starts(gm)
    by_position: dict[int, str] = {}
    for path, pos in sorted(starts.items(), key=lambda kv: len(kv[0])):
        if pos > 0:
            by_position.setdefault(pos, path)  # the outermost module starting there names the cut
    candidates = sorted(by_position)
    layers = [c for c in candidates if by_position[c].rsplit(".", 1)[-1].isdigit()]
    if len(layers) >= n_stages - 1:
        candidates = layers  # cut between the entries of module lists (transformer layers) when there are enough
    if len(candidates) < n_stages - 1:
        raise ValueError(
            f"cannot cut the model into {n_stages} stages: its graph has only {len(candidates)} module boundaries "
            f"to cut at ({len(candidates) + 1} stages at most); use fewer stages (pp or stages per rank)"
        )
    weights = [node.meta["autopar.cost"].flops for node in nodes]
    chosen = balanced_cuts(weights, candidates, n_stages, _crossing_bytes(nodes))
    return [by_position[c] for c in chosen]


def balanced_cuts(weights: list[Any], candidates: list[int], n: int, crossing: list[int] | None = None) -> list[int]:
    """``n - 1`` cut positions (indices into ``weights``, ascending, from ``candidates``): the ``k``-th nearest
    ``k / n`` of the total weight before it, leaving a candidate for every later cut.

    With ``crossing`` (the bytes that cross each position), among the candidates within a quarter of a
    stage's weight of the ideal, the one where the fewest bytes cross.
    """
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    total = prefix[-1] or 1
    chosen: list[int] = []
    for k in range(1, n):
        lo = chosen[-1] if chosen else 0
        pool = [c for c in candidates if c > lo]
        pool = pool[: len(pool) - (n - 1 - k)]  # leave a candidate for every later cut
        ideal = total * k / n
        window = [c for c in pool if abs(prefix[c] - ideal) <= 0.25 * total / n] if crossing is not None else []
        if window:
            chosen.append(min(window, key=lambda c: (crossing[c], abs(prefix[c] - ideal))))
        else:
            chosen.append(min(pool, key=lambda c: abs(prefix[c] - ideal)))
    return chosen


def assign_stages(gm: fx.GraphModule, split_points: list[str]) -> dict[fx.Node, int]:
    """The stage of every compute node: how many cuts precede it (multi-output ops keep their getitems)."""
    starts = module_starts(gm)
    missing = [s for s in split_points if s not in starts]
    if missing:
        known = [p for p in starts if p.count(".") <= 2][:12]
        raise ValueError(f"split point {missing[0]!r} names no module of the model; modules include {known}")
    cuts = [starts[s] for s in split_points]
    if cuts != sorted(set(cuts)):
        raise ValueError(f"split points {split_points} must name modules in execution order, each starting later")
    stage: dict[fx.Node, int] = {}
    nodes = _compute_nodes(gm)
    for i, node in enumerate(nodes):
        stage[node] = sum(c <= i for c in cuts)
    for node in reversed(nodes):  # nodes a pass inserted (no module of the user's) join their first consumer
        if not module_path(node) and node.target is not operator.getitem:
            later = [stage[u] for u in node.users if u in stage]
            if later:
                stage[node] = max(stage[node], min(later))
    for node in nodes:
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0] in stage:
            stage[node] = stage[node.args[0]]
    return stage


def split_stages(cap: Captured, split_points: list[str], trainable: set[str]) -> list[StageGraph]:
    """Cuts ``cap.gm`` before each module of ``split_points``; ``trainable``: names of parameters with grads."""
    if cap.updated_buffers:
        raise UnsupportedError(f"the model updates buffers in forward ({', '.join(cap.updated_buffers[:3])}), which "
                               f"pipelines do not support; use pp=1, or put the modules that update them in eval mode")
    gm = cap.gm
    n = len(split_points) + 1
    stage = assign_stages(gm, split_points)
    rg = requires_grad(gm, {nd for nd, sl in zip(_placeholders(gm), cap.slots)
                            if sl.kind is SlotKind.PARAM and sl.name in trainable})
    placeholders = [nd for nd in gm.graph.nodes if nd.op == "placeholder"]
    slot_of = dict(zip(placeholders, cap.slots))
    boundaries: list[list[fx.Node]] = []
    for s in range(n - 1):
        values = [nd for nd in stage if stage[nd] <= s and any(stage.get(u, n - 1) > s for u in nd.users)]
        for nd in values:
            if not isinstance(nd.meta.get("val"), torch.Tensor):
                raise NotImplementedError(f"a non-tensor value ({nd.name}) crosses the cut before stage {s + 1}")
        boundaries.append(values)
    output = next(nd for nd in gm.graph.nodes if nd.op == "output")
    stages = []
    for s in range(n):
        recv = boundaries[s - 1] if s > 0 else []
        send = boundaries[s] if s < n - 1 else []
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        slots: list[Slot] = []

        def lookup(node: fx.Node) -> fx.Node:
            if node not in env:  # a parameter, buffer, constant or user input this stage uses
                slot = slot_of[node]
                env[node] = graph.placeholder(node.name)
                env[node].meta = dict(node.meta)
                slots.append(slot)
            return env[node]

        for nd in recv:
            env[nd] = graph.placeholder(nd.name)
            env[nd].meta = dict(nd.meta)
        for nd in [nd for nd in gm.graph.nodes if stage.get(nd) == s]:
            for a in nd.all_input_nodes:
                if a.op == "placeholder":
                    lookup(a)
            env[nd] = graph.node_copy(nd, lambda a: env[a])
        if s == 0:
            for nd in _unused_parameters(placeholders, slot_of):
                lookup(nd)
        results = [env[nd] for nd in send]
        if s == n - 1:
            flat_out = list(output.args[0])
            results += [lookup(a) if isinstance(a, fx.Node) and a.op == "placeholder" else env.get(a, a)
                        for a in flat_out]
        graph.output(tuple(results))
        # placeholders must come first and in slot order: recv values go last
        recv_slots = [Slot(SlotKind.RECV, nd.name) for nd in recv]
        _move_recv_last(graph, len(recv))
        stage_gm = graph_module(_submodules(gm, graph), graph)
        stage_gm.graph.lint()
        stages.append(StageGraph(
            index=s, gm=stage_gm, slots=slots + recv_slots,
            recv=[_boundary(nd, rg) for nd in recv], send=[_boundary(nd, rg) for nd in send],
            is_last=s == n - 1, params=[sl.name for sl in slots if sl.kind is SlotKind.PARAM],
        ))
    return stages


def _unused_parameters(placeholders: list[fx.Node], slot_of: dict[fx.Node, Slot]) -> list[fx.Node]:
    """Parameters that no node of the graph reads (a module the forward never calls).

    The first stage holds them, unused, so that every parameter lives on some stage: the optimizer leaves
    them as they are (no gradient) and ``state_dict`` returns them, as on one device. In no stage, a rank
    would hold no tensor for them and ``state_dict`` would return uninitialized memory.
    """
    return [nd for nd in placeholders if slot_of[nd].kind is SlotKind.PARAM and not nd.users]


def _submodules(gm: fx.GraphModule, graph: fx.Graph) -> torch.nn.Module:
    """A root holding the modules of ``gm`` that ``graph`` calls (a stage's expert-parallel layers)."""
    root = torch.nn.Module()
    for nd in graph.nodes:
        if nd.op == "call_module":
            root.add_module(nd.target, gm.get_submodule(nd.target))
    return root


def _move_recv_last(graph: fx.Graph, n_recv: int) -> None:
    """Placeholders in slot order: those created on demand first, then the received values."""
    placeholders = [nd for nd in graph.nodes if nd.op == "placeholder"]
    recv, own = placeholders[:n_recv], placeholders[n_recv:]
    anchor = next(nd for nd in graph.nodes if nd.op != "placeholder")
    for nd in own + recv:
        anchor.prepend(nd)


def _boundary(node: fx.Node, rg: dict[fx.Node, bool]) -> Boundary:
    val = node.meta["val"]
    return Boundary(node.name, tuple(val.shape), val.dtype, bool(rg.get(node, False)))


def shared_parameters(stages: list[StageGraph], schedule: Any) -> dict[str, list[int]]:
    """Parameters used by stages on several pp ranks, with those ranks (their copies are kept in sync)."""
    holders: dict[str, set[int]] = {}
    for st in stages:
        for name in st.params:
            holders.setdefault(name, set()).add(schedule.stage_to_rank[st.index])
    return {name: sorted(r) for name, r in holders.items() if len(r) > 1}
