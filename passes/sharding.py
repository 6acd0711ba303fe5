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
rounds at that dtype, not the model's, so it is charged ``NARROW_SUM_S`` (as is
a Partial value cast to a narrow dtype: each summand rounds) and
chosen only where no plan avoids it: the parallel run then rounds only where
the single-device model itself rounds. Narrow values are also computed
replicated where sharding them gains nothing (``NARROW_SHARD_S``, a tie-break):
a vectorized kernel may round an element differently by its position in the
tensor (a float32 ``exp`` over a shard is not always the full one's slice).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.utils import _pytree as pytree

from autopar.core.comm import LinkCost, conversion, conversion_time, ops_time
from autopar.passes.blocks import repeated_blocks
from autopar.passes.cost import requires_grad, tensor_bytes
from autopar.passes.rules import SUMS_INSIDE, Strategy, strategies
from autopar.passes.rules.base import R
from autopar.passes.saved import saved_tensors

KEY = "autopar.placement"
NARROW_SUM_S = 1.0  # charged per sum over ranks in a dtype narrower than the parameters' (see above)
NARROW_SHARD_S = 1e-8  # per node computing a narrow value on shards (see above)
OP_S = 1e-9  # per inserted op: of two conversions priced alike, the one with fewer ops (reduce-scatter, not
             # all-reduce then chunk)
MILP_NODES = 100_000  # branch-and-bound nodes a solve may explore (the models tried need one)
MILP_SECONDS = 600
ACTIVATION_SLACK = 0.01  # least_activations: communication time may buy back up to 1% more saved activations


# the solver's default axis: 10 us per collective, 50 GB/s per rank, a reduce-scatter charged as an all-reduce
DEFAULT_COST = LinkCost(bandwidth=50e9, launch=10e-6, scatter=2.0)


@dataclass
class Choice:
    """What the solver decided for one node."""

    strategies: list[Strategy]
    chosen: int = 0
    fastest: int | None = None  # least_activations: this node's strategy in the fastest plan
    saved_inputs: float = 0.0  # least_activations: bytes per rank its chosen inputs' pairs add to ``saved``
    saved: list[float] | None = None  # with an activation objective: bytes per rank saved under each strategy
    inputs: list[tuple[fx.Node, int | None] | None] = field(default_factory=list)  # value feeding each input

    @property
    def strategy(self) -> Strategy:
        return self.strategies[self.chosen]


def out_placement(strategy: Strategy, index: int | None) -> Any:
    out = strategy.output
    return out[index] if isinstance(out, tuple) and index is not None else out


def sums_over_ranks(src: Any, dst: Any) -> bool:
    """Whether turning ``src`` into ``dst`` adds the ranks' summands (forward; the backward adds nothing)."""
    return isinstance(src, Partial) and dst is not None and not isinstance(dst, Partial)


def needs_grad_sync(strategy: Strategy, placement: Any) -> bool:
    """A Replicate input of an op whose output is not Replicate gets a partial gradient."""
    outs = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)
    return isinstance(placement, Replicate) and any(not isinstance(o, Replicate) for o in outs)


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
    """
    same_as = {a: b for a, b in repeated_blocks(gm).items()  # identical layers are decided once
               if a.target is not operator.getitem}
    choices = candidate_strategies(gm, n, param_names, fixed, same_as)
    rg = requires_grad(gm, set(param_names) if trainable is None else trainable)
    budget = memory_budget if memory_budget is not None else default_budget(gm, n, param_names, choices)
    wide = max((v.meta["val"].dtype.itemsize for v in param_names if _floating(v, None)), default=0)
    nodes = list(choices)
    offset, n_vars = {}, 0
    for node in nodes:
        if node in same_as:
            continue
        offset[node] = n_vars
        n_vars += len(choices[node].strategies)
    for node in same_as:
        offset[node] = offset[same_as[node]]
    n_decisions = n_vars
    c: list[float] = [0.0] * n_vars
    forbidden: list[tuple[int, int]] = []  # pairs of variables never both chosen (a parameter not as stored)
    rows: list[tuple[int, int, float]] = []  # sparse (row, col, value) of equality constraints
    rhs: list[float] = []
    for node in nodes:  # exactly one strategy per node
        if node in same_as:
            continue
        ins = [v for v in choices[node].inputs if v is not None]
        if ins and _floating(*ins[0]) and _itemsize(*ins[0]) < wide:  # a narrow sum inside a local replacement
            for i, s in enumerate(choices[node].strategies):
                c[offset[node] + i] += NARROW_SUM_S * ((node.target, s.note) in SUMS_INSIDE)
        if node.op == "call_function" and _floating(node, None) and _itemsize(node, None) < wide:
            for i, s in enumerate(choices[node].strategies):  # narrow summands; narrow compute on shards
                outs = pytree.tree_leaves(s.output)
                c[offset[node] + i] += NARROW_SUM_S * any(isinstance(p, Partial) for p in outs) + \
                    NARROW_SHARD_S * any(isinstance(p, Shard) for p in outs)
        row = len(rhs)
        rows += [(row, offset[node] + i, 1.0) for i in range(len(choices[node].strategies))]
        rhs.append(1.0)
    saved_rows = saved_bytes(gm, n, choices, set(param_names), set(param_names) if trainable is None else trainable) \
        if activation_budget is not None or least_activations else []
    # least_activations: an all-gathered input a node saves is kept as its shards and gathered again in
    # backward (runtime/regather.py), as Megatron-LM's sequence parallelism does
    regathered = {(v, k): nbytes for v, k, nbytes, _ in saved_rows if k is not None} if least_activations else {}
    pair_cost: list[tuple[fx.Node, fx.Node, np.ndarray, np.ndarray]] = []  # (u, v, seconds, saved bytes per rank)
    for v in nodes:
        cv = choices[v]
        for k, value in enumerate(cv.inputs):
            if value is None:
                continue
            u, idx = value
            cu = choices[u]
            nbytes = tensor_bytes(u.meta["val"] if idx is None else u.meta["val"][idx])
            grad = rg.get(u, False) and _floating(u, idx)
            narrow = NARROW_SUM_S if _floating(u, idx) and _itemsize(u, idx) < wide else 0.0
            m = np.zeros((len(cu.strategies), len(cv.strategies)))
            r = np.zeros_like(m)
            for i, su in enumerate(cu.strategies):
                src = out_placement(su, idx)
                for j, sv in enumerate(cv.strategies):
                    dst = sv.inputs[k]
                    sync = grad and dst is not None and needs_grad_sync(sv, dst)
                    ops = conversion(src, dst, sync)
                    t = math.inf if ops is None else ops_time(ops, nbytes, n, cost) + OP_S * len(ops)
                    if u in param_names and src != dst and dst is not None and not isinstance(dst, Partial):
                        t = math.inf  # a parameter is consumed as stored (a bias may join a partial sum)
                        forbidden.append((offset[u] + i, offset[v] + j))
                    t += narrow * (sums_over_ranks(src, dst) + sync)
                    if ops and ops[-1] == "all_gather_rs" and (v, k) in regathered:
                        t += ops_time(("all_gather",), nbytes, n, cost)
                        r[i, j] = regathered[(v, k)] / n - regathered[(v, k)]
                    m[i, j] = min(t, 1e6)
            pair_cost.append((u, v, m, r))
    out_node = next(nd for nd in gm.graph.nodes if nd.op == "output")
    for a in pytree.tree_leaves(out_node.args):
        if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
            u, idx = (a.args[0], a.args[1]) if a.target is operator.getitem else (a, None)
            if u in choices:
                nbytes = tensor_bytes(a.meta["val"])
                narrow = NARROW_SUM_S if _floating(u, idx) and _itemsize(u, idx) < wide else 0.0
                for i, su in enumerate(choices[u].strategies):
                    src = out_placement(su, idx)
                    c[offset[u] + i] += conversion_time(src, R, nbytes, n, cost) + narrow * sums_over_ranks(src, R)
    merged: dict[tuple[int, int], tuple[fx.Node, fx.Node, np.ndarray, np.ndarray]] = {}
    for u, v, m, r in pair_cost:  # edges between the same shared variables add up
        key = (offset[u], offset[v])
        merged[key] = (u, v, merged[key][2] + m, merged[key][3] + r) if key in merged else (u, v, m, r)
    saved_on_edges: list[tuple[int, float]] = []  # (variable, saved bytes per rank) the pairs of choices add
    for u, v, m, r in merged.values():
        if offset[u] == offset[v]:
            for i in range(m.shape[0]):  # a node tied to itself: only the diagonal can be chosen
                c[offset[u] + i] += m[i, i]
                saved_on_edges.append((offset[u] + i, r[i, i]))
            continue
        if len(choices[v].strategies) == 1 or max(np.ptp(m, axis=1).max(), np.ptp(r, axis=1).max()) == 0:
            for i in range(m.shape[0]):  # the cost depends on u's choice only
                c[offset[u] + i] += m[i, 0]
                saved_on_edges.append((offset[u] + i, r[i, 0]))
            continue
        if len(choices[u].strategies) == 1 or max(np.ptp(m, axis=0).max(), np.ptp(r, axis=0).max()) == 0:
            for j in range(m.shape[1]):  # ... or on v's only
                c[offset[v] + j] += m[0, j]
                saved_on_edges.append((offset[v] + j, r[0, j]))
            continue
        base = n_vars
        n_vars += m.shape[0] * m.shape[1]
        c += list(m.reshape(-1))
        saved_on_edges += [(base + e, b) for e, b in enumerate(r.reshape(-1)) if b]
        for i in range(m.shape[0]):  # sum_j e_ij = x_ui
            row = len(rhs)
            rows += [(row, base + i * m.shape[1] + j, 1.0) for j in range(m.shape[1])] + [(row, offset[u] + i, -1.0)]
            rhs.append(0.0)
        for j in range(m.shape[1]):  # sum_i e_ij = x_vj
            row = len(rhs)
            rows += [(row, base + i * m.shape[1] + j, 1.0) for i in range(m.shape[0])] + [(row, offset[v] + j, -1.0)]
            rhs.append(0.0)
    r, col, val = zip(*rows)
    eq = coo_matrix((val, (r, col)), shape=(len(rhs), n_vars))
    constraints = [LinearConstraint(eq, rhs, rhs)]
    mem = np.zeros(n_vars)
    for node in param_names:
        for i, s in enumerate(choices[node].strategies):
            nbytes = tensor_bytes(node.meta["val"])
            mem[offset[node] + i] = nbytes // n if isinstance(s.output, Shard) else nbytes
    constraints.append(LinearConstraint(mem.reshape(1, -1), -np.inf, budget))
    integrality = np.zeros(n_vars)
    integrality[:n_decisions] = 1
    seconds = np.array(c) * 1e6  # in microseconds: the solver's absolute gap (1e-6) is below OP_S
    within = f"a budget of {budget:,} bytes per rank for parameters"
    if activation_budget is not None or least_activations:
        for v, _, _, row in saved_rows:
            choices[v].saved = row if choices[v].saved is None else [a + b for a, b in zip(choices[v].saved, row)]
        saved = np.zeros(n_vars)
        for v, ch in choices.items():
            if ch.saved:
                saved[offset[v] : offset[v] + len(ch.saved)] += ch.saved
        for var, nbytes in saved_on_edges:
            saved[var] += nbytes
        if forbidden:  # the penalty that keeps parameters as stored is not in the other objectives: a constraint
            pairs = coo_matrix((np.ones(2 * len(forbidden)), (np.repeat(np.arange(len(forbidden)), 2),
                                np.array(forbidden).reshape(-1))), shape=(len(forbidden), n_vars))
            constraints.append(LinearConstraint(pairs, -np.inf, 1))
        if least_activations:  # the weights sharded as the fastest plan shards them; the least activations
            fastest = _milp(seconds, constraints, integrality, within).x
            for node in nodes:
                choices[node].fastest = int(np.argmax(fastest[offset[node] : offset[node] + len(choices[node].strategies)]))
            weights = [offset[nd] + choices[nd].fastest for nd in param_names]
            constraints.append(LinearConstraint(coo_matrix((np.ones(len(weights)), (np.arange(len(weights)), weights)),
                                                           shape=(len(weights), n_vars)), 1, 1))
            least = float(saved @ _milp(saved, constraints, integrality, within).x)
            limit = int(least * (1 + ACTIVATION_SLACK)) + 1
            activation_budget = limit if activation_budget is None else min(activation_budget, limit)
        constraints.append(LinearConstraint(saved.reshape(1, -1), -np.inf, activation_budget))
        within += f" and {activation_budget:,} for saved activations"
    result = _milp(seconds, constraints, integrality, within)
    for node in nodes:
        k = len(choices[node].strategies)
        choices[node].chosen = int(np.argmax(result.x[offset[node] : offset[node] + k]))
        node.meta[KEY] = choices[node].strategy
    for u, v, _, r in merged.values():
        choices[v].saved_inputs += float(r[choices[u].chosen, choices[v].chosen])
    return choices


def _milp(c: np.ndarray, constraints: list[LinearConstraint], integrality: np.ndarray, within: str) -> Any:
    """Solves the program. Every rank solves it on its own, so the answer must not depend on the machine's
    speed: the search is bounded by branch-and-bound nodes, and the time limit only stops a runaway solve."""
    result = milp(c, constraints=constraints, integrality=integrality, bounds=Bounds(0, 1),
                  options={"node_limit": MILP_NODES, "time_limit": MILP_SECONDS, "mip_rel_gap": 1e-7})
    if result.status == 1 and "time" in str(result.message).lower():
        raise RuntimeError(f"the sharding program did not finish in {MILP_SECONDS} s within {within}, and the plan "
                           "it would stop at could differ between ranks; use a smaller tp or report the model")
    if result.x is None:
        raise RuntimeError(f"the sharding program found no plan within {within} ({result.message}); "
                           "raise memory_budget (or activation_budget)")
    return result


def _value(node: fx.Node, idx: int | None) -> Any:
    val = node.meta.get("val")
    return val[idx] if idx is not None and isinstance(val, (tuple, list)) else val


def _floating(node: fx.Node, idx: int | None) -> bool:
    val = _value(node, idx)
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _itemsize(node: fx.Node, idx: int | None) -> int:
    return _value(node, idx).dtype.itemsize
