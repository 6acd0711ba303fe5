"""SPMD lowering for the tensor-parallel axis: the solved graph -> the graph one tp rank runs.

Invariant: running the lowered graph on every tp rank, with each parameter
stored as its placement says (``Shard(d)``: the rank's chunk of dim d), gives
on every rank the outputs of the original graph, and autograd through it gives
each rank the gradient of its parameter shards (see runtime/collectives.py for
how each collective's backward keeps that true).

Where a value's placement differs from what its consumer's strategy asks, a
named collective is inserted (one per value and target placement, shared by all
consumers). A Replicate value with a gradient consumed by an op whose output is
sharded or partial goes through ``grad_all_reduce`` (identity forward,
all-reduce backward). Shape arguments are rewritten to local sizes and ops the
strategy cannot run on shards by themselves get their local replacement.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from passes.sharding import Choice, needs_grad_sync, out_placement, tensor_inputs
from passes.sharding_rules import R, local_args, local_op
from runtime import collectives as coll

autopar_ops = torch.ops.autopar


def _convert(graph: fx.Graph, x: fx.Node, src: Any, dst: Any, axis: str) -> fx.Node:
    """Nodes turning placement ``src`` into ``dst`` (identity when equal)."""
    if dst is None or src == dst:
        return x
    if isinstance(src, Partial) and isinstance(dst, Replicate):
        return graph.call_function(autopar_ops.all_reduce.default, (x, axis))
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return graph.call_function(autopar_ops.all_gather.default, (x, axis, src.dim))
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return graph.call_function(autopar_ops.chunk.default, (x, axis, dst.dim))
    if isinstance(src, Partial) and isinstance(dst, Shard):
        return graph.call_function(autopar_ops.reduce_scatter.default, (x, axis, dst.dim))
    if isinstance(src, Replicate) and isinstance(dst, Partial):
        return graph.call_function(autopar_ops.to_partial.default, (x, axis))
    if isinstance(src, Shard) and isinstance(dst, (Shard, Partial)):
        return _convert(graph, _convert(graph, x, src, R, axis), R, dst, axis)
    raise NotImplementedError(f"no redistribution from {src} to {dst}")


def lower_tp(gm: fx.GraphModule, choices: dict[fx.Node, Choice], n: int, rank: int, requires_grad: dict[fx.Node, bool],
             axis: str = "tp") -> fx.GraphModule:
    """The graph tp rank ``rank`` (of ``n``) runs; node metadata is re-derived for local shapes."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placement: dict[fx.Node, Any] = {}  # placement of each original node's (tensor) value
    converted: dict[tuple[fx.Node, Any, bool], fx.Node] = {}

    def local_input(arg: fx.Node, dst: Any, grad: bool) -> fx.Node:
        key = (arg, dst, grad)
        if key not in converted:
            x = _convert(graph, env[arg], placement[arg], dst, axis)
            if grad:
                x = graph.call_function(autopar_ops.grad_all_reduce.default, (x, axis))
            converted[key] = x
        return converted[key]

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
            env[node].meta = {k: v for k, v in node.meta.items() if k != "val"}
            placement[node] = choices[node].strategy.output
        elif node.op == "call_function" and node.target is operator.getitem:
            env[node] = graph.call_function(operator.getitem, (env[node.args[0]], node.args[1]))
            env[node].meta = {k: v for k, v in node.meta.items() if k != "val"}
            placement[node] = out_placement(choices[node.args[0]].strategy, node.args[1])
        elif node.op == "call_function":
            strategy = choices[node].strategy
            ins = tensor_inputs(node)
            vals = pytree.tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, (node.args, node.kwargs))
            rewritten = local_args(node.target, vals[0], vals[1], strategy, n, rank)
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
            replacement = local_op(node.target, strategy, n, rank, coll.AxisCollectives(axis))
            if replacement is not None:
                env[node] = graph.call_function(coll.local_replacement,
                                                (node.target, strategy.note, axis, n, rank, *new_args), new_kwargs)
            else:
                env[node] = graph.call_function(node.target, tuple(new_args), new_kwargs)
            env[node].meta = {k: v for k, v in node.meta.items() if k != "val"}
            env[node].meta["autopar.placement"] = strategy
            placement[node] = strategy.output
        elif node.op == "output":
            outs = [local_input(a, R, False) if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
                    else a for a in node.args[0]]
            graph.output(tuple(outs))
    lowered = fx.GraphModule(gm, graph)
    lowered.graph.lint()
    return lowered


def propagate_shapes(gm: fx.GraphModule, example: list[torch.Tensor], axis_sizes: dict[str, int]) -> None:
    """Writes ``meta["val"]`` (fake tensors) on every node of ``gm`` for the local ``example`` placeholders."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example]
    with coll.fake_axis_sizes(axis_sizes):
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)


def _needs_sync(arg: fx.Node, strategy: Any, k: int, requires_grad: dict[fx.Node, bool]) -> bool:
    return bool(requires_grad.get(arg)) and needs_grad_sync(strategy, strategy.inputs[k]) and _floating(arg)


def _floating(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()
