"""Expert parallelism: each mixture-of-experts layer's dense dispatch becomes one ``ExpertParallel`` call.

Precondition: the captured graph with its expert loops in dense form (``passes/expert_loops.py``). For a
routing ``I = topk(scores, k)[1]`` (T, k), routing weights ``W`` (T, k) and every expert ``e`` of ``E``:

    M_e   = eq(I, e)                                       # (T, k): the slots that picked e
    y_e   = f_e(x)                                         # (T, H): expert e on every token
    acc_e = acc_{e-1} + where(any(M_e, 1), y_e * sum(W * M_e, 1)[:, None], 0)

``expert_parallel`` finds each such layer (the region from the top-k to the last ``acc``), copies each
expert's computation ``f_e`` (the nodes between ``x`` and ``y_e``, with the parameters they read) into a
graph of its own, and replaces the region by ``acc_0 + ExpertParallel(x, I, W, *params)``
(``autopar/core/expert_ops.py``): tokens sorted by expert, sent to the rank holding it and back over ``ep``.
The router, the weights and everything outside the region are untouched, so their gradients (the
load-balancing loss's included) are the model's.

Postcondition: one graph for every rank (each reads its ep index at run time); each expert's parameters are
one expert's whole tensors or stacked (E, ...) tensors read as row ``e`` (recorded as ``ExpertParam``).
Invariant: forward and backward equal the dense form up to the order of floating-point sums.
A region this pass cannot prove equal, or ``E`` not divisible by ``ep``, raises ``UnsupportedError`` naming
the module and the numbers.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.core.errors import UnsupportedError
from autopar.core.expert_layout import ExpertLayer, ExpertParam
from autopar.core.expert_ops import ExpertParallel
from autopar.core.graph import Captured, copy_module
from autopar.core.mesh import Mesh
from autopar.core.plan import Collective, Plan
from autopar.passes.expert_graph import CONVERSIONS, VIEWS, ancestors as _ancestors, check_rowwise, \
    descendants as _descendants
from autopar.passes.expert_grouped import grouped_sort, rewrite_grouped
from autopar.passes.expert_loops import MASKS, module_name
from autopar.passes.lazy_module import graph_module

aten = torch.ops.aten


@dataclass
class _Expert:
    """Expert ``e`` of a region: its output ``y`` and the ``add`` that accumulates it."""

    e: int
    y: fx.Node
    add: fx.Node
    checks: list[fx.Node]  # metadata asserts of its weighted rows (``.to(dtype)``), which go with them


@dataclass(frozen=True)
class ExpertParallelGraph:
    """The rewritten graph, each layer's experts and each expert parameter's placement."""

    gm: fx.GraphModule
    layers: list[ExpertLayer]
    params: dict[str, ExpertParam]
    rows: dict[str, tuple[int, int, int]]  # layer -> (tokens, top-k, bytes of one token's row) per microbatch

    def add_to(self, plan: Plan) -> None:
        """The layers, where each parameter lives, and the all-to-alls per step (bytes for balanced routing)."""
        plan.experts, plan.expert_params = tuple(self.layers), dict(self.params)
        m, ep = plan.microbatches, plan.mesh.ep
        counts = sum(ep * layer.local * 8 for layer in self.layers)
        moved = sum(t * k * row for t, k, row in self.rows.values())  # rows each rank sends, itself included
        n = len(self.layers) * m
        plan.collectives += [
            Collective("ep", "all_to_all", n, counts * m, "forward, each layer's rows per expert", "forward"),
            Collective("ep", "all_to_all_v", 2 * n, 2 * moved * m, "forward, tokens to their experts and back "
                       "(variable splits; bytes for balanced routing)", "forward"),
            Collective("ep", "all_to_all_v", 2 * n, 2 * moved * m, "backward, the same with the splits reversed",
                       "backward"),
        ]


def expert_parallel(cap: Captured, ep: int) -> ExpertParallelGraph:
    """Every mixture-of-experts layer of ``cap`` over ``ep`` ranks (see the module doc); ``cap`` is unchanged."""
    gm = copy_module(cap.gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kinds = {n: s for n, s in zip(placeholders, cap.slots)}
    data = _depends_on_inputs(gm, {n for n, s in kinds.items() if s.kind == "input"})
    layers, params, rows = [], {}, {}
    for topk in [n for n in gm.graph.nodes if n.target is aten.topk.default]:
        indices = next((u for u in topk.users if u.target is operator.getitem and u.args[1] == 1), None)
        masks = {u.args[1]: u for u in (indices.users if indices is not None else ()) if u.target in MASKS
                 and isinstance(u.args[1], int)}
        sort = grouped_sort(indices) if indices is not None and not masks else None
        if masks or sort is not None:
            layer, placed, x = (_rewrite(gm, len(layers), indices, masks, ep, kinds, data) if masks else
                                rewrite_grouped(gm, len(layers), indices, sort, ep, kinds, data))
            layers.append(layer)
            params.update(placed)
            val = x.meta["val"]
            rows[layer.name] = (val.shape[0], layer.top_k, val[0].numel() * val.element_size())
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return ExpertParallelGraph(gm, layers, params, rows)


def _rewrite(gm: fx.GraphModule, number: int, indices: fx.Node, masks: dict[int, fx.Node], ep: int,
             kinds: dict, data: set[fx.Node]) -> tuple[ExpertLayer, dict[str, ExpertParam], fx.Node]:
    where = module_name(next(iter(masks.values())))
    t, k = indices.meta["val"].shape
    n = indices.args[0].args[0].meta["val"].shape[-1]  # the scores the top-k picks from: (T, E)
    if sorted(masks) != list(range(n)):
        raise _refused(where, f"the loop selects experts {sorted(masks)} of the router's {n}")
    if n % ep:
        fits = [d for d in range(1, n + 1) if n % d == 0]
        raise UnsupportedError(f"module {where}: {n} experts do not divide by ep={ep}; use ep in {fits} "
                               f"(dp a multiple of it), or a mesh without ep")
    weights, experts = None, []
    for e in range(n):
        w, expert = _expert(masks[e], e, where)
        if weights is not None and w is not weights:
            raise _refused(where, f"experts 0 and {e} are weighted by different tensors ({weights.name}, {w.name})")
        weights = w
        experts.append(expert)
    x = _expert_input([ex.y for ex in experts], data, where)
    if tuple(x.meta["val"].shape[:1]) != (t,):
        raise _refused(where, f"the experts' input {x.name} has shape {tuple(x.meta['val'].shape)}, not ({t}, ...)")
    first, last = _chain(experts, where)
    after_x = _descendants(x)
    bodies = [_body(ex, x, after_x, data, where) for ex in experts]
    placed = _classify(bodies, kinds, n, where)
    union = list(dict.fromkeys(p for body in bodies for p in body[1]))
    subs = [_subgraph(gm, body, x, ex.y, placed, n // ep) for body, ex in zip(bodies, experts)]
    uses = [[union.index(p) for p in body[1]] for body in bodies]
    dtype = last.meta["val"].dtype
    module = ExpertParallel(where, subs, uses, ep, dtype)
    name = f"expert_parallel_{number}"
    gm.add_submodule(name, module)
    with gm.graph.inserting_after(last):
        call = gm.graph.call_module(name, (x, indices, weights, *union))
    with gm.graph.inserting_after(call):
        total = gm.graph.call_function(aten.add.Tensor, (first, call))
    last.replace_all_uses_with(total)
    for check in (c for ex in experts for c in ex.checks):
        gm.graph.erase_node(check)
    call.meta["val"] = total.meta["val"] = last.meta["val"]
    call.meta["nn_module_stack"] = total.meta["nn_module_stack"] = last.meta.get("nn_module_stack", {})
    names = tuple(kinds[p].name for p in union)
    layer = ExpertLayer(where, n, k, ep, names)
    return layer, {kinds[p].name: ExpertParam(where, n, ep, placed[p]) for p in union}, x


def _expert(mask: fx.Node, e: int, where: str) -> tuple[fx.Node, _Expert]:
    """The routing weights and expert ``e``'s output and accumulation, from the dense form's uses of its mask."""
    routed = [u for u in mask.users if u.target is aten.any.dim]
    others = [u for u in mask.users if u not in routed]
    if len(routed) != 1 or len(others) != 1:
        raise _refused(where, f"the mask of expert {e} ({mask.name}) is used by "
                              f"{[u.format_node() for u in mask.users]}, not by a dense expert dispatch")
    picked = others[0]
    while picked.target in VIEWS:
        picked = _single_user(picked, where)
    if picked.target is not aten.mul.Tensor:
        raise _refused(where, f"expert {e}'s slots pick {picked.format_node()}, not its routing weight")
    weights = _unviewed(picked.args[0])  # (T, k) (the dense form picks from a view of it with trailing 1s)
    total = _single_user(picked, where)
    if total.target is not aten.sum.dim_IntList or list(total.args[1]) != [1]:
        raise _refused(where, f"expert {e}'s routing weight is {total.format_node()}, not a sum over the slots")
    kept = _single_user(routed[0], where)
    while kept.target in VIEWS:
        kept = _single_user(kept, where)
    add = _single_user(kept, where)
    if kept.target is not aten.where.ScalarOther or add.target is not aten.add.Tensor or add.args[1] is not kept:
        raise _refused(where, f"expert {e}'s output reaches {kept.format_node()}, not an accumulation of its rows")
    src = kept.args[1]
    checks = [u for u in src.users if u.target is aten._assert_tensor_metadata.default]
    while src.target in CONVERSIONS:
        src = src.args[0]
        checks += [u for u in src.users if u.target is aten._assert_tensor_metadata.default]
    if src.target is not aten.mul.Tensor:
        raise _refused(where, f"expert {e}'s rows are {src.format_node()}, not its output times its weight")
    a, b = src.args
    y, w = (a, b) if _reaches(b, total) else (b, a)
    if _unviewed(w) is not total or _reaches(y, total) or len(y.users) != 1:
        raise _refused(where, f"expert {e}'s rows {src.format_node()} are not its output times its routing weight")
    return weights, _Expert(e, y, add, checks)


def _chain(experts: list[_Expert], where: str) -> tuple[fx.Node, fx.Node]:
    """(acc_0, the last acc): the accumulations must chain through every expert once."""
    adds = {ex.add for ex in experts}
    starts = [ex.add.args[0] for ex in experts if ex.add.args[0] not in adds]
    ends = [ex.add for ex in experts if not any(u in adds for u in ex.add.users)]
    inner = [a for a in adds if a not in ends and len(a.users) != 1]
    if len(starts) != 1 or len(ends) != 1 or inner:
        raise _refused(where, "the experts' outputs are not added up in one chain "
                              f"(starts {[s.name for s in starts]}, ends {[e.name for e in ends]})")
    return starts[0], ends[0]


def _expert_input(outputs: list[fx.Node], data: set[fx.Node], where: str) -> fx.Node:
    """The tensor every expert reads: the last node that depends on the inputs and precedes every output."""
    common = set.intersection(*(_ancestors(y) for y in outputs)) & data
    if not common:
        raise _refused(where, "the experts read no common input")
    order = {nd: i for i, nd in enumerate(outputs[0].graph.nodes)}
    return max(common, key=order.__getitem__)


def _body(ex: _Expert, x: fx.Node, after_x: set[fx.Node], data: set[fx.Node],
          where: str) -> tuple[list[fx.Node], list[fx.Node]]:
    """Expert ``ex``'s nodes (in graph order) between ``x`` and ``y``, with the parameter-only nodes they read,
    and the placeholders (parameters) they read."""
    rows = (_ancestors(ex.y) | {ex.y}) & after_x
    nodes, placeholders = set(rows), []
    stack = [a for nd in rows for a in nd.all_input_nodes if a not in rows and a is not x]
    while stack:
        nd = stack.pop()
        if nd in nodes or nd in placeholders:
            continue
        if nd in data:
            raise _refused(where, f"expert {ex.e} reads {nd.name}, which depends on the inputs but is not the "
                                  f"experts' input {x.name}")
        if nd.op == "placeholder":
            placeholders.append(nd)
            continue
        nodes.add(nd)
        stack.extend(nd.all_input_nodes)
    for nd in rows:
        check_rowwise(nd, rows | {x}, ex.e, where, _refused)
        outside = [u for u in nd.users if u not in nodes and nd is not ex.y]
        if outside:
            raise _refused(where, f"expert {ex.e}'s {nd.name} is also used by {outside[0].format_node()}")
    order = list(ex.y.graph.nodes)
    return sorted(nodes, key=order.index), sorted(placeholders, key=order.index)


def _classify(bodies: list, kinds: dict, n: int, where: str) -> dict[fx.Node, int | None]:
    """Each parameter the experts read -> its expert (one expert's tensor) or None (stacked (E, ...))."""
    readers: dict[fx.Node, list[int]] = {}
    for e, (nodes, placeholders) in enumerate(bodies):
        for p in placeholders:
            readers.setdefault(p, []).append(e)
    out = {}
    for p, experts in readers.items():
        if kinds[p].kind != "param":
            raise _refused(where, f"the experts read the {kinds[p].kind} {kinds[p].name}; only parameters can be "
                                  "placed with their experts")
        if len(experts) == 1 and all(u in bodies[experts[0]][0] for u in p.users):
            out[p] = experts[0]
        elif len(experts) == n and p.meta["val"].shape[0] == n and all(
                u.target is aten.select.int and u.args[1] == 0 and u in bodies[u.args[2]][0] for u in p.users):
            out[p] = None
        else:
            raise _refused(where, f"parameter {kinds[p].name} is read by experts {experts} (and "
                                  f"{len(p.users)} nodes), neither one expert's tensor nor row e of a stacked (E={n}, "
                                  "...) tensor for each expert e")
    return out


def _subgraph(gm: fx.GraphModule, body: tuple, x: fx.Node, y: fx.Node, placed: dict, local: int) -> fx.GraphModule:
    """Expert ``f_e`` as a graph ``(rows, *its parameters) -> rows``; a stacked parameter is read at its local
    row ``e % (E/ep)``."""
    nodes, placeholders = body
    graph = fx.Graph()
    env = {x: graph.placeholder("rows")}
    for p in placeholders:
        env[p] = graph.placeholder(p.name)
    for nd in nodes:
        copied = graph.node_copy(nd, env.__getitem__)
        if nd.target is aten.select.int and nd.args[0] in placed and placed[nd.args[0]] is None:
            copied.args = (copied.args[0], 0, nd.args[2] % local)
        env[nd] = copied
    graph.output(env[y])
    return graph_module(gm, graph)


def _depends_on_inputs(gm: fx.GraphModule, inputs: set[fx.Node]) -> set[fx.Node]:
    out = set(inputs)
    for nd in gm.graph.nodes:
        if any(a in out for a in nd.all_input_nodes):
            out.add(nd)
    return out


def _unviewed(node: object) -> object:
    """``node`` without the trailing dims of size 1 that ``unsqueeze`` added."""
    while isinstance(node, fx.Node) and node.target is aten.unsqueeze.default:
        node = node.args[0]
    return node


def _reaches(node: object, target: fx.Node) -> bool:
    return isinstance(node, fx.Node) and (node is target or target in _ancestors(node))


def _single_user(node: fx.Node, where: str) -> fx.Node:
    if len(node.users) != 1:
        raise _refused(where, f"{node.format_node()} has {len(node.users)} users where the dense dispatch has one")
    return next(iter(node.users))


def recomputed_exchanges(plan: Plan, recomputed: set[str]) -> list[Collective]:
    """The exchanges a step repeats when backward recomputes expert layers: the forward's counts and token
    all-to-alls once more per recomputed layer (``recomputed``: the layers recomputation replays)."""
    layers = [x for x in plan.experts if any(x.name.split(" ")[0] == la or x.name.startswith(la + ".")
                                             for la in recomputed)]
    if not layers:
        return []
    share = len(layers) / len(plan.experts)
    return [dataclasses.replace(c, count=round(c.count * share), bytes=round(c.bytes * share),
                                what=f"recomputation: {c.what}", direction="backward")
            for c in plan.collectives if c.axis == "ep" and c.direction == "forward"]


def per_pp_rank(plan: Plan, stages: list, stage_to_rank: list[int]) -> None:
    """Under a pipeline the plan's ep exchanges are those of the pp rank running the most MoE layers (its
    stages' expert-parallel calls), not of every layer."""
    if not plan.experts:
        return
    per_rank: dict[int, int] = {}
    for st in stages:
        calls = sum(1 for nd in st.gm.graph.nodes if nd.op == "call_module"
                    and isinstance(st.gm.get_submodule(nd.target), ExpertParallel))
        per_rank[stage_to_rank[st.index]] = per_rank.get(stage_to_rank[st.index], 0) + calls
    share = max(per_rank.values()) / len(plan.experts)
    plan.collectives = [dataclasses.replace(c, count=round(c.count * share), bytes=round(c.bytes * share))
                        if c.axis == "ep" else c for c in plan.collectives]


def check_composes(mesh: Mesh, *, zero: int = 0, precision: str = "fp32", recompute: object = "none") -> None:
    """Refuses, naming the numbers, what expert parallelism does not compose with (never a wrong result): nothing
    today. ZeRO, hybrid sharding (``Mesh`` checks that ep divides the shard size), precision and recomputation
    all compose with it; they are accepted so that a caller can ask about a whole configuration."""


def no_experts_found(model: torch.nn.Module, ep: int) -> UnsupportedError:
    """The error for ``ep > 1`` on a model without a routed-experts layer this pass recognises."""
    stacked = [name for name, m in model.named_modules() if isinstance(getattr(m, "down_proj", None), torch.Tensor)]
    form = getattr(getattr(model, "config", None), "_experts_implementation", None)
    hint = (f"; its stacked experts ({', '.join(stacked[:2])}{', ...' if len(stacked) > 2 else ''}) run as "
            f"{form!r}: set model.config._experts_implementation = 'grouped_mm' (Hugging Face's default) or "
            "'eager'") if stacked else ""
    return UnsupportedError(f"ep={ep}, but {type(model).__name__} has no routed-experts layer expert parallelism "
                            f"recognises (a top-k router, a loop over its experts or a grouped matmul over them, a "
                            f"weighted combine){hint}; or use a mesh without ep")


def _refused(where: str, why: str) -> UnsupportedError:
    return UnsupportedError(f"expert parallelism cannot take the experts of module {where}: {why}; run without ep "
                            "(the experts then run on every rank), or write the layer as a top-k router and a loop "
                            "over its experts combined with index_add")
