"""SPMD lowering for the tensor-parallel axis: the solved graph -> the graph one tp rank runs.

Invariant: running the lowered graph on every tp rank, with each parameter
stored as its placement says (``Shard(d)``: the rank's chunk of dim d), gives
on every rank the outputs of the original graph, and autograd through it gives
each rank the gradient of its parameter shards (see autopar/core/collectives.py for
how each collective's backward keeps that true).

Where a value's placement differs from what its consumer's strategy asks, a
named collective is inserted (one per value and target placement, shared by all
consumers). A Replicate value with a gradient consumed by an op whose output is
sharded or partial goes through ``grad_all_reduce`` (identity forward,
all-reduce backward). Shape arguments are rewritten to local sizes and ops the
strategy cannot run on shards by themselves get their local replacement, chosen
here: the graph calls the ``LocalOp`` itself (``vocab_parallel_cross_entropy(op,
axis, n, *args)``), which reads only the rank's index and the axis's collectives
when it runs.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard
from torch.utils import _pytree as pytree

from autopar.core import comm
from autopar.passes.inplace_views import aliases_written, written_argument
from autopar.passes.lazy_module import graph_module
from autopar.passes.rules import local_args, replacement
from autopar.passes.rules.base import R
from autopar.passes.sharding import tensor_inputs
from autopar.passes.sharding_program import Choice, needs_grad_sync, out_placement

autopar_ops = torch.ops.autopar


def local_val(val: Any, placement: Any, n: int) -> Any:
    """A meta tensor with the local shape of ``val`` under ``placement`` (tuples elementwise)."""
    if isinstance(val, (tuple, list)):
        placements = placement if isinstance(placement, tuple) else (placement,) * len(val)
        return tuple(local_val(v, p, n) for v, p in zip(val, placements))
    if not isinstance(val, torch.Tensor):
        return val
    shape = list(val.shape)
    if isinstance(placement, Shard):
        shape[placement.dim] //= n
    return torch.empty(shape, dtype=val.dtype, device="meta")


def convert(graph: fx.Graph, x: fx.Node, src: Any, dst: Any, axis: str, *, val: Any = None, n: int = 1,
            grad: bool = False) -> fx.Node:
    """Appends to ``graph`` the nodes turning ``x`` (placement ``src``) into placement ``dst``: the ops of
    ``comm.conversion(src, dst, grad)``; the last one (``x`` when there are none).

    Each gets ``meta["val"]``: ``val`` (the full value) at its placement on an axis of ``n`` ranks.
    """
    ops = comm.conversion(src, dst, grad)
    if ops is None:
        raise NotImplementedError(f"no redistribution from {src} to {dst}")
    placement = src
    for name in ops:
        op = comm.OPS[name]
        dims = op.dim_args(src, dst)
        x = graph.call_function(getattr(autopar_ops, name).default, (x, axis, *dims))
        placement = op.placement_after(placement, dims)
        x.meta["val"] = local_val(val, placement, n)
    return x


def lower_tp(gm: fx.GraphModule, choices: dict[fx.Node, Choice], n: int, requires_grad: dict[fx.Node, bool],
             axis: str = "tp") -> fx.GraphModule:
    """The graph every tp rank (of ``n``) runs: what depends on the rank's index reads it at run time."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placement: dict[fx.Node, Any] = {}  # placement of each original node's (tensor) value
    converted: dict[tuple[fx.Node, Any, bool], fx.Node] = {}

    def local_input(arg: fx.Node, dst: Any, grad: bool) -> fx.Node:
        key = (arg, dst, grad)
        if key not in converted:
            converted[key] = convert(graph, env[arg], placement[arg], dst, axis, val=arg.meta.get("val"), n=n,
                                     grad=grad)
        return converted[key]

    def finish(node: fx.Node, new: fx.Node, strategy_output: Any) -> None:
        new.meta = {k: v for k, v in node.meta.items() if k != "val"}
        new.meta["val"] = local_val(node.meta.get("val"), strategy_output, n)
        placement[node] = strategy_output

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
            finish(node, env[node], choices[node].strategy.output)
        elif node.op == "call_function" and node.target is operator.getitem:
            env[node] = graph.call_function(operator.getitem, (env[node.args[0]], node.args[1]))
            finish(node, env[node], out_placement(choices[node.args[0]].strategy, node.args[1]))
        elif node.op == "call_function":
            strategy = choices[node].strategy
            ins = tensor_inputs(node)
            vals = pytree.tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, (node.args, node.kwargs))
            rewritten = local_args(node.target, vals[0], vals[1], strategy, n)
            local = iter([local_input(arg, strategy.inputs[k], _needs_sync(arg, strategy, k, requires_grad))
                          for k, arg in enumerate(ins)])
            # tensors sit where the node's own tensor arguments sit: substitute by position
            leaves, spec = pytree.tree_flatten(rewritten)
            originals = pytree.tree_leaves((node.args, node.kwargs))
            if len(leaves) != len(originals):
                raise AssertionError(f"local_args changed the argument structure of {node.format_node()}")
            leaves = [next(local) if isinstance(o, fx.Node) and isinstance(o.meta.get("val"), torch.Tensor)
                      else o if isinstance(o, fx.Node) else new for o, new in zip(originals, leaves)]
            new_args, new_kwargs = pytree.tree_unflatten(leaves, spec)
            local_op = replacement(node.target, strategy)
            if local_op is not None:
                env[node] = graph.call_function(local_op, (node.target, axis, n, *new_args), new_kwargs)
            else:
                env[node] = graph.call_function(node.target, tuple(new_args), new_kwargs)
            finish(node, env[node], strategy.output)
            env[node].meta["autopar.placement"] = strategy
            if written_argument(node) is not None:  # copies made before a write are stale after it
                stale = aliases_written(node)
                for key in [key for key in converted if key[0] in stale]:
                    del converted[key]
        elif node.op == "call_module":  # an expert-parallel layer, replicated over tp: its inputs whole
            args = [local_input(a, R, False) if isinstance(a, fx.Node) else a for a in node.args]
            env[node] = graph.call_module(node.target, tuple(args))
            finish(node, env[node], R)
        elif node.op == "output":
            outs = [local_input(a, R, False) if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
                    else a for a in node.args[0]]
            graph.output(tuple(outs))
    lowered = graph_module(gm, graph)
    lowered.graph.lint()
    return lowered


def _needs_sync(arg: fx.Node, strategy: Any, k: int, requires_grad: dict[fx.Node, bool]) -> bool:
    return bool(requires_grad.get(arg)) and needs_grad_sync(strategy, strategy.inputs[k]) and _floating(arg)


def _floating(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()
