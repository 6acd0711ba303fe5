"""Expert parallelism for Hugging Face's grouped-matmul experts (``_experts_implementation`` "grouped_mm", its default).

Precondition: the captured graph. For a routing ``I = topk(scores, k)[1]`` (T, k) and routing weights ``W`` (T, k),
Hugging Face's grouped form of one layer (``grouped_mm_experts_forward``) is captured as

    ids, perm = sort(I.reshape(-1))
    rows      = x[perm // k]                          # (T*k, H): each (token, slot) pair's token, by expert
    offs      = cumsum(histc(ids, E, 0, E - 1))       # one past each expert's last row
    y         = f(rows, *stacked weights, offs)       # grouped matmuls (and the gate between them)
    out       = (y * W.reshape(-1)[perm][:, None])[inverse(perm)].view(T, k, H).sum(1)

``rewrite_grouped`` replaces ``out`` by ``GroupedExpertParallel(x, I, W, *weights)`` (``autopar/core/expert_ops.py``):
the loop form's sort, counts and all-to-alls, then ``f`` once over the rows this rank received, ordered by its
local expert, with its E/ep rows of each stacked weight and offsets counted from what it received. The router,
``W`` and everything outside the region are untouched.

Postcondition: as ``passes/expert_parallel.py``'s (every weight ``f`` reads is stacked (E, ...), held as
``Shard(0)`` over ep). Invariant: forward and backward equal the captured form up to the order of floating-point
sums (a token's k expert outputs are added in expert order, not slot order). A region that differs from this
shape raises ``UnsupportedError`` naming the module and what differs.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar.core.errors import UnsupportedError
from autopar.core.expert_layout import ExpertLayer, ExpertParam
from autopar.core.expert_ops import GroupedExpertParallel
from autopar.passes.expert_loops import module_name
from autopar.passes.expert_graph import VIEWS, ancestors as _ancestors, check_rowwise, \
    descendants as _descendants
from autopar.passes.lazy_module import graph_module

aten = torch.ops.aten


def grouped_ops() -> set:
    """The grouped matmuls a capture may hold: torch's and Hugging Face's fallback (registered by transformers)."""
    ops = {aten._grouped_mm.default}
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    return ops | ({fallback.default} if fallback is not None else set())


def grouped_sort(indices: fx.Node) -> fx.Node | None:
    """The ``sort`` of the flattened top-k indices that starts a grouped-form layer, if ``indices`` has one."""
    for flat in indices.users:
        if flat.target in VIEWS:
            sort = next((u for u in flat.users if u.target is aten.sort.default), None)
            if sort is not None:
                return sort
    return None


def rewrite_grouped(gm: fx.GraphModule, number: int, indices: fx.Node, sort: fx.Node, ep: int, kinds: dict,
                    data: set[fx.Node]) -> tuple[ExpertLayer, dict[str, ExpertParam], fx.Node]:
    """The layer of ``sort`` over ``ep`` ranks (see the module doc): its layer, parameters and experts' input."""
    where = module_name(sort)
    t, k = indices.meta["val"].shape
    n = indices.args[0].args[0].meta["val"].shape[-1]  # the scores the top-k picks from: (T, E)
    if n % ep:
        fits = [d for d in range(1, n + 1) if n % d == 0]
        raise UnsupportedError(f"module {where}: {n} experts do not divide by ep={ep}; use ep in {fits} "
                               f"(dp a multiple of it), or a mesh without ep")
    ids, perm = (_item(sort, i, where) for i in (0, 1))
    rows, picked, inverse = _uses_of_perm(perm, k, where)
    x, w_flat = rows.args[0], picked.args[0]
    weighted = _single(_single(picked, where), where)  # (W[perm] unsqueezed, then y * it)
    if weighted.target is not aten.mul.Tensor:
        raise _refused(where, f"the sorted routing weights reach {weighted.format_node()}, not a product with the "
                              "experts' output")
    y = weighted.args[0] if weighted.args[1] in picked.users else weighted.args[1]
    out = _combine(weighted, inverse, (t, k), where)
    body, params, offs = _body(rows, y, ids, kinds, data, n, where)
    sub = _subgraph(gm, body, rows, y, params, offs)
    module = GroupedExpertParallel(where, sub, n, ep, out.meta["val"].dtype)
    name = f"expert_parallel_{number}"
    gm.add_submodule(name, module)
    with gm.graph.inserting_after(out):
        weights = gm.graph.call_function(aten.reshape.default, (w_flat, [t, k]))
    with gm.graph.inserting_after(weights):
        call = gm.graph.call_module(name, (x, indices, weights, *params))
    call.meta["val"], weights.meta["val"] = out.meta["val"], w_flat.meta["val"].reshape(t, k)
    call.meta["nn_module_stack"] = out.meta.get("nn_module_stack", {})
    out.replace_all_uses_with(call)
    _erase_region(gm, sort, out)
    names = tuple(kinds[p].name for p in params)
    layer = ExpertLayer(where, n, k, ep, names)
    return layer, {kinds[p].name: ExpertParam(where, n, ep, None) for p in params}, x


def _uses_of_perm(perm: fx.Node, k: int, where: str) -> tuple[fx.Node, fx.Node, fx.Node]:
    """(rows ``x[perm // k]``, sorted weights ``W[perm]``, the inverse permutation) from the uses of ``perm``."""
    rows = picked = inverse = None
    for u in perm.users:
        if u.target is aten.floor_divide.default and u.args[1] == k and len(u.users) == 1:
            rows = next(iter(u.users))
        elif u.target is aten.index.Tensor and list(u.args[1]) == [perm]:
            picked = u
        elif u.target is aten.index_put_.default and list(u.args[1]) == [perm]:
            inverse = u
    if rows is None or rows.target is not aten.index.Tensor or picked is None or inverse is None:
        raise _refused(where, f"the sorted order {perm.name} is used by {[u.format_node() for u in perm.users]}, "
                              "not to pick each pair's token, its weight and the way back")
    return rows, picked, inverse


def _combine(weighted: fx.Node, inverse: fx.Node, shape: tuple[int, int], where: str) -> fx.Node:
    """The per-token sum ``weighted[inverse].view(T, k, H).sum(1)``."""
    back = _single(weighted, where)
    view = _single(back, where) if back.target is aten.index.Tensor and list(back.args[1]) == [inverse] else back
    total = _single(view, where) if view.target in VIEWS else view
    if (total.target is not aten.sum.dim_IntList or list(total.args[1]) != [1]
            or tuple(view.meta["val"].shape[:2]) != shape):
        raise _refused(where, f"the weighted rows reach {total.format_node()}, not a sum over each token's "
                              f"{shape[1]} slots in token order")
    return total


def _body(rows: fx.Node, y: fx.Node, ids: fx.Node, kinds: dict, data: set[fx.Node], n: int,
          where: str) -> tuple[list[fx.Node], list[fx.Node], fx.Node]:
    """The experts' nodes between ``rows`` and ``y`` (with the parameter-only nodes they read), the stacked
    parameters they read, and the offsets."""
    grouped = grouped_ops()
    inner = (_ancestors(y) | {y}) & _descendants(rows)
    offs = {a for nd in inner if nd.target in grouped for a in [_offsets(nd)]}
    if len(offs) != 1 or ids not in _ancestors(next(iter(offs))) or not any(nd.target in grouped for nd in inner):
        raise _refused(where, f"its grouped matmuls read offsets {[o.name for o in offs]}, not one count of the "
                              "sorted expert ids")
    (off,) = offs
    nodes, params, stack = set(inner), [], [a for nd in inner for a in nd.all_input_nodes]
    while stack:
        nd = stack.pop()
        if nd in nodes or nd in params or nd is rows or nd is off:
            continue
        if nd in data:
            raise _refused(where, f"its experts read {nd.name}, which depends on the inputs but is not their rows")
        if nd.op == "placeholder":
            if kinds[nd].kind != "param" or nd.meta["val"].shape[0] != n:
                raise _refused(where, f"its experts read {kinds[nd].name}, not a stacked (E={n}, ...) parameter")
            params.append(nd)
            continue
        nodes.add(nd)
        stack.extend(nd.all_input_nodes)
    for nd in inner:
        if nd.target not in grouped:
            check_rowwise(nd, inner | {rows}, 0, where, _refused)
        elif nd.args[0] not in inner | {rows} or nd.args[1] in inner:
            raise _refused(where, f"{nd.format_node()} does not multiply the rows by stacked weights")
    order = {nd: i for i, nd in enumerate(y.graph.nodes)}
    outside = [u for nd in nodes if nd is not y for u in nd.users if u not in nodes and not _is_check(u)]
    if outside:
        raise _refused(where, f"its experts' {outside[0].format_node()} is used outside them")
    return sorted(nodes, key=order.__getitem__), sorted(params, key=order.__getitem__), off


def _offsets(grouped: fx.Node) -> fx.Node:
    return grouped.kwargs["offs"] if "offs" in grouped.kwargs else grouped.args[2]


def _subgraph(gm: fx.GraphModule, nodes: list[fx.Node], rows: fx.Node, y: fx.Node, params: list[fx.Node],
              offs: fx.Node) -> fx.GraphModule:
    """``f`` as a graph ``(rows, *stacked parameters, offsets) -> rows``."""
    graph = fx.Graph()
    env = {rows: graph.placeholder("rows")}
    for p in params:
        env[p] = graph.placeholder(p.name)
    env[offs] = graph.placeholder("offsets")
    for nd in nodes:
        env[nd] = graph.node_copy(nd, env.__getitem__)
    graph.output(env[y])
    return graph_module(gm, graph)


def _erase_region(gm: fx.GraphModule, sort: fx.Node, out: fx.Node) -> None:
    """The replaced nodes from ``sort`` to ``out`` and the metadata checks on them (``index_put_`` and the
    checks are not pure, so dead code elimination keeps them)."""
    region = (_descendants(sort) & _ancestors(out)) | {sort, out}
    order = list(gm.graph.nodes)
    doomed = [nd for nd in order if nd in region or (_is_check(nd) and nd.args[0] in region)]
    for nd in reversed(doomed):
        if not nd.users:
            gm.graph.erase_node(nd)


def _is_check(nd: fx.Node) -> bool:
    return nd.target is aten._assert_tensor_metadata.default


def _item(node: fx.Node, i: int, where: str) -> fx.Node:
    found = [u for u in node.users if u.target is operator.getitem and u.args[1] == i]
    if len(found) != 1:
        raise _refused(where, f"{node.format_node()} has {len(found)} uses of its output {i}")
    return found[0]


def _single(node: fx.Node, where: str) -> fx.Node:
    users = [u for u in node.users if not _is_check(u)]
    if len(users) != 1:
        raise _refused(where, f"{node.format_node()} has {len(users)} users where the grouped form has one")
    return users[0]


def _refused(where: str, why: str) -> UnsupportedError:
    return UnsupportedError(f"expert parallelism cannot take the grouped experts of module {where}: {why}; set "
                            "model.config._experts_implementation = 'eager' (a loop over the experts), or run "
                            "without ep")
