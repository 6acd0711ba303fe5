"""The sharding solver's integer program (``passes/sharding.py`` builds, solves and applies it).

A binary variable per (node, strategy); nodes of repeated blocks share their first block's variables.
Per edge whose cost depends on both ends' choices, a variable per pair of producer and consumer
strategies, linked to both ends (``sum_j e_ij = x_ui``, ``sum_i e_ij = x_vj``) so that the pair's
redistribution cost is paid exactly when both are chosen. The objective is seconds of collectives
(``autopar.core.comm``); the constraints are one strategy per node, the parameter budget, and, when asked,
the bytes saved for backward.
"""
from __future__ import annotations

import hashlib
import math
import operator
from collections import OrderedDict
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
from autopar.core.shared_dir import shared
from autopar.passes.cost import tensor_bytes
from autopar.passes.inplace_views import aliased_edges
from autopar.passes.rules import SUMS_INSIDE, Strategy
from autopar.passes.rules.base import R

NARROW_SUM_S = 1.0  # charged per sum over ranks in a dtype narrower than the parameters' (passes/sharding.py)
NARROW_SHARD_S = 1e-8  # per node computing a narrow value on shards (passes/sharding.py)
OP_S = 1e-9  # per inserted op: of two conversions priced alike, the one with fewer ops (reduce-scatter, not
             # all-reduce then chunk)
MILP_NODES = 100_000  # branch-and-bound nodes a solve may explore (the models tried need one)
MILP_SECONDS = 600
FORBIDDEN_S = 1e6  # the cost an impossible pair of choices is clipped to


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


# an edge: (producer, consumer, seconds per pair of strategies, saved bytes per rank the pair adds)
Edge = tuple[fx.Node, fx.Node, np.ndarray, np.ndarray]


@dataclass
class Program:
    """The integer program under construction: objective, equality rows and the variables' layout."""

    offset: dict[fx.Node, int]  # a node's first variable
    decisions: int  # variables [0, decisions) are the nodes' binary choices; the rest link edges
    c: list[float]  # seconds per variable
    rows: list[tuple[int, int, float]] = field(default_factory=list)  # sparse (row, col, value) of equalities
    rhs: list[float] = field(default_factory=list)
    edges: dict[tuple[int, int], Edge] = field(default_factory=dict)  # merged by the variables they join
    saved_on_edges: list[tuple[int, float]] = field(default_factory=list)  # (variable, bytes) pairs add
    forbidden: list[tuple[int, int]] = field(default_factory=list)  # variables never both chosen
    constraints: list[LinearConstraint] = field(default_factory=list)

    @classmethod
    def build(cls, gm: fx.GraphModule, n: int, choices: dict[fx.Node, Choice], same_as: dict[fx.Node, fx.Node],
              param_names: dict[fx.Node, str], rg: dict[fx.Node, bool], cost: LinkCost, *,
              regathered: dict[tuple[fx.Node, int], int]) -> "Program":
        """Variables and objective for ``choices``, equality rows, every edge linearised."""
        offset, decisions = {}, 0
        for node, ch in choices.items():
            if node not in same_as:
                offset[node] = decisions
                decisions += len(ch.strategies)
        for node in same_as:
            offset[node] = offset[same_as[node]]
        program = cls(offset, decisions, [0.0] * decisions)
        wide = max((v.meta["val"].dtype.itemsize for v in param_names if _floating(v, None)), default=0)
        program._one_per_node(choices, same_as, wide)
        for edge in _edges(choices, param_names, rg, cost, n, wide, regathered, program, aliased_edges(gm)):
            key = (offset[edge[0]], offset[edge[1]])  # edges between the same shared variables add up
            old = program.edges.get(key)
            program.edges[key] = edge if old is None else (edge[0], edge[1], old[2] + edge[2], old[3] + edge[3])
        program._outputs_replicated(gm, choices, n, cost, wide)
        for edge in program.edges.values():
            program._link(edge, choices)
        r, col, val = zip(*program.rows)
        eq = coo_matrix((val, (r, col)), shape=(len(program.rhs), len(program.c)))
        program.constraints.append(LinearConstraint(eq, program.rhs, program.rhs))
        return program

    def _one_per_node(self, choices: dict[fx.Node, Choice], same_as: dict[fx.Node, fx.Node], wide: int) -> None:
        """Exactly one strategy per node; narrow sums and narrow compute on shards charged (module docstring)."""
        for node, ch in choices.items():
            if node in same_as:
                continue
            base = self.offset[node]
            ins = [v for v in ch.inputs if v is not None]
            if ins and _floating(*ins[0]) and _itemsize(*ins[0]) < wide:  # a narrow sum inside a local replacement
                for i, s in enumerate(ch.strategies):
                    self.c[base + i] += NARROW_SUM_S * ((node.target, s.note) in SUMS_INSIDE)
            if node.op == "call_function" and _floating(node, None) and _itemsize(node, None) < wide:
                for i, s in enumerate(ch.strategies):  # narrow summands; narrow compute on shards
                    outs = pytree.tree_leaves(s.output)
                    self.c[base + i] += NARROW_SUM_S * any(isinstance(p, Partial) for p in outs) + \
                        NARROW_SHARD_S * any(isinstance(p, Shard) for p in outs)
            self._equal([(base + i, 1.0) for i in range(len(ch.strategies))], 1.0)

    def _outputs_replicated(self, gm: fx.GraphModule, choices: dict[fx.Node, Choice], n: int, cost: LinkCost,
                            wide: int) -> None:
        """Every graph output is made Replicate: its conversion is charged to its producer's choice."""
        out_node = next(nd for nd in gm.graph.nodes if nd.op == "output")
        for a in pytree.tree_leaves(out_node.args):
            if not (isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)):
                continue
            u, idx = (a.args[0], a.args[1]) if a.target is operator.getitem else (a, None)
            if u in choices:
                nbytes = tensor_bytes(a.meta["val"])
                narrow = NARROW_SUM_S if _floating(u, idx) and _itemsize(u, idx) < wide else 0.0
                for i, su in enumerate(choices[u].strategies):
                    src = out_placement(su, idx)
                    self.c[self.offset[u] + i] += conversion_time(src, R, nbytes, n, cost) + \
                        narrow * sums_over_ranks(src, R)

    def _link(self, edge: Edge, choices: dict[fx.Node, Choice]) -> None:
        """Adds an edge's cost: to one end's variables where it depends on that end only, else through a
        variable per pair tied to both ends."""
        u, v, m, r = edge
        ou, ov = self.offset[u], self.offset[v]
        if ou == ov:  # a node tied to itself: only the diagonal can be chosen
            self._charge(ou, [m[i, i] for i in range(m.shape[0])], [r[i, i] for i in range(m.shape[0])])
        elif len(choices[v].strategies) == 1 or max(np.ptp(m, axis=1).max(), np.ptp(r, axis=1).max()) == 0:
            self._charge(ou, m[:, 0], r[:, 0])  # the cost depends on u's choice only
        elif len(choices[u].strategies) == 1 or max(np.ptp(m, axis=0).max(), np.ptp(r, axis=0).max()) == 0:
            self._charge(ov, m[0, :], r[0, :])  # ... or on v's only
        else:
            base = len(self.c)
            self.c += list(m.reshape(-1))
            self.saved_on_edges += [(base + e, b) for e, b in enumerate(r.reshape(-1)) if b]
            rows, cols = m.shape
            for i in range(rows):  # sum_j e_ij = x_ui
                self._equal([(base + i * cols + j, 1.0) for j in range(cols)] + [(ou + i, -1.0)], 0.0)
            for j in range(cols):  # sum_i e_ij = x_vj
                self._equal([(base + i * cols + j, 1.0) for i in range(rows)] + [(ov + j, -1.0)], 0.0)

    def _charge(self, base: int, seconds: Any, saved: Any) -> None:
        for i, (t, b) in enumerate(zip(seconds, saved)):
            self.c[base + i] += t
            self.saved_on_edges.append((base + i, b))

    def _equal(self, terms: list[tuple[int, float]], value: float) -> None:
        row = len(self.rhs)
        self.rows += [(row, col, a) for col, a in terms]
        self.rhs.append(value)

    # constraints and objectives ----------------------------------------------------------------

    @property
    def seconds(self) -> np.ndarray:
        """The objective in microseconds: the solver's absolute gap (1e-6) is below ``OP_S``."""
        return np.array(self.c) * 1e6

    def budget_parameters(self, param_names: dict[fx.Node, str], choices: dict[fx.Node, Choice], n: int,
                          budget: int) -> None:
        mem = np.zeros(len(self.c))
        for node in param_names:
            nbytes = tensor_bytes(node.meta["val"])
            for i, s in enumerate(choices[node].strategies):
                mem[self.offset[node] + i] = nbytes // n if isinstance(s.output, Shard) else nbytes
        self.constraints.append(LinearConstraint(mem.reshape(1, -1), -np.inf, budget))

    def saved_activations(self, choices: dict[fx.Node, Choice],
                          saved_rows: list[tuple[fx.Node, int | None, int, list[float]]]) -> np.ndarray:
        """Bytes per rank saved for backward, per variable (recorded on ``Choice.saved`` too). The penalty that
        keeps parameters as stored is not in this objective, so it becomes a constraint here."""
        for v, _, _, row in saved_rows:
            choices[v].saved = row if choices[v].saved is None else [a + b for a, b in zip(choices[v].saved, row)]
        saved = np.zeros(len(self.c))
        for v, ch in choices.items():
            if ch.saved:
                saved[self.offset[v] : self.offset[v] + len(ch.saved)] += ch.saved
        for var, nbytes in self.saved_on_edges:
            saved[var] += nbytes
        if self.forbidden:
            pairs = coo_matrix((np.ones(2 * len(self.forbidden)), (np.repeat(np.arange(len(self.forbidden)), 2),
                                np.array(self.forbidden).reshape(-1))), shape=(len(self.forbidden), len(self.c)))
            self.constraints.append(LinearConstraint(pairs, -np.inf, 1))
        return saved

    def pin(self, variables: list[int]) -> None:
        """Each of ``variables`` chosen."""
        rows = coo_matrix((np.ones(len(variables)), (np.arange(len(variables)), variables)),
                          shape=(len(variables), len(self.c)))
        self.constraints.append(LinearConstraint(rows, 1, 1))

    def solve(self, objective: np.ndarray, within: str) -> Any:
        """Solves the program. Every rank solves it on its own, so the answer must not depend on the machine's
        speed: the search is bounded by branch-and-bound nodes, and the time limit only stops a runaway solve."""
        integrality = np.zeros(len(self.c))
        integrality[: self.decisions] = 1
        key = _digest(objective, integrality, self.constraints)
        result = _SOLVED.pop(key, None)
        if result is None:
            result = shared(key, lambda: milp(  # (the ranks of a job solve it once)
                objective, constraints=self.constraints, integrality=integrality, bounds=Bounds(0, 1),
                options={"node_limit": MILP_NODES, "time_limit": MILP_SECONDS, "mip_rel_gap": 1e-7}))
        _SOLVED[key] = result  # (most recently used last)
        while len(_SOLVED) > SOLVED_KEPT:
            _SOLVED.popitem(last=False)
        if result.status == 1 and "time" in str(result.message).lower():
            raise RuntimeError(f"the sharding program did not finish in {MILP_SECONDS} s within {within}, and the "
                               "plan it would stop at could differ between ranks; use a smaller tp or report the model")
        if result.x is None:
            raise RuntimeError(f"the sharding program found no plan within {within} ({result.message}); "
                               "raise memory_budget (or activation_budget)")
        result.x.flags.writeable = False  # (kept for the next equal program)
        return result


SOLVED_KEPT = 32
_SOLVED: OrderedDict[str, Any] = OrderedDict()  # solutions by their program's digest: a process compiling the same
# model on the same mesh again (another test, another ParallelModel) solves nothing; equal numbers, equal answer


def _digest(objective: np.ndarray, integrality: np.ndarray, constraints: list[LinearConstraint]) -> str:
    """A digest of every number of a program."""
    h = hashlib.blake2b(digest_size=20)
    for a in (objective, integrality):
        h.update(np.ascontiguousarray(a, dtype=np.float64).tobytes())
    for con in constraints:
        m = coo_matrix(con.A)
        for a in (m.row, m.col, m.data, np.asarray(m.shape), np.broadcast_to(con.lb, m.shape[:1]),
                  np.broadcast_to(con.ub, m.shape[:1])):
            h.update(np.ascontiguousarray(a, dtype=np.float64).tobytes())
            h.update(b"|")
    return h.hexdigest()


def _edges(choices: dict[fx.Node, Choice], param_names: dict[fx.Node, str], rg: dict[fx.Node, bool],
           cost: LinkCost, n: int, wide: int, regathered: dict[tuple[fx.Node, int], int],
           program: Program, aliased: set[tuple[fx.Node, fx.Node]]) -> list[Edge]:
    """Per input of each node, the seconds (and kept bytes) of each pair of producer and consumer strategies.
    A parameter is consumed as stored, and a value an in-place write reaches through views as it is
    (``aliased``, ``passes.inplace_views``): other pairs are infinite and recorded in ``program.forbidden``."""
    found = []
    for v, cv in choices.items():
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
                    if u in param_names and src != dst and dst is not None and not isinstance(dst, Partial) \
                            or (u, v) in aliased and src != dst and dst is not None:
                        t = math.inf  # a parameter is consumed as stored (a bias may join a partial sum)
                        program.forbidden.append((program.offset[u] + i, program.offset[v] + j))
                    t += narrow * (sums_over_ranks(src, dst) + sync)
                    if ops and ops[-1] == "all_gather_rs" and (v, k) in regathered:
                        t += ops_time(("all_gather",), nbytes, n, cost)
                        r[i, j] = regathered[(v, k)] / n - regathered[(v, k)]
                    m[i, j] = min(t, FORBIDDEN_S)
            found.append((u, v, m, r))
    return found


def _value(node: fx.Node, idx: int | None) -> Any:
    val = node.meta.get("val")
    return val[idx] if idx is not None and isinstance(val, (tuple, list)) else val


def _floating(node: fx.Node, idx: int | None) -> bool:
    val = _value(node, idx)
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _itemsize(node: fx.Node, idx: int | None) -> int:
    return _value(node, idx).dtype.itemsize
