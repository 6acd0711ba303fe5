"""The model profile's symbolic quantities: sizes in the batch ``b`` and sequence ``s`` read off a graph.

From a graph captured with symbolic batch and sequence sizes: the export's
symbols renamed to ``b`` and ``s`` (``export_symbols``, ``to_sympy``); the
tensors autograd saves for backward (``saved_tensors``, found by running the
graph on fake tensors under ``saved_tensors_hooks``) and their elements per
segment (``saved_elements``); the elements that enter a segment and that leave
the model; the width of each matmul's weight (small-GEMM cost); the elements
that memory-bound operators read and write.

Invariant: every quantity is a sympy expression in ``b_sym`` and ``s_sym`` (or
an integer), taken from the shapes in ``node.meta["val"]``, never guessed from
the model's class.
"""
from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.passes.cost import matmul_flops as _matmul_flops
from autopar.passes.saved import SavedTensors
from autopar.planner.profile_graph import placeholders

b_sym, s_sym = sympy.symbols("b s", positive=True, integer=True)


def to_sympy(x: Any, names: dict[sympy.Symbol, sympy.Symbol]) -> sympy.Expr:
    """A size (an int or a symbolic ``SymInt``) as a sympy expression, export's symbols renamed by ``names``."""
    if isinstance(x, torch.SymInt):
        return sympy.expand(x.node.expr.xreplace(names))
    return sympy.Integer(int(x))


def export_symbols(ep: torch.export.ExportedProgram, seq: bool) -> dict[sympy.Symbol, sympy.Symbol]:
    """Export's symbols for the inputs' dims 0 and 1 -> ``b`` and ``s``.

    The first tensor input must keep both free; every other input's free dim
    0 is the batch and dim 1 the sequence too (an encoder-decoder's decoder
    ids: the planner's sequences are ``seq_len`` long on both sides).
    """
    user = [n.meta["val"] for n, spec in zip(placeholders(ep.graph_module), ep.graph_signature.input_specs)
            if spec.kind.name == "USER_INPUT" and isinstance(n.meta.get("val"), torch.Tensor)]
    if not user:
        raise ValueError("the model has no tensor input; the planner needs one whose dim 0 is the batch")
    dims = [(0, b_sym), (1, s_sym)][: 2 if seq else 1]
    out = {}
    for dim, symbol in dims:
        shape = user[0].shape
        if dim >= len(shape) or not isinstance(shape[dim], torch.SymInt):
            what = "batch" if dim == 0 else "sequence"
            raise ValueError(f"export fixed the {what} size of the first input (dim {dim}); the planner needs it free. "
                             f"Pass example_inputs whose dim {dim} can vary (batch and sequence sizes >= 2)"
                             + ("" if dim == 0 else ", or seq_len=None for a model without a sequence"))
        out[shape[dim].node.expr] = symbol
    for val in user[1:]:
        for dim, symbol in dims:
            size = val.shape[dim] if dim < val.dim() else None
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                out.setdefault(size.node.expr, symbol)
    return out


def numel_of(val: Any) -> int:
    """Elements of a node's value: a tensor's, or the sum over a tuple or list of them (0 for anything else)."""
    if isinstance(val, torch.Tensor):
        return val.numel()
    if isinstance(val, (tuple, list)):
        return sum(numel_of(v) for v in val)
    return 0


def saved_elements(saved: SavedTensors, nodes: set[fx.Node], names: dict,
                   factors: dict[str, Any]) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr]:
    """What ``nodes`` save for backward: ``(floating, other_bytes, attention, attention_fused)``.

    ``floating``: elements of floating tensors (the per-token part);
    ``other_bytes``: bytes of other tensors (indices, masks); ``attention``:
    elements of attention internals (the attention matrix on the math path);
    ``attention_fused``: what a fused attention kernel keeps instead (its
    output and log-sum-exp). ``factors``: local/full size by producing node name.
    """
    floating = other_bytes = attention = attention_fused = sympy.Integer(0)
    for rec in saved.saved.values():
        if rec.saver not in nodes:
            continue
        owner = rec.producer if rec.producer is not None else rec.saver
        elements = to_sympy(rec.elements, names) * factors.get(owner.name, 1)
        if not rec.floating:
            other_bytes += elements * rec.itemsize
        elif rec.producer is None and "scaled_dot_product" in str(rec.saver.target):
            attention += elements
        else:
            floating += elements
    for node in nodes:
        if "scaled_dot_product" in str(node.target):
            q, out = node.args[0].meta["val"], node.meta["val"]
            lse = to_sympy(q.numel(), names) / to_sympy(q.shape[-1], names)  # one float per query and head
            attention_fused += sympy.expand((lse + to_sympy(out.numel(), names)) * factors.get(node.name, 1))
    return floating, other_bytes, attention, attention_fused


def ring_elements(nodes: set[fx.Node], names: dict, factors: dict[str, Any]) -> sympy.Expr:
    """Elements of K and V of every ``scaled_dot_product_attention`` among ``nodes``: the block a context-parallel
    ring passes on per step (as the attention receives them: after Hugging Face's ``repeat_kv`` for GQA)."""
    out = sympy.Integer(0)
    for node in nodes:
        if "scaled_dot_product" in str(node.target):
            k, v = node.args[1].meta["val"], node.args[2].meta["val"]
            out += sympy.expand((to_sympy(k.numel(), names) + to_sympy(v.numel(), names)) * factors.get(node.name, 1))
    return out


def kept_elements(saved: SavedTensors, nodes: set[fx.Node], names: dict, factors: dict[str, Any]) -> sympy.Expr:
    """Elements of the outputs selective recomputation keeps (matmuls, attention) that ``nodes`` make;
    ``factors``: local/full size by node name."""
    total = sympy.Integer(0)
    for node, sizes in saved.kept.items():
        if node in nodes:
            total += sum((to_sympy(n, names) for n in sizes), sympy.Integer(0)) * factors.get(node.name, 1)
    return sympy.expand(total)


# ---------------------------------------------------------------------------
# what enters a segment, what leaves the model
# ---------------------------------------------------------------------------

def entering_elements(nodes: set[fx.Node], names: dict, made_by: set[fx.Node] | None = None,
                      factors: dict[str, Any] | None = None) -> sympy.Expr:
    """Floating elements made outside ``nodes`` (not parameters or inputs) and used by them; with ``made_by``,
    only those made by these nodes; ``factors``: local/full size by producing node name."""
    total = sympy.Integer(0)
    seen = set()
    for node in nodes:
        for arg in node.all_input_nodes:
            val = arg.meta.get("val")
            producer = arg.args[0] if arg.target is operator.getitem else arg
            if (producer in nodes or arg in seen or arg.op != "call_function" or not isinstance(val, torch.Tensor)
                    or not val.is_floating_point() or (made_by is not None and producer not in made_by)):
                continue
            seen.add(arg)
            total += to_sympy(val.numel(), names) * (factors or {}).get(producer.name, 1)
    return total


def output_elements(gm: fx.GraphModule, names: dict) -> sympy.Expr:
    """Floating elements of the graph's outputs (what a loss over them keeps)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    total = sympy.Integer(0)
    for arg in pytree.tree_leaves(out.args):
        val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
        if isinstance(val, torch.Tensor) and val.is_floating_point() and val.dim() > 0:
            total += to_sympy(val.numel(), names)
    return total


# ---------------------------------------------------------------------------
# matmul widths
# ---------------------------------------------------------------------------

_MATMULS = {"aten.addmm.default": 2, "aten.mm.default": 1, "aten.linear.default": 1, "aten.matmul.default": 1}
_VIEWS = ("aten.t.default", "aten.transpose.int", "aten.permute.default", "aten.view.default",
          "aten.reshape.default", "aten.alias.default", "aten.detach.default", "aten._unsafe_view.default")


def weight_width(node: fx.Node, params: set[fx.Node]) -> int | None:
    """The narrower dim of a matmul's weight when the weight is a parameter (or a view of one), else None.

    Large matrix multiplications reach a larger fraction of peak than narrow
    ones; the planner charges each matmul by this width (``Cluster.narrow``).
    """
    position = _MATMULS.get(str(node.target))
    if position is None or len(node.args) <= position or not isinstance(node.args[position], fx.Node):
        return None
    weight = node.args[position]
    source = weight
    while source.op == "call_function" and str(source.target) in _VIEWS:
        source = source.args[0]
    val = weight.meta.get("val")
    if source not in params or not isinstance(val, torch.Tensor) or val.dim() < 2:
        return None
    return int(min(val.shape[-2:]))


# ---------------------------------------------------------------------------
# memory traffic of the operators that are not matmuls
# ---------------------------------------------------------------------------

_INDEXING = ("aten.embedding.default", "aten.index.Tensor", "aten.index_select.default", "aten.gather.default")


def moved_elements(node: fx.Node, names: dict) -> sympy.Expr:
    """Elements a memory-bound operator reads and writes: its tensor inputs and outputs.

    Matmuls and attention are charged by their FLOPs instead; views, in-place
    aliases and tuple indexing move nothing. An indexing operator reads only
    the rows it returns, not its whole table.
    """
    zero = sympy.Integer(0)
    schema = getattr(node.target, "_schema", None)
    if (node.op != "call_function" or node.target is operator.getitem or _matmul_flops(node) is not None
            or schema is None or any(r.alias_info is not None for r in schema.returns)):
        return zero
    out = [v for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    written = sum((to_sympy(v.numel(), names) for v in out), zero)
    read = zero
    for arg in node.all_input_nodes:
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor):
            elements = to_sympy(val.numel(), names)
            read += written if str(node.target) in _INDEXING and arg is node.args[0] else elements
    return sympy.expand(read + written)
