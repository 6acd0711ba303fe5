"""Sharding solver: one placement strategy per node for the tensor-parallel axis.

``solve_sharding(gm, n, ...)`` writes ``node.meta["autopar.placement"]`` (a
``Strategy`` from ``passes.rules``) on every node and returns the
choice. It minimizes the time of the collectives the choice implies (forward
and backward, priced by ``autopar.core.comm`` on the axis's ``LinkCost``,
``cost=``) under a per-rank parameter-memory
budget, as an integer linear program (scipy's HiGHS): a binary variable per
(node, strategy), and per edge a variable per pair of producer and consumer
strategies, linked so the pair's redistribution cost is paid exactly when both
are chosen.

Rules the program follows, so the lowering stays correct:
- a parameter is Replicate or Shard(d); a sharded parameter is consumed as
  it is stored (tensor parallelism computes on shards; gathering parameters
  is ZeRO's job on the dp axis);
- user inputs, buffers and constants are Replicate; graph outputs must be
  Replicate (every tp rank sees the full loss and outputs).
The default budget asks every parameter of two or more dims that some use
can consume sharded to be sharded; everything else may stay replicated.

Precision: a sum over ranks (a Partial value reduced forward, the partial
gradient of a Replicate input reduced backward, or the sums inside a
replacement such as vocab-parallel cross-entropy) reassociates a sum in the
dtype of the value. Where the model computes a region in a dtype narrower
than its parameters' (a norm cast to float32 in a float64 model), such a sum
rounds at that dtype, not the model's, so it is charged ``NARROW_SUM_S`` (``sharding_program.py``; as is
a Partial value cast to a narrow dtype: each summand rounds) and
chosen only where no plan avoids it: the parallel run then rounds only where
the single-device model itself rounds. Narrow values are also computed
replicated where sharding them gains nothing (``NARROW_SHARD_S``, a tie-break):
a vectorized kernel may round an element differently by its position in the
tensor (a float32 ``exp`` over a shard is not always the full one's slice).
"""
from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from scipy.optimize import LinearConstraint
from torch.distributed.tensor import Shard
from torch.utils import _pytree as pytree

from autopar.core.comm import LinkCost
from autopar.passes.blocks import repeated_blocks
from autopar.passes.cost import requires_grad, tensor_bytes
from autopar.passes.rules import Strategy, strategies
from autopar.passes.rules.base import R
from autopar.passes.saved import saved_tensors
from autopar.passes.sharding_program import Choice, Program, out_placement
from autopar.passes.stage_cuts import node_layer

KEY = "autopar.placement"
ACTIVATION_SLACK = 0.01  # least_activations: communication time may buy back up to 1% more saved activations


# the solver's default axis: 10 us per collective, 50 GB/s per rank, a reduce-scatter charged as an all-reduce
DEFAULT_COST = LinkCost(bandwidth=50e9, launch=10e-6, scatter=2.0)


def tensor_inputs(node: fx.Node) -> list[fx.Node | None]:
    """The producer of each tensor the rules see, in their order (pytree order of the args)."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [a for a in leaves if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def _vals(tree: Any) -> Any:
    return pytree.tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, tree)


def candidate_strategies(gm: fx.GraphModule, n: int, param_names: dict[fx.Node, str],
                         fixed: dict[str, Any] | None = None,
                         same_as: dict[fx.Node, fx.Node] | None = None) -> dict[fx.Node, Choice]:
    """Every node's strategies and the value feeding each of its tensor inputs.

    ``fixed`` pins parameters to placements decided before (another graph of the same model);
    ``same_as`` maps nodes of repeated blocks to their first block's nodes.
    """
    same_as = same_as or {}
    choices: dict[fx.Node, Choice] = {}
    value_of: dict[fx.Node, tuple[fx.Node, int | None]] = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            opts = [R]
            if node in param_names and isinstance(val, torch.Tensor):
                opts += [Shard(d) for d, s in enumerate(val.shape) if s % n == 0 and s > 0]
                if fixed is not None and param_names[node] in fixed:
                    opts = [fixed[param_names[node]]]
            choices[node] = Choice([Strategy((), p, "parameter" if node in param_names else "input") for p in opts])
            value_of[node] = (node, None)
        elif node.op == "call_function" and node.target is operator.getitem:
            value_of[node] = (value_of[node.args[0]][0], node.args[1])
        elif node.op == "call_module":  # an expert-parallel layer: its experts whole on every tp rank
            ins = tensor_inputs(node)
            choices[node] = Choice([Strategy(tuple(R for _ in ins), R, "experts whole")],
                                   inputs=[value_of.get(a) for a in ins])
            value_of[node] = (node, None)
        elif node.op == "call_function":
            ins = tensor_inputs(node)
            if node in same_as and same_as[node] in choices:  # an identical block's node: the same strategies
                found = choices[same_as[node]].strategies
            else:
                found = strategies(node.target, _vals(node.args), _vals(node.kwargs), n)
                found = [s for s in found if len(s.inputs) == len(ins)] or found[:1]
            choices[node] = Choice(found, inputs=[value_of.get(a) for a in ins])
            value_of[node] = (node, None)
    return choices


def default_budget(gm: fx.GraphModule, n: int, param_names: dict[fx.Node, str], choices: dict[fx.Node, Choice]) -> int:
    """Bytes per rank if every parameter of >= 2 dims that all its uses can take sharded is sharded."""
    total = 0
    uses_of: dict[fx.Node, list[tuple[fx.Node, int]]] = {}
    for u, choice in choices.items():
        for k, v in enumerate(choice.inputs):
            if v is not None and v[1] is None:
                uses_of.setdefault(v[0], []).append((u, k))
    for node in param_names:
        nbytes = tensor_bytes(node.meta.get("val"))
        shards = [s.output for s in choices[node].strategies if isinstance(s.output, Shard)]
        uses = uses_of.get(node, [])
        ok = any(all(any(st.inputs[k] == p for st in choices[u].strategies) for u, k in uses) for p in shards)
        total += nbytes // n if ok and node.meta["val"].dim() >= 2 else nbytes
    return total


def saved_bytes(gm: fx.GraphModule, n: int, choices: dict[fx.Node, Choice], params: set[fx.Node],
                trainable: set[fx.Node]) -> list[tuple[fx.Node, int | None, int, list[float]]]:
    """Bytes per rank that each node saves for backward under each of its strategies (``passes.saved``):
    ``(node, k, nbytes, row)``, ``k`` the input it saves (None: a tensor it makes itself), ``nbytes`` the whole
    tensor's bytes, ``row`` the bytes per rank under each strategy.

    A tensor a node saves from one of its inputs is held at the placement its strategy asks of that
    input (an all-gathered input is saved whole, unless gathered again in backward: see ``solve_sharding``);
    one it makes itself, at its output placement. ``Shard``: 1/n of the bytes; Replicate and Partial: all.
    """
    found = []
    run = saved_tensors(gm, params, trainable)
    for rec in run.saved.values():
        v = rec.saver
        if v not in choices or v.op != "call_function":
            continue
        nbytes = int(rec.elements) * rec.itemsize
        ch = choices[v]
        k = next((k for k, value in enumerate(ch.inputs)  # the input it saves, or a view of
                  if value is not None and run.origin.get(value[0], value[0]) is rec.producer), None)
        held = [s.inputs[k] if k is not None else out_placement(s, 0) for s in ch.strategies]
        found.append((v, k, nbytes, [nbytes / n if isinstance(p, Shard) else nbytes for p in held]))
    return found


def chosen_saved_bytes(choices: dict[fx.Node, Choice], fastest: bool = False) -> int:
    """Bytes per rank saved for backward under the chosen strategies (``Choice.saved``, which
    ``solve_sharding`` fills when it has an activation objective, plus the gathered inputs kept as shards);
    ``fastest``: under those of the fastest plan instead, which gathers nothing again
    (``solve_sharding(least_activations=True)`` records them)."""
    return int(sum(ch.saved[ch.fastest if fastest else ch.chosen] + (0 if fastest else ch.saved_inputs)
                   for ch in choices.values() if ch.saved))


def solve_sharding(gm: fx.GraphModule, n: int, param_names: dict[fx.Node, str], *, cost: LinkCost = DEFAULT_COST,
                   memory_budget: int | None = None, trainable: set[fx.Node] | None = None,
                   fixed: dict[str, Any] | None = None, activation_budget: int | None = None,
                   least_activations: bool = False) -> dict[fx.Node, Choice]:
    """Chooses a strategy per node (see the module docstring); writes ``meta[KEY]``.

    ``param_names``: the parameter placeholders; ``trainable``: those with gradients (default all);
    ``fixed``: parameter placements already decided (the runtime stores parameters that way).
    ``activation_budget``: bytes per rank the forward may save for backward (``saved_bytes``);
    ``least_activations``: keep the parameters as the fastest plan shards them, find the least such
    bytes any placement of the values reaches, then the cheapest communication within
    ``ACTIVATION_SLACK`` of it. In a transformer this is sequence parallelism (Korthikanti et al.
    2022): the values between the tensor-parallel regions (residual stream, norms, dropout) sharded
    along the sequence, each forward all-reduce a reduce-scatter and an all-gather. The runtime then
    keeps an all-gathered input a node saves as its shards and gathers it again in backward
    (``runtime/regather.py``): the pair of choices that gathers it saves 1/n of its bytes and pays
    one more all-gather.

    Three steps: build the integer program (``Program.build``), solve it (``_solve``: once, or in two
    phases for the least activations), and write the choice back (``_apply``).
    """
    trainable = set(param_names) if trainable is None else trainable
    same_as = {a: b for a, b in repeated_blocks(gm).items()  # identical layers are decided once
               if a.target is not operator.getitem}
    choices = candidate_strategies(gm, n, param_names, fixed, same_as)
    budget = memory_budget if memory_budget is not None else default_budget(gm, n, param_names, choices)
    with_activations = activation_budget is not None or least_activations
    saved_rows = saved_bytes(gm, n, choices, set(param_names), trainable) if with_activations else []
    program = Program.build(gm, n, choices, same_as, param_names, requires_grad(gm, trainable), cost,
                            regathered=_regathered(saved_rows) if least_activations else {})
    program.budget_parameters(param_names, choices, n, budget)
    within = f"a budget of {budget:,} bytes per rank for parameters"
    if with_activations:
        saved = program.saved_activations(choices, saved_rows)
        if least_activations:
            activation_budget = _least_activations(program, choices, saved, activation_budget, within, param_names)
        program.constraints.append(LinearConstraint(saved.reshape(1, -1), -np.inf, activation_budget))
        within += f" and {activation_budget:,} for saved activations"
    objective = program.seconds + _held_tie_break(program, choices, n, cost) if least_activations else program.seconds
    _apply(program, choices, program.solve(objective, within).x)
    return choices


def _held_tie_break(program: Program, choices: dict[fx.Node, Choice], n: int, cost: LinkCost) -> np.ndarray:
    """Among plans of equal time, the one whose values that cross a layer boundary (what a pipeline cut sends)
    hold the fewest bytes per rank: such a value sharded costs 1/n of its bytes, a replicated or partial one all
    of them. Weighted so that all of it together is a hundredth of one collective call: it only breaks ties.
    Under sequence parallelism this keeps the residual stream sharded between layers where reducing it before
    or after a residual add costs the same, so a pipeline sends shards, not partial sums (as Megatron-LM's
    sequence parallelism does)."""
    held = np.zeros(len(program.seconds))
    for node, ch in choices.items():
        if all(node_layer(u) == node_layer(node) for u in node.users):
            continue
        val = node.meta.get("val")
        outs = val if isinstance(val, (tuple, list)) else (val,)
        for k, st in enumerate(ch.strategies):
            placed = st.output if isinstance(st.output, tuple) else (st.output,) * len(outs)
            held[program.offset[node] + k] = sum(tensor_bytes(v) / (n if isinstance(p, Shard) else 1)
                                                 for v, p in zip(outs, placed))
    top = sum(float(held[program.offset[nd] : program.offset[nd] + len(ch.strategies)].max(initial=0.0))
              for nd, ch in choices.items())  # the most any plan holds there
    step = (cost.launch + cost.latency or 1e-6) * 1e6  # one collective call's fixed time, in the objective's unit
    return held * (0.01 * step / top) if top else held


def _regathered(saved_rows: list[tuple[fx.Node, int | None, int, list[float]]]) -> dict[tuple[fx.Node, int], int]:
    """An all-gathered input a node saves is kept as its shards and gathered again in backward
    (runtime/regather.py), as Megatron-LM's sequence parallelism does: (node, input) -> whole bytes."""
    return {(v, k): nbytes for v, k, nbytes, _ in saved_rows if k is not None}


def _least_activations(program: Program, choices: dict[fx.Node, Choice], saved: np.ndarray,
                       activation_budget: int | None, within: str, param_names: dict[fx.Node, str]) -> int:
    """The two-phase solve: the parameters pinned as the fastest plan shards them, the least saved bytes any
    placement of the values then reaches; returns the activation budget that allows ``ACTIVATION_SLACK`` more."""
    fastest = program.solve(program.seconds, within).x
    for node, ch in choices.items():
        ch.fastest = int(np.argmax(fastest[program.offset[node] : program.offset[node] + len(ch.strategies)]))
    program.pin([program.offset[nd] + choices[nd].fastest for nd in param_names])
    least = float(saved @ program.solve(saved, within).x)
    limit = int(least * (1 + ACTIVATION_SLACK)) + 1
    return limit if activation_budget is None else min(activation_budget, limit)


def _apply(program: Program, choices: dict[fx.Node, Choice], x: np.ndarray) -> None:
    """Writes each node's chosen strategy to ``meta[KEY]`` and the bytes its chosen input pairs keep."""
    for node, ch in choices.items():
        ch.chosen = int(np.argmax(x[program.offset[node] : program.offset[node] + len(ch.strategies)]))
        node.meta[KEY] = ch.strategy
    for u, v, _, r in program.edges.values():
        choices[v].saved_inputs += float(r[choices[u].chosen, choices[v].chosen])
