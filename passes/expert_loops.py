"""Data-dependent expert loops become dense dispatch with static shapes.

A mixture of experts written as a loop over its experts selects each expert's rows with
``torch.where(top_k_index == e)``: the number of rows is data-dependent (an unbacked size ``u`` in the
exported graph), which no sharding rule, cost or stage cut can reason about. ``densify_expert_loops``
finds every such selection and rewrites what it feeds to the same computation over all T tokens:

- the mask ``M = eq(I, e)`` must compare the indices of a ``topk`` (``I``: (T, k)) with a constant, so
  that each token selects expert ``e`` in at most one slot: that is what makes the dense form equal;
- ``x[tok]`` (rows of a (T, ...) tensor) becomes ``x``: the expert runs on every token;
- ``w[tok, slot]`` (a (T, k, ...) tensor) becomes ``sum_k(w * M)``: the token's weight for ``e``, 0 where
  the token did not pick ``e``;
- ``acc.index_add(0, tok, src)`` becomes ``acc + where(any_k(M), src, 0)``: a token that did not pick
  ``e`` adds exactly zero, forward and backward (its rows' gradients are exact zeros);
- the runtime checks of ``u``'s bounds (``sym_size``, ``_assert_scalar``) go.

Every other use of the selected indices, or a mask of another kind, is refused with a ``CaptureError``
naming the module and the numbers: the rewrite could not prove that no token is dropped or counted twice.
The dense form computes E/k times the expert FLOPs of the loop; it exists so that the graph is static.

Invariant: on every input the rewritten graph computes, forward and backward, what the loop computes, up to
the order of floating-point sums (each token's expert outputs are added in expert order as in the loop).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from autopar.core.errors import CaptureError

aten = torch.ops.aten
SELECTIONS = {aten.where.default, aten.nonzero_numpy.default}
MASKS = {aten.eq.Scalar, aten.eq.Tensor}
HINT = ("route with torch.topk and select each expert's rows with torch.where(top_k_index == e) "
        "(or index by them and combine with index_add), or use a static-shape dispatch")


def densify_expert_loops(gm: fx.GraphModule) -> int:
    """Rewrites every data-dependent expert selection of ``gm`` (see the module doc); returns how many."""
    selections = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SELECTIONS]
    for sel in selections:
        _densify(gm.graph, sel)
    if selections:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
        _propagate(gm)
    return len(selections)


def _densify(graph: fx.Graph, sel: fx.Node) -> None:
    mask = sel.args[0]
    where = module_name(sel)
    _check_mask(mask, where)
    t, k = mask.meta["val"].shape
    with graph.inserting_after(mask):
        routed = graph.call_function(aten.any.dim, (mask, 1))  # (T,): the token picked this expert
    positions = {}  # getitem node -> 0 (token) or 1 (slot)
    for use in list(sel.users):
        if use.target is not operator.getitem:
            raise _refused(where, f"the selection {sel.name} is used by {use.target} as a whole")
        positions[use] = use.args[1]
    for pos, dim in positions.items():
        for use in list(pos.users):
            _replace(graph, use, pos, dim, positions, mask, routed, (t, k), where)


def _replace(graph: fx.Graph, use: fx.Node, pos: fx.Node, dim: int, positions: dict, mask: fx.Node,
             routed: fx.Node, tk: tuple[int, int], where: str) -> None:
    if use.target is aten.sym_size.int:
        _erase_checks(graph, use)
        return
    with graph.inserting_before(use):
        lead = tuple(use.args[0].meta["val"].shape[:2]) if use.target is aten.index.Tensor else None
        if use.target is aten.index.Tensor and _indices(use) == [pos] and dim == 0 and lead[0] == tk[0]:
            use.replace_all_uses_with(use.args[0])  # x[tok] -> x: every token's row
        elif use.target is aten.index.Tensor and [positions.get(i) for i in _indices(use)] == [0, 1] and lead == tk:
            src = use.args[0]
            extra = src.meta["val"].dim() - 2
            m = mask
            for _ in range(extra):
                m = graph.call_function(aten.unsqueeze.default, (m, -1))
            picked = graph.call_function(aten.mul.Tensor, (src, m))
            use.replace_all_uses_with(graph.call_function(aten.sum.dim_IntList, (picked, [1])))
        elif use.target is aten.index_add.default and use.args[1] == 0 and use.args[2] is pos and dim == 0:
            acc, src = use.args[0], use.args[3]
            extra = src.meta["val"].dim() - 1
            r = routed
            for _ in range(extra):
                r = graph.call_function(aten.unsqueeze.default, (r, -1))
            kept = graph.call_function(aten.where.ScalarOther, (r, src, 0.0))
            use.replace_all_uses_with(graph.call_function(aten.add.Tensor, (acc, kept)))
        else:
            t, k = tk
            raise _refused(where, f"{use.format_node()} uses the rows selected for one expert in a way the "
                                  f"dense form over T={t} tokens and top-k={k} cannot reproduce")
    graph.erase_node(use)


def _indices(node: fx.Node) -> list:
    return list(node.args[1])


def _erase_checks(graph: fx.Graph, size: fx.Node) -> None:
    """``sym_size`` of a selection and the runtime asserts on it: meaningless once the shape is static."""
    for node in list(size.users):
        for after in list(node.users):
            if after.users:
                raise CaptureError(f"the selected row count {size.name} is used by {after.format_node()}",
                                   hint=HINT)
            graph.erase_node(after)
        graph.erase_node(node)
    graph.erase_node(size)


def _check_mask(mask: object, where: str) -> None:
    if not isinstance(mask, fx.Node) or mask.target not in MASKS:
        shape = tuple(mask.meta["val"].shape) if isinstance(mask, fx.Node) else ()
        raise _refused(where, f"rows are selected by {getattr(mask, 'target', mask)} on a {shape} tensor, not by "
                              f"comparing routed expert indices with an expert number")
    indices, expert = mask.args
    if not (isinstance(expert, int) or isinstance(expert, fx.Node) and expert.meta["val"].dim() == 0):
        raise _refused(where, f"the mask {mask.name} compares with {expert}, not with one expert number")
    source = indices if isinstance(indices, fx.Node) else None
    if (source is None or source.target is not operator.getitem or source.args[1] != 1
            or source.args[0].target is not aten.topk.default):
        raise _refused(where, f"the expert indices compared by {mask.name} are not the indices of a torch.topk, "
                              f"so a token might pick one expert in several slots")
    if indices.meta["val"].dim() != 2 or source.args[0].args[0].meta["val"].dim() != 2:
        shape = tuple(indices.meta["val"].shape)
        raise _refused(where, f"routed indices of shape {shape}; expected (tokens, top_k)")


def module_name(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<top level>"
    path, cls = list(stack.values())[-1]
    path = path.removeprefix("model").removeprefix(".") or "<the model>"  # capture wraps the model as `model`
    return f"{path} ({getattr(cls, '__name__', str(cls).rsplit('.', 1)[-1])})"


def _refused(where: str, why: str) -> CaptureError:
    return CaptureError(f"the expert dispatch in module {where} cannot be made dropless and static: {why}",
                        hint=HINT)


def _propagate(gm: fx.GraphModule) -> None:
    """Fresh fake values for every node: the rewritten ones had data-dependent shapes."""
    vals = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode(vals)
    with mode:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*vals)
