"""Eager attention (matmul-softmax-matmul, Hugging Face's ``attn_implementation="eager"``) as
``aten.scaled_dot_product_attention``, so that context parallelism rewrites it as it rewrites SDPA.

The chain matched, read backwards from the second matmul (each step's ops in a table below):

    scores = matmul(q, kT)                  q (B, H, Sq, D); kT (B, H, D, Sk): K with its last two dims swapped
    scores = scores * c, scores / c, ...    ``SCALES``: Python numbers or 0-dim constants; their product is the scale
    scores = scores + mask, ...             ``MASKS``: a tensor of q's dtype over (..., Sq or 1, Sk), or
                                            where(cond, scores, fill) / masked_fill(scores, cond, fill) with
                                            fill the dtype's lowest value or -inf: added as where(cond, 0, fill)
                                            / where(cond, fill, 0)
    probs = softmax(scores, -1)             ``SOFTMAXES``; ``CASTS`` around it (``.float()``, ``dtype=float32``,
                                            ``.to(q.dtype)``) are dropped: see docs/decisions.md
    probs = dropout(probs, p, train)        carried as ``dropout_p`` (p if train else 0)
    out = matmul(probs, v)                  v (B, H, Sk, Dv)

becomes ``scaled_dot_product_attention(q, k, v, attn_mask=sum of the masks, dropout_p, scale=product)``, the
K/V head groups (Hugging Face's ``repeat_kv``: unsqueeze, expand, reshape) left before it as the SDPA path
has them. A chain with an intermediate read elsewhere (returned attention weights), another op between the
steps (Gemma-2's soft-capping ``tanh``), a mask added before the scale, or operands of another rank is left
as it is: context parallelism then refuses it (``passes/context_parallel.py``), never guesses.

Invariant: the rewritten graph computes what ``gm`` computes, up to the rounding of the scores' scale and of
the masks' sum, and without the casts around the softmax (a float64 model's float32 softmax is computed in
float64).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.core.graph import copy_module
from autopar.passes.expert_graph import ancestors

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
MATMUL = aten.matmul.default
SOFTMAXES = {aten.softmax.int, aten._softmax.default}  # (x, dim, ...): over the last dim only
CASTS = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default}  # dtype changes only
DROPOUT = aten.dropout.default  # (x, p, train)
SCALES = {  # op -> (the scores' argument index, the constant's, whether the constant divides)
    aten.mul.Tensor: None, aten.mul.Scalar: None,  # either operand the scores
    aten.div.Tensor: (0, 1, True), aten.div.Scalar: (0, 1, True),
}
MASKS = {aten.add.Tensor, aten.where.self, aten.where.ScalarOther, aten.masked_fill.Scalar, aten.masked_fill.Tensor}
CHECKS = {aten._assert_tensor_metadata.default}  # metadata checks: they read a value, compute nothing


@dataclass(frozen=True)
class Mask:
    """One mask of the scores: an additive tensor, or a boolean condition and the fill it selects."""

    node: fx.Node
    fill: float | None = None  # None: ``node`` is added to the scores
    fill_where_true: bool = False  # masked_fill (the fill where ``node`` holds) rather than where (where it fails)


@dataclass
class Chain:
    """One eager attention found: its operands and the nodes it replaces."""

    q: fx.Node
    k_t: fx.Node
    v: fx.Node
    out: fx.Node  # the second matmul
    scale: float = 1.0
    dropout: float = 0.0
    masks: list[Mask] = field(default_factory=list)  # from the softmax back
    nodes: list[fx.Node] = field(default_factory=list)  # from the second matmul back to the first


def sdpa_from_eager(gm: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """A copy of ``gm`` with each eager attention chain (module doc) replaced by one
    ``aten.scaled_dot_product_attention``; the number replaced. ``gm`` itself is left unchanged."""
    found = [c for c in map(_chain, [n for n in gm.graph.nodes if n.target is MATMUL]) if c is not None]
    if not found:
        return gm, 0
    gm = copy_module(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    for chain in found:
        _replace(gm.graph, _moved(chain, nodes))
    gm.graph.lint()
    gm.recompile()
    return gm, len(found)


# -- matching, backwards from the second matmul -------------------------------------------------------------------
def _chain(out: fx.Node) -> Chain | None:
    """The eager attention ending at the matmul ``out`` (None: not one)."""
    probs, v = out.args[0], out.args[1]
    if not (_is_4d(probs) and _is_4d(v) and _is_4d(out)) or out.kwargs:
        return None
    chain = Chain(q=out, k_t=out, v=v, out=out, nodes=[out])
    x = _through(probs, CASTS, chain)
    if x.target is DROPOUT and _only_user(x, chain.nodes[-1]):
        p, train = (list(x.args[1:]) + [0.0, True])[:2]
        chain.dropout = float(p) if train else 0.0
        chain.nodes.append(x)
        x = _through(x.args[0], CASTS, chain)
    if x.target not in SOFTMAXES or not _only_user(x, chain.nodes[-1]) or x.args[1] % 4 != 3:
        return None
    chain.nodes.append(x)
    scores = _through(x.args[0], CASTS, chain)
    first = _scores(scores, chain)
    if first is None:
        return None
    chain.q, chain.k_t = first.args
    q, k_t = chain.q.meta["val"], chain.k_t.meta["val"]
    same = q.dtype == k_t.dtype == v.meta["val"].dtype == out.meta["val"].dtype
    fits = _is_4d(chain.k_t) and k_t.shape[-1] == v.meta["val"].shape[-2] and k_t.shape[-2] == q.shape[-1]
    masks_fit = all(m.node.meta["val"].dtype == q.dtype for m in chain.masks if m.fill is None)
    return chain if same and fits and masks_fit and q.is_floating_point() else None


def _scores(x: fx.Node, chain: Chain) -> fx.Node | None:
    """Masks, then scales, then the first matmul (returned), recorded into ``chain``."""
    while x.target in MASKS and _only_user(x, chain.nodes[-1]):
        picked = _mask(x, chain)
        if picked is None:
            return None
        chain.nodes.append(x)
        x = _through(picked, CASTS, chain)
    while x.target in SCALES and _only_user(x, chain.nodes[-1]):
        picked = _scale(x, chain)
        if picked is None:
            return None
        chain.nodes.append(x)
        x = picked
    if x.target is not MATMUL or not _only_user(x, chain.nodes[-1]) or not _is_4d(x) or x.kwargs:
        return None
    chain.nodes.append(x)
    return x


def _mask(node: fx.Node, chain: Chain) -> fx.Node | None:
    """The scores ``node`` masks (its mask recorded in ``chain``), or None."""
    scores_shape = tuple(node.meta["val"].shape)
    if node.target is aten.add.Tensor:
        if node.kwargs.get("alpha", 1) != 1 or len(node.args) > 2:
            return None
        a, b = node.args
        for scores, mask in ((a, b), (b, a)):
            if _is_node(scores) and _is_node(mask) and _mask_shape(mask, scores_shape) and \
                    tuple(scores.meta["val"].shape) == scores_shape and not _reaches_matmul(mask):
                chain.masks.append(Mask(mask))
                return scores
        return None
    if node.target in (aten.where.self, aten.where.ScalarOther):
        cond, scores, fill = node.args
    else:  # masked_fill(scores, masked, fill) is where(~masked, scores, fill)
        scores, cond, fill = node.args
    fill = _constant(fill)
    lowest = torch.finfo(node.meta["val"].dtype).min
    if fill is None or fill > lowest or not _is_node(cond) or cond.meta["val"].dtype != torch.bool or \
            not _mask_shape(cond, scores_shape) or not _is_node(scores) or \
            tuple(scores.meta["val"].shape) != scores_shape:
        return None
    chain.masks.append(Mask(cond, fill, node.target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor)))
    return scores


def _scale(node: fx.Node, chain: Chain) -> fx.Node | None:
    """The scores ``node`` scales (the factor multiplied into ``chain.scale``), or None."""
    rule = SCALES[node.target]
    pairs = [(node.args[0], node.args[1]), (node.args[1], node.args[0])] if rule is None else \
        [(node.args[rule[0]], node.args[rule[1]])]
    for scores, c in pairs:
        value = _constant(c)
        if _is_node(scores) and value is not None and value != 0:
            chain.scale *= 1.0 / value if rule is not None and rule[2] else value
            return scores
    return None


def _through(x: fx.Node, ops: set, chain: Chain) -> fx.Node:
    """``x`` past the ``ops`` (casts) read by the chain only, each recorded in ``chain``."""
    while _is_node(x) and x.target in ops and _only_user(x, chain.nodes[-1]):
        chain.nodes.append(x)
        x = x.args[0]
    return x


def _constant(x: object) -> float | None:
    """A Python number, or the value of a 0-dim ``full`` / ``scalar_tensor`` node (None otherwise)."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if _is_node(x) and x.target is aten.full.default and list(x.args[0]) == []:
        return float(x.args[1])
    if _is_node(x) and x.target is aten.scalar_tensor.default:
        return float(x.args[0])
    return None


def _only_user(x: fx.Node, reader: fx.Node) -> bool:
    """``x`` is read by ``reader`` alone (metadata checks aside)."""
    return _is_node(x) and {u for u in x.users if u.target not in CHECKS} == {reader}


def _reaches_matmul(x: fx.Node) -> bool:
    """Whether ``x`` is or depends on a matmul of 4-dim values (a second scores chain, not a mask)."""
    return any(n.target is MATMUL and _is_4d(n) for n in {x} | ancestors(x))


def _mask_shape(mask: fx.Node, scores: tuple[int, ...]) -> bool:
    """A mask SDPA takes for these scores: at most 4 dims broadcasting to them, over (Sq or 1, Sk) at the end."""
    val = mask.meta.get("val")
    if not isinstance(val, torch.Tensor) or not 2 <= val.dim() <= 4:
        return False
    shape = tuple(val.shape)
    return shape[-1] == scores[-1] and shape[-2] in (1, scores[-2]) and \
        all(s in (1, t) for s, t in zip(shape[::-1], scores[::-1]))


def _is_4d(x: object) -> bool:
    return _is_node(x) and isinstance(x.meta.get("val"), torch.Tensor) and x.meta["val"].dim() == 4


def _is_node(x: object) -> bool:
    return isinstance(x, fx.Node)


# -- the rewrite ----------------------------------------------------------------------------------------------
def _moved(chain: Chain, nodes: dict[str, fx.Node]) -> Chain:
    """``chain`` with its nodes those of the copied graph (same names)."""
    def at(n: fx.Node) -> fx.Node:
        return nodes[n.name]
    return Chain(at(chain.q), at(chain.k_t), at(chain.v), at(chain.out), chain.scale, chain.dropout,
                 [Mask(at(m.node), m.fill, m.fill_where_true) for m in chain.masks], [at(n) for n in chain.nodes])


def _replace(graph: fx.Graph, chain: Chain) -> None:
    """``chain.out`` replaced by one SDPA node; the chain's nodes (and their checks) erased."""
    out = chain.out
    with graph.inserting_before(out):
        key = _key(graph, chain.k_t)
        mask = _additive_mask(graph, chain.masks, chain.q.meta["val"])
        sdpa = graph.call_function(SDPA, (chain.q, key, chain.v, mask, chain.dropout), {"scale": chain.scale})
    sdpa.meta.update({k: out.meta[k] for k in ("val", "nn_module_stack", "stack_trace") if k in out.meta})
    out.replace_all_uses_with(sdpa)
    for node in chain.nodes:  # from the output back: each is dead once its reader is gone
        for check in [u for u in node.users if u.target in CHECKS]:
            graph.erase_node(check)
        graph.erase_node(node)


def _key(graph: fx.Graph, k_t: fx.Node) -> fx.Node:
    """K: the input of a transpose of the last two dims, or that transpose written out."""
    if k_t.target is aten.transpose.int and {d % 4 for d in k_t.args[1:3]} == {2, 3}:
        return k_t.args[0]
    key = graph.call_function(aten.transpose.int, (k_t, -2, -1))
    key.meta["val"] = k_t.meta["val"].transpose(-2, -1)
    return key


def _additive_mask(graph: fx.Graph, masks: list[Mask], q: torch.Tensor) -> fx.Node | None:
    """The masks as one tensor added to the scores (a condition and fill as ``where(cond, 0, fill)``)."""
    total = None
    for m in reversed(masks):  # in the order the model applies them
        mask = m.node
        if m.fill is not None:
            zero = _node(graph, aten.full.default, ([], 0.0), {"dtype": q.dtype, "device": q.device},
                         q.new_empty(()))
            val = q.new_empty(mask.meta["val"].shape)
            mask = _node(graph, aten.where.ScalarSelf, (mask, m.fill, zero), {}, val) if m.fill_where_true else \
                _node(graph, aten.where.ScalarOther, (mask, zero, m.fill), {}, val)
        if total is not None:
            shape = torch.broadcast_shapes(total.meta["val"].shape, mask.meta["val"].shape)
            mask = _node(graph, aten.add.Tensor, (total, mask), {}, q.new_empty(shape))
        total = mask
    return total


def _node(graph: fx.Graph, target: object, args: tuple, kwargs: dict, val: torch.Tensor) -> fx.Node:
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = val
    return node
