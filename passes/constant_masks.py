"""Attention masks that do not depend on the inputs become ``is_causal`` (or no mask at all).

Models written for eager mode often skip building a causal mask and call
``scaled_dot_product_attention(..., is_causal=True)``; under ``torch.export``
the same code builds the mask from ``arange``s and passes it as ``attn_mask``.
That mask costs a ``B x 1 x L x S`` tensor per step, is saved for every
layer's backward, and crosses pipeline stages. ``fold_constant_masks`` finds
each attention call whose mask depends on no graph input (only on shapes and
constants), evaluates it once, and when it is exactly the causal pattern
(``L == S``, lower triangle true, every batch entry alike) rewrites the call to
``is_causal=True`` without the mask; an all-true mask is dropped. The mask's
computation is removed when nothing else uses it.

Invariant: the rewritten attention computes what the original computes on
every input, because the folded mask never depended on one.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
LIMIT = 1 << 26  # masks with more elements are left alone (evaluating them would cost memory)


def fold_constant_masks(gm: fx.GraphModule) -> int:
    """Rewrites every foldable attention mask in ``gm`` (see the module doc); returns how many calls changed."""
    changed = 0
    cache: dict[fx.Node, str] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
        if not isinstance(mask, fx.Node) or causal:
            continue
        if mask not in cache:
            cache[mask] = _classify(mask)
        kind = cache[mask]
        if kind == "other":
            continue
        q, k, v = node.args[:3]
        dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        kwargs = {key: val for key, val in node.kwargs.items() if key not in ("attn_mask", "dropout_p", "is_causal")}
        node.args = (q, k, v, None, dropout, kind == "causal")
        node.kwargs = kwargs
        changed += 1
    if changed:
        for mask in cache:
            _erase_if_unused(gm.graph, mask)
        gm.graph.lint()
        gm.recompile()
    return changed


def _classify(mask: fx.Node) -> str:
    """"causal", "all" (every position visible) or "other" for a mask node of the graph."""
    val = mask.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != torch.bool or val.dim() < 2 or val.numel() > LIMIT:
        return "other"
    if val.shape[-1] != val.shape[-2] or val.device.type == "meta":
        return "other"
    return mask_kind(evaluate_constant(mask))


def mask_kind(value: torch.Tensor | None) -> str:
    """"causal", "all" or "other" for a mask's value (None: not known, "other")."""
    if value is None or value.dtype != torch.bool or value.dim() < 2 or value.shape[-1] != value.shape[-2]:
        return "other"
    if bool(value.all()):
        return "all"
    size = value.shape[-1]
    causal = torch.ones(size, size, dtype=torch.bool, device=value.device).tril()
    return "causal" if bool((value == causal).all()) else "other"


def evaluate_constant(target: fx.Node, sizes: Callable[[fx.Node], int | None] | None = None,
                      device: torch.device | None = None) -> torch.Tensor | None:
    """The value of ``target`` when it depends on no placeholder (None otherwise), by running its ancestors.

    ``sizes``: the value of a node that is a symbolic size (an int: its example's), so that a graph exported with
    symbolic shapes is evaluated at its example's; ``device``: where tensors are made (a meta graph's on the
    CPU)."""
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()
    fixed: dict[fx.Node, int] = {}

    def visit(node: fx.Node) -> bool:
        if node in seen:
            return True
        size = sizes(node) if sizes is not None else None
        if size is not None:
            fixed[node] = size
            seen.add(node)
            return True
        if node.op != "call_function" or _impure(node):
            return False
        if not all(visit(arg) for arg in node.all_input_nodes):
            return False
        seen.add(node)
        order.append(node)
        return True

    if not visit(target):
        return None
    env: dict[fx.Node, object] = dict(fixed)
    for node in order:
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        if device is not None and "device" in kwargs:
            kwargs = {**kwargs, "device": device}
        try:
            env[node] = node.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - an op that cannot run here (a meta or fake tensor): not known
            return None
        if isinstance(env[node], torch.Tensor) and env[node].device.type == "meta":
            return None
    out = env[target]
    return out if isinstance(out, torch.Tensor) else None


def _impure(node: fx.Node) -> bool:
    """Random or mutating ops are never evaluated at compile time."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return node.target.__module__ not in ("_operator", "operator")
    return schema.is_mutable or "rand" in schema.name or "dropout" in schema.name


def _erase_if_unused(graph: fx.Graph, node: fx.Node) -> None:
    """Erases ``node`` and then each of its inputs that is left without users (never placeholders)."""
    stack, erased = [node], set()
    while stack:
        current = stack.pop()
        if current in erased or current.users or current.op != "call_function":
            continue
        inputs = current.all_input_nodes
        graph.erase_node(current)
        erased.add(current)
        stack.extend(inputs)
