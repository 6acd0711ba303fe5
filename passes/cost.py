"""Cost analysis: FLOPs and output bytes per node, written to ``node.meta["autopar.cost"]``.

The estimates only need to rank choices (where to cut stages, which sharding is
cheaper), so matmul-like ops count 2*M*N*K and every other op counts one FLOP
per output element.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten


@dataclass(frozen=True)
class Cost:
    flops: int
    bytes: int  # bytes of the node's tensor outputs


def tensor_bytes(val: object) -> int:
    """Bytes of a tensor (or of the tensors in a tuple/list) from ``meta["val"]``."""
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(tensor_bytes(v) for v in val)
    return 0


def _shape(node: object) -> tuple[int, ...]:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def matmul_flops(node: fx.Node) -> int | None:
    """2*M*N*K of a matmul, attention or convolution node; None for any other operator."""
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return None
    if node.target in (aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default):
        k = _shape(node.args[0])[-1:] or (1,)
        return 2 * out.numel() * k[0]
    if node.target in (aten.addmm.default, aten.baddbmm.default):
        k = _shape(node.args[1])[-1:] or (1,)
        return 2 * out.numel() * k[0]
    if node.target == aten.scaled_dot_product_attention.default:
        q, k = _shape(node.args[0]), _shape(node.args[1])
        if len(q) >= 2 and len(k) >= 2:
            return 4 * math.prod(q[:-1]) * k[-2] * q[-1]
    if "grouped_mm" in str(node.target):  # a mixture of experts' matmul: (M, K) rows, each by its group's (K, N)
        k = _shape(node.args[0])[-1:] or (1,)
        return 2 * out.numel() * k[0]
    if node.target == aten.convolution.default:
        w = _shape(node.args[1])
        return 2 * out.numel() * math.prod(w[1:])
    return None


def node_cost(node: fx.Node) -> Cost:
    val = node.meta.get("val")
    out_bytes = tensor_bytes(val)
    flops = matmul_flops(node) if node.op == "call_function" else 0
    if flops is None:
        flops = val.numel() if isinstance(val, torch.Tensor) else 0
    return Cost(flops=flops, bytes=out_bytes)


def annotate_costs(gm: fx.GraphModule) -> fx.GraphModule:
    """Writes ``meta["autopar.cost"]`` on every node; returns ``gm`` unchanged otherwise."""
    for node in gm.graph.nodes:
        node.meta["autopar.cost"] = node_cost(node)
    return gm


def requires_grad(gm: fx.GraphModule, leaves: set[fx.Node]) -> dict[fx.Node, bool]:
    """Which nodes' values need a gradient: floating values computed from ``leaves`` (trainable parameters)."""
    rg: dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            rg[node] = node in leaves
        elif node.op == "call_function":
            val = node.meta.get("val")
            floating = isinstance(val, (tuple, list)) or isinstance(val, torch.Tensor) and val.is_floating_point()
            rg[node] = floating and any(rg.get(a, False) for a in node.all_input_nodes)
    return rg
