"""Tensor parallelism end to end at compile time: solve placements, lower one graph per tp rank.

``tensor_parallel(cap, n, trainable)`` returns each tp rank's graph (with
``meta["val"]`` re-derived for local shapes, so later passes such as stage
cutting see local sizes), the placement of every parameter, and what the plan
shows: the collectives of one forward and backward with their bytes, and the
ops that ran replicated because no rule covers them.
"""
from __future__ import annotations

import dataclasses
import operator
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.fx as fx

from autopar.core.comm import OPS, LinkCost
from autopar.core.graph import Captured, SlotKind
from autopar.core.layout import Interleave
from autopar.core.plan import CollectiveRow, LayerLayout, MatmulRow
from autopar.passes.blocks import repeated_blocks
from autopar.passes.cost import requires_grad, tensor_bytes
from autopar.passes.fused_projections import interleave_fused_projections
from autopar.passes.inplace_views import check_writes
from autopar.passes.lower import lower_tp
from autopar.passes.rules import has_rule, replacement
from autopar.passes.rules.base import BATCH_MEAN, VOCAB_PARALLEL
from autopar.passes.sharding import DEFAULT_COST, chosen_saved_bytes, solve_sharding


@dataclass
class TensorParallel:
    graphs: list[fx.GraphModule]  # by tp index
    placements: dict[str, object]  # parameter name -> Replicate() or Shard(d)
    collectives: Counter  # ("forward" | "backward", op) -> count per step, per microbatch
    bytes: Counter  # same keys -> bytes
    fallbacks: list[str]
    layouts: dict[str, Interleave] = dataclasses.field(default_factory=dict)  # parameters stored re-ordered
    layer: LayerLayout | None = None  # the first repeated layer, Megatron-style


def tensor_parallel(cap: Captured, n: int, trainable: set[str], memory_budget: int | None = None,
                    fixed: dict[str, object] | None = None, cost: LinkCost = DEFAULT_COST,
                    sequence_parallel: bool = False) -> TensorParallel:
    """Solves and lowers ``cap`` for a tp axis of ``n``; ``fixed`` pins parameter placements chosen before.

    ``cost``: the tp axis's collective cost (a cluster's ``axis_cost``; default the solver's own).
    ``sequence_parallel``: ask the solver for the least activations saved per rank
    (``solve_sharding(least_activations=True)``), then the cheapest communication.
    """
    layouts = interleave_fused_projections(cap, n)
    placeholders = [nd for nd in cap.gm.graph.nodes if nd.op == "placeholder"]
    params = {nd: s.name for nd, s in zip(placeholders, cap.slots) if s.kind is SlotKind.PARAM}
    leaves = {nd for nd, name in params.items() if name in trainable}
    choices = solve_sharding(cap.gm, n, params, cost=cost, memory_budget=memory_budget, trainable=leaves,
                             fixed=fixed, least_activations=sequence_parallel)
    rg = requires_grad(cap.gm, leaves)
    placements = {name: choices[nd].strategy.output for nd, name in params.items()}
    inside = sorted({str(nd.target) for nd, ch in choices.items() if nd.op == "call_function"
                     and ch.strategy.note in (VOCAB_PARALLEL, BATCH_MEAN)
                     and nd.target is not torch.ops.aten.embedding.default  # masks ids; no communication
                     and replacement(nd.target, ch.strategy) is not None})
    fallbacks = sorted({str(nd.target) for nd in cap.gm.graph.nodes
                        if nd.op == "call_function" and nd.target is not operator.getitem and not has_rule(nd.target)})
    gm = lower_tp(cap.gm, choices, n, rg)  # one graph: rank-dependent values are read at run time
    check_writes(gm, n)
    lowered = [nd for nd in gm.graph.nodes if nd.op == "placeholder"]  # the signature is unchanged by lowering
    counts, nbytes = count_collectives(gm, requires_grad(gm, {lowered[placeholders.index(nd)] for nd in leaves}),
                                       regather=sequence_parallel)
    summary = layer_summary(gm, repeated_blocks(cap.gm), regather=sequence_parallel)
    if summary is not None:
        summary = dataclasses.replace(summary, inside=tuple(inside))
    if summary is not None and sequence_parallel:  # what it saves: the solver's account, with and without
        summary = dataclasses.replace(summary, saved=(chosen_saved_bytes(choices),
                                                      chosen_saved_bytes(choices, fastest=True)))
    return TensorParallel([gm] * n, placements, counts, nbytes, fallbacks, layouts, summary)


SHOWN = {"mm", "bmm", "addmm", "baddbmm", "linear", "matmul", "scaled_dot_product_attention", "embedding"}


def layer_summary(gm: fx.GraphModule, same_as: dict[fx.Node, fx.Node], regather: bool = False) -> LayerLayout | None:
    """The first repeated layer as Megatron draws it: each matmul's parallel style and each collective
    (``regather``: sequence parallelism gathers its ``all_gather_rs`` inputs again in backward)."""
    from autopar.passes.stage_cuts import module_path

    firsts = set(same_as.values())
    paths = [p for nd in firsts for p in module_path(nd) if p.rsplit(".", 1)[-1].isdigit()]
    if not paths:
        return None
    block = min(paths, key=lambda p: (p.count("."), p))
    rows: list[MatmulRow | CollectiveRow] = []
    inside = False
    for nd in gm.graph.nodes:
        if nd.op != "call_function":
            continue
        mods = module_path(nd)
        if mods:
            inside = block in mods
        if not inside:
            continue
        if getattr(nd.target, "namespace", None) == "autopar":
            name = nd.target._opname
            if name in OPS and OPS[name].role:
                again = ", all-gather again in backward" if regather and name == "all_gather_rs" else ""
                rows.append(CollectiveRow(name, OPS[name].role + again))
            continue
        op = getattr(nd.target, "_opname", str(nd.target))
        if op not in SHOWN:
            continue
        where = mods[-1].removeprefix(block + ".") if mods else "?"
        strategy = nd.meta.get("autopar.placement")
        note = getattr(strategy, "note", "") or "replicated"
        rows.append(MatmulRow(where, op, note))
    return LayerLayout(block, tuple(rows))


def collective_calls(nodes: Iterable[fx.Node], needs_grad: dict[fx.Node, bool],
                     regather: bool = False) -> Iterator[tuple[fx.Node, str, str]]:
    """``(node, direction, collective)`` for each collective that the tp ops among ``nodes`` perform in one
    forward and backward (``comm.OPS``).

    A collective has a backward only where its input needs a gradient (``needs_grad``, from
    ``passes.cost.requires_grad``): not on user inputs, integer values or what frozen parameters compute.
    ``regather`` (sequence parallelism): an ``all_gather_rs`` output that a consumer saves for its
    weight's gradient is kept as its shards and gathered again in backward (``runtime/regather.py``).
    """
    for nd in nodes:
        if nd.op != "call_function" or getattr(nd.target, "namespace", None) != "autopar":
            continue
        op = OPS.get(nd.target._opname)  # None: not a tp collective (ZeRO's ops)
        if op is not None and op.forward:
            yield nd, "forward", op.forward
        if op is not None and op.backward and needs_grad.get(nd.args[0], False):
            yield nd, "backward", op.backward
            if regather and nd.target._opname == "all_gather_rs" and _saved_for_a_weight(nd, needs_grad):
                yield nd, "backward", "all_gather"


VIEWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
         torch.ops.aten.t.default, torch.ops.aten.transpose.int, torch.ops.aten.permute.default,
         torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.alias.default}


def _saved_for_a_weight(nd: fx.Node, needs_grad: dict[fx.Node, bool]) -> bool:
    """Whether a consumer of ``nd`` (or of a view of it) has another input that needs a gradient: a matmul
    with a trainable weight, which saves ``nd`` to compute that gradient."""
    users = list(nd.users)
    while users:
        user = users.pop()
        if user.op == "call_function" and user.target in VIEWS:
            users += list(user.users)
        elif any(needs_grad.get(a, False) for a in user.all_input_nodes if a is not nd):
            return True
    return False


def count_collectives(gm: fx.GraphModule, needs_grad: dict[fx.Node, bool],
                      regather: bool = False) -> tuple[Counter, Counter]:
    """The tp collectives one forward and backward of ``gm`` performs, by direction and op, and their bytes
    (``collective_calls``)."""
    counts: Counter = Counter()
    nbytes: Counter = Counter()
    for nd, direction, kind in collective_calls(gm.graph.nodes, needs_grad, regather):
        # bytes each rank contributes (as the runtime counts them): the local piece of an all-gather
        source = nd.args[0] if OPS[nd.target._opname].forward == "all_gather" else nd
        counts[(direction, kind)] += 1
        nbytes[(direction, kind)] += tensor_bytes(source.meta.get("val"))
    return counts, nbytes


def with_graph(cap: Captured, gm: fx.GraphModule) -> Captured:
    """``cap`` with its graph replaced (the signature is unchanged by lowering)."""
    return dataclasses.replace(cap, gm=gm)
