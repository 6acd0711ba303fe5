"""Compilation as one ordered list of passes over a ``Compilation``, run by ``compile_program``.

``PASSES`` is the whole compiler, read in one place: each ``Pass`` names what it does, when it applies, and
the invariant it leaves (``ensures``). The driver runs them in order, logs each (``AUTOPAR_DEBUG=1``: its
name, node counts, time and detail) and, with ``AUTOPAR_CHECK_PASSES=1`` (the test suite sets it), checks
every pass's invariant before the next one starts. docs/architecture.md shows the list.
"""
from __future__ import annotations

import dataclasses
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import Placement, Shard

from autopar.compiler.capture import Captured, capture
from autopar.compiler.capture_cache import EXPORTS
from autopar.core.errors import CaptureError, UnsupportedError
from autopar.core.graph import SlotKind, StageGraph, copy_module, origin, placeholder_kinds
from autopar.core.mesh import Mesh
from autopar.core.plan import Collective, CompiledPlan, Plan, Timings, memory
from autopar.core.schedule import Schedule, add_communication
from autopar.core.schedules import make_schedule
from autopar.core.simulate import simulate
from autopar.compiler.log import log_pass
from autopar.options import Options
from autopar.passes.batch_checks import check_no_share_statistics, check_samples_apart, sums_over_samples
from autopar.passes.context_checks import check_same_numbers
from autopar.passes.context_dropout import whole_sequence_dropout
from autopar.passes.context_eager import sdpa_from_eager
from autopar.passes.context_parallel import (ATTENTIONS, context_parallel, ring_kv_bytes, ring_per_pp_rank,
                                             same_attention)
from autopar.passes.expert_parallel import expert_parallel, no_experts_found, per_pp_rank
from autopar.passes.global_count import normalize_by_global_count
from autopar.passes.inductor_regions import Regions, inductor_regions
from autopar.passes.stage_cuts import choose_split_points, split_stages
from autopar.passes.tensor_parallel import tensor_parallel, with_graph
from autopar.compiler.precision_program import apply_to_program, describe_reductions
from autopar.precision import check_model
from autopar.compiler.program import (
    Program, RankGraphs, add_pipeline_to_plan, add_tensor_parallel_to_plan, capture_device, check_buffer_updates,
    check_supported,
    initial_plan, optimizer_state_factor, rank_expert_bytes, rank_gradient_buckets, rank_parameter_bytes,
    split_backward, step_schedule, whole_graph_stage,
)
from autopar.compiler.recompute_program import apply_recompute
from autopar.runtime.batch import batch_size, cp_shard, later_sequence_dims, sequence_length
from autopar.compiler.zero_program import apply_zero

CHECK = "AUTOPAR_CHECK_PASSES"  # set (to 1): check each pass's invariant before the next runs


@dataclass
class Compilation:
    """What the passes read and write: the inputs of one compile, then what each pass adds."""

    model: torch.nn.Module
    mesh: Mesh
    options: Options
    local: tuple[tuple, dict, Any]  # one local microbatch: (args, kwargs, target); cp: one cp rank's chunks
    with_loss: bool
    split_points: list[str] | None = None  # pinned pipeline cuts (module names), else chosen
    pinned: dict[str, Placement] | None = None  # pinned tp placements of parameters
    trainable: set[str] = field(default_factory=set)
    captured: Captured | None = None
    plan: Plan | None = None
    lowered: list[Captured] = field(default_factory=list)  # by tp index (one when tp=1)
    placements: dict[str, Placement] = field(default_factory=dict)
    layouts: dict[str, Any] = field(default_factory=dict)
    schedule: Schedule | None = None
    stage_sets: list[list[StageGraph]] = field(default_factory=list)  # by tp index
    program: Program | None = None
    whole: tuple[tuple, dict, Any] | None = None  # cp: the microbatch with whole sequences
    cp_local: int = 0  # context parallelism: the tokens of each sequence a cp rank holds
    cp_shifted: dict[int, float] = field(default_factory=dict)  # cp: flat inputs the runtime shifts -> fill
    detail: str = ""  # what the running pass reports in the log

    @property
    def n_stages(self) -> int:
        return self.mesh.pp * self.options.virtual_stages


@dataclass(frozen=True)
class Pass:
    """One step of compilation: ``run`` it where ``applies``; ``ensures`` raises if its invariant fails."""

    name: str  # formatted with the compilation as ``c`` for the log
    run: Callable[[Compilation], None]
    ensures: Callable[[Compilation], None]
    applies: Callable[[Compilation], bool] = lambda c: True
    invariant: str = ""  # the invariant in words (docs/architecture.md)


# the passes ---------------------------------------------------------------------------------


def _capture(c: Compilation) -> None:
    check_supported(c.mesh, c.options)
    check_model(c.model, c.options.policy)
    hits = EXPORTS.hits
    try:
        c.captured = _export(c, c.local)
    except CaptureError as e:
        raise _cp_capture_error(c, e) from e
    check_buffer_updates(c.captured, c.mesh, c.options)
    _check_samples_apart(c)
    c.trainable = {n for n, p in c.model.named_parameters() if p.requires_grad}
    c.lowered = [c.captured]
    c.detail = "the same export as before (autopar/compiler/capture_cache.py)" if EXPORTS.hits > hits else "exported"


def _check_samples_apart(c: Compilation) -> None:
    """Where dp ranks or microbatches split the batch, no op of the captured graph computes along the samples;
    where they or cp ranks split it, none combines a statistic of a share with its values
    (``passes/batch_checks.py``)."""
    m = c.options.microbatches
    parts = ([f"dp={c.mesh.dp}"] if c.mesh.dp > 1 else []) + ([f"microbatches={m}"] if m > 1 else [])
    split = " and ".join(parts)
    batch = batch_size(c.local[:2])
    graph = c.captured.gm.graph
    kinds = placeholder_kinds(graph, c.captured.slots)
    if split:
        check_samples_apart(graph, kinds, batch, split)
        for node in sums_over_samples(graph, kinds, batch):
            warnings.warn(f"the loss sums over the samples ({node.name}, {node.target}{_at(node)}) without "
                          f"dividing by a count: {split} split the batch and the parts' losses are averaged, as the "
                          f"loss is a mean over the batch, so this loss and its gradients come out divided by the "
                          f"number of parts; take the mean, or divide the sum by a count of the inputs "
                          f"(mask.sum())", stacklevel=2)
    shares = ([f"{split} split{'s' if len(parts) == 1 else ''} the batch"] if split else []) + \
        ([f"cp={c.mesh.cp} splits the sequence"] if c.mesh.cp > 1 else [])
    if shares:
        check_no_share_statistics(graph, kinds, batch, " and ".join(shares))


def _at(node: fx.Node) -> str:
    """`` in <module>`` where ``node`` comes from, if known."""
    return f" {origin(node)}" if origin(node) else ""


def _cp_capture_error(c: Compilation, error: CaptureError) -> CaptureError:
    """``error``, and under cp the inputs that keep the whole sequence in a later dim (a likely cause)."""
    length = sequence_length(c.whole) if c.whole is not None else None
    held = later_sequence_dims(c.whole, length) if length is not None else []
    local = sequence_length(c.local)
    if length is None or local is None or local >= length:
        return error
    cut = f"under cp={c.mesh.cp} each rank is captured on its {local} of the {length} tokens of every sequence (dim 1 " \
          f"of each input cut)"
    if held:
        inputs = ", ".join(f"the input at {where} of shape {shape}" for where, shape in held)
        why = (f"{cut}, but {inputs} also holds the sequence in a later dim, which stays whole; pass a (batch, "
               f"sequence) padding mask and let the model build its (query, key) mask")
    else:
        why = (f"{cut}; a layer sized by the sequence's length (a Linear over the tokens, a weight of {length} "
               f"positions read whole) cannot run on a chunk; run without cp")
    return CaptureError(f"torch.export could not capture {type(c.model).__name__} on one cp rank's chunks",
                        cause=error.cause or error, hint=why)


def _export(c: Compilation, example: tuple[tuple, dict, Any]) -> Captured:
    args, kwargs, target = example
    return capture(c.model, args, kwargs, with_loss=c.with_loss, loss_fn=c.options.loss_fn, target=target,
                   compute_dtype=c.options.policy.compute if c.options.policy else None)


def _loss_counts(c: Compilation) -> None:
    counts = c.captured.counts = normalize_by_global_count(c.captured)
    c.detail = f"{len(counts.sources) if counts else 0} terms: {', '.join(counts.sources) if counts else '-'}"
    c.plan = initial_plan(c.model, c.mesh, c.options, c.captured, c.local[0])


def _expert_parallel(c: Compilation) -> None:
    found = expert_parallel(c.captured, c.mesh.ep)
    if not found.layers:
        raise no_experts_found(c.model, c.mesh.ep)
    c.lowered = [with_graph(c.captured, found.gm)]
    found.add_to(c.plan)
    c.detail = f"{len(found.layers)} layers, {found.layers[0].experts} experts each over ep={c.mesh.ep}"


def _context_parallel(c: Compilation) -> None:
    local = sequence_length(c.local)
    if local is None:
        raise UnsupportedError(f"{c.mesh} has cp={c.mesh.cp}, but no input has a sequence dim (dim 1 of a "
                               f"(batch, sequence, ...) tensor) to shard; use a mesh without cp")
    whole, _ = sdpa_from_eager(_export(c, c.whole).gm)  # the model on whole sequences: attentions' forms, masks
    mine, eager = sdpa_from_eager(c.captured.gm)  # eager matmul-softmax-matmul chains as SDPA, on both captures
    same_attention(whole, mine)
    check_same_numbers(whole, mine)
    found = context_parallel(with_graph(c.captured, mine), c.mesh.cp, local, whole, c.options.cp_attention,
                             c.mesh.cp_split)
    dropped = whole_sequence_dropout(found.gm, local)  # dropout as the rows of the whole sequence's mask
    c.lowered = [with_graph(c.captured, found.gm)]
    c.cp_local, c.cp_shifted = local, found.shifted
    found.add_to(c.plan, c.mesh.cp)
    c.detail = (f"{len(found.attentions)} attentions ({eager} eager) as {c.options.cp_attention} over "
                f"cp={c.mesh.cp}, {found.positions} positions made global, {len(found.shifted)} label inputs "
                f"shifted, {dropped} dropouts drawn on whole sequences; {local} tokens per rank")


def _tensor_parallel(c: Compilation) -> None:
    whole_kv = ring_kv_bytes(c.lowered[0].gm)
    tp = tensor_parallel(c.lowered[0], c.mesh.tp, c.trainable, fixed=c.pinned,  # (expert layers already rewritten)
                         sequence_parallel=c.options.sequence_parallel)
    c.lowered, c.placements, c.layouts = [with_graph(c.captured, g) for g in tp.graphs], tp.placements, tp.layouts
    add_tensor_parallel_to_plan(c.plan, c.mesh, tp)
    if whole_kv:  # context parallelism: the ring passes a tp rank's heads of K and V
        local_kv = ring_kv_bytes(c.lowered[0].gm)
        c.plan.collectives = [dataclasses.replace(x, bytes=x.bytes * local_kv // whole_kv) if x.axis == "cp" else x
                              for x in c.plan.collectives]
    c.detail = f"{sum(isinstance(p, Shard) for p in tp.placements.values())} parameters sharded"


def _pipeline_cuts(c: Compilation) -> None:
    options, mesh = c.options, c.mesh
    n_stages = mesh.pp * options.virtual_stages
    c.schedule = make_schedule(options.schedule, mesh.pp, options.microbatches, options.virtual_stages)
    simulate(add_communication(c.schedule))  # raises on a deadlock before anything runs
    if c.split_points is None:
        c.split_points = (list(options.split_points) if options.split_points
                          else choose_split_points(c.lowered[0].gm, n_stages))
    if len(c.split_points) != n_stages - 1:
        raise ValueError(f"{len(c.split_points)} split points give {len(c.split_points) + 1} stages, but pp={mesh.pp} "
                         f"x stages_per_rank={options.virtual_stages} needs {n_stages}; pass {n_stages - 1} split "
                         f"points")
    cut: dict[int, list[StageGraph]] = {}  # tp ranks share one lowered graph: cut it once
    for lowered in c.lowered:
        if id(lowered.gm) not in cut:
            cut[id(lowered.gm)] = split_stages(lowered, c.split_points, c.trainable)
        c.stage_sets.append(cut[id(lowered.gm)])
    c.detail = "cuts before " + ", ".join(c.split_points)


def _split_backward(c: Compilation) -> None:
    c.stage_sets, count = split_backward(c.stage_sets, c.trainable)
    c.detail = f"{count} weight matmuls defer their weight gradient"


def _assemble(c: Compilation) -> None:
    if c.stage_sets:
        by_tp = c.stage_sets
        add_pipeline_to_plan(c.plan, c.stage_sets[0], c.schedule, c.split_points)
        per_pp_rank(c.plan, c.stage_sets[0], c.schedule.stage_to_rank)  # (the expert exchanges of its layers)
        ring_per_pp_rank(c.plan, c.stage_sets[0], c.schedule.stage_to_rank)
    else:  # tp indices may share one lowered graph: one stage for it
        whole = {id(x.gm): [whole_graph_stage(c.captured, x.gm)] for x in c.lowered}
        by_tp = [whole[id(x.gm)] for x in c.lowered]
    c.program = Program(captured=c.captured, graphs=RankGraphs(c.mesh, by_tp, c.schedule), plan=c.plan,
                        split_points=c.split_points or [], placements=c.placements, layouts=c.layouts,
                        trainable=c.trainable, device=capture_device(c.model), cp_local=c.cp_local,
                        cp_shifted=c.cp_shifted)
    placeholders = [nd for nd in c.captured.gm.graph.nodes if nd.op == "placeholder"]
    c.program.param_of = {nd.name: s.name for nd, s in zip(placeholders, c.captured.slots) if s.kind is SlotKind.PARAM}


def _mixed_precision(c: Compilation) -> None:
    apply_to_program(c.program, c.model, c.options.policy, with_loss=c.with_loss)
    c.detail = "fp32 placeholders cast at their first use"


def _step_schedule(c: Compilation) -> None:
    c.program.step = step_schedule(c.program, c.mesh, c.options, training=c.with_loss)
    simulate(c.program.step)  # raises on a broken or deadlocking step before anything runs


def _memory_and_dp(c: Compilation) -> None:
    """Per-rank memory and data-parallel traffic from the ranks' own graphs (local shapes, their stages)."""
    program, options = c.program, c.options
    per_rank = {r: rank_parameter_bytes(program, c.mesh, r) for r in range(c.mesh.size)}
    factor = optimizer_state_factor(options)
    if options.zero:  # ZeRO's layouts, estimate and dp collectives replace data parallelism's
        collectives = apply_zero(program, c.model, c.mesh, options, factor=factor,
                                 frozen_bytes={r: p - t for r, (p, t) in per_rank.items()})
        program.plan.collectives = [x for x in program.plan.collectives if x.axis != "dp"] + collectives
        c.detail = f"zero={options.zero}: {len(program.zero_layouts[0].groups)} flat groups on rank 0"
        return
    worst = max(per_rank, key=lambda r: per_rank[r][0])
    params, grads = per_rank[worst]
    program.plan.memory = memory({"parameters": params, "gradients": grads, "optimizer": factor * grads}, worst)
    routed = rank_expert_bytes(program, c.mesh, worst)  # over ep_replicate, not dp
    order = [n for n, _ in c.model.named_parameters()]

    def buckets(experts: bool) -> int:  # (tensors whole, as the runtime's buckets hold them)
        return rank_gradient_buckets(program, c.mesh, worst, order, options.bucket_bytes, routed=experts)

    program.plan.collectives = [
        Collective(x.axis, x.op, buckets(False), grads - routed, x.what) if x.axis == "dp" else x
        for x in program.plan.collectives
    ] + ([Collective("ep_replicate", "all_reduce", buckets(True), routed,
                     "routed experts' gradient buckets among the ranks holding the same experts")]
         if routed and c.mesh["ep_replicate"] > 1 else [])


def _reductions(c: Compilation) -> None:
    describe_reductions(c.program, c.options.policy)


def _recompute(c: Compilation) -> None:
    c.program = apply_recompute(c.program, c.options)


def _inductor(c: Compilation) -> None:
    c.program.graphs.rewrite(_outlined)
    found = Regions()
    for st in c.program.own_stages(0):
        found.add(st.gm.meta["autopar.inductor"])
    c.program.plan.compiled = CompiledPlan(found.regions, len(found.distinct), found.compiled_ops,
                                           tuple(found.outside.most_common()), tuple(found.collectives.items()))
    c.detail = f"{found.regions} regions ({len(found.distinct)} distinct), {found.compiled_ops} ops on rank 0"


def _outlined(st: StageGraph) -> StageGraph:
    gm = copy_module(st.gm)
    gm.meta["autopar.inductor"] = inductor_regions(gm)
    return dataclasses.replace(st, gm=gm)


# the invariants -----------------------------------------------------------------------------


def _graphs_lint(graphs: list[fx.GraphModule]) -> None:
    for gm in {id(g): g for g in graphs}.values():
        gm.graph.lint()


def _ensure_captured(c: Compilation) -> None:
    placeholders = [nd for nd in c.captured.gm.graph.nodes if nd.op == "placeholder"]
    if len(placeholders) != len(c.captured.slots):
        raise AssertionError(f"capture: {len(placeholders)} placeholders but {len(c.captured.slots)} slots")
    _graphs_lint([c.captured.gm])


def _ensure_plan(c: Compilation) -> None:
    if c.plan is None or {p.name for p in c.plan.params} != set(c.captured.param_names):
        raise AssertionError("loss counts: the plan lists every captured parameter")


def _ensure_experts(c: Compilation) -> None:
    held = {n for layer in c.plan.experts for n in layer.params}
    if held != set(c.plan.expert_params) or not held <= set(c.captured.param_names):
        raise AssertionError("expert parallel: every expert parameter has a placement")
    for slot, nd in zip(c.captured.slots, [nd for nd in c.lowered[0].gm.graph.nodes if nd.op == "placeholder"]):
        if slot.name in held and any(u.op != "call_module" for u in nd.users):
            raise AssertionError(f"expert parallel: {slot.name} is still read outside its layer's experts")
    _graphs_lint([c.lowered[0].gm])


def _ensure_context_parallel(c: Compilation) -> None:
    gm = c.lowered[0].gm
    if any(n.target in ATTENTIONS for n in gm.graph.nodes):
        raise AssertionError("context parallel: an attention is left unrewritten")
    _graphs_lint([gm])


def _ensure_tensor_parallel(c: Compilation) -> None:
    if len(c.lowered) != c.mesh.tp:
        raise AssertionError(f"tensor parallel: {len(c.lowered)} graphs for tp={c.mesh.tp}")
    missing = set(c.captured.param_names) - set(c.placements)
    if missing:
        raise AssertionError(f"tensor parallel: no placement for {sorted(missing)[:3]}")
    _graphs_lint([x.gm for x in c.lowered])


def _ensure_cut(c: Compilation) -> None:
    n = c.mesh.pp * c.options.virtual_stages
    for stages in c.stage_sets:
        if [st.index for st in stages] != list(range(n)):
            raise AssertionError(f"pipeline cut: stages {[st.index for st in stages]}, expected 0..{n - 1}")
        held = {name for st in stages for name in st.params}
        if held != set(c.captured.param_names):
            raise AssertionError(f"pipeline cut: parameters in no stage: {sorted(set(c.captured.param_names) - held)[:3]}")
        _graphs_lint([st.gm for st in stages])


def _ensure_program(c: Compilation) -> None:
    n, sizes = c.n_stages if c.mesh.pp > 1 else 1, [len(stages) for stages in c.program.graphs.by_tp]
    if sizes != [n] * c.mesh.tp:
        raise AssertionError(f"assemble: {sizes} stages by tp index, expected {n} for each of tp={c.mesh.tp}")


def _ensure_step(c: Compilation) -> None:
    if c.program.step is None or len(c.program.step.actions) != c.mesh.pp:
        raise AssertionError("step schedule: one program of actions per pp rank")


def _ensure_memory(c: Compilation) -> None:
    if c.program.plan.memory is None:
        raise AssertionError("memory: the plan has a per-rank memory estimate")
    if c.options.zero and set(c.program.zero_layouts) != set(range(c.mesh.size)):
        raise AssertionError("zero: a layout for every rank")


def _ensure_graphs_lint(c: Compilation) -> None:
    _graphs_lint([c.program.graph(r) for r in range(c.mesh.size)])


def _ensure_regions(c: Compilation) -> None:
    for r in range(c.mesh.size):
        gm = c.program.graph(r)
        gm.graph.lint()
        if "autopar.inductor" not in gm.meta:
            raise AssertionError(f"inductor regions: rank {r}'s graph was not outlined")


def _nothing(c: Compilation) -> None:
    return None


PASSES: tuple[Pass, ...] = (
    Pass("capture (torch.export)", _capture, _ensure_captured,
         invariant="one ATen graph; a slot (parameter, buffer, input, constant) per placeholder"),
    Pass("loss counts (means over counted items divided by the whole batch's count)", _loss_counts, _ensure_plan,
         invariant="each mean over a data-dependent count divides by a new input; the plan lists every parameter"),
    Pass("expert parallel (ep={c.mesh.ep})", _expert_parallel, _ensure_experts, applies=lambda c: c.mesh.ep > 1,
         invariant="each layer's routed experts run on the ep rank holding them; one graph for every rank"),
    Pass("context parallel (cp={c.mesh.cp})", _context_parallel, _ensure_context_parallel,
         applies=lambda c: c.mesh.cp > 1,
         invariant="attentions are rings over cp; positions are the rank's global ones; one graph for every rank"),
    Pass("tensor parallel (solve + lower, tp={c.mesh.tp})", _tensor_parallel, _ensure_tensor_parallel,
         applies=lambda c: c.mesh.tp > 1,
         invariant="one lowered graph per tp index, local shapes; every parameter has a placement"),
    Pass("pipeline cut ({c.n_stages} stages)", _pipeline_cuts, _ensure_cut, applies=lambda c: c.mesh.pp > 1,
         invariant="pp x stages-per-rank stage graphs per tp index; every parameter in a stage"),
    Pass("split backward (B: input gradients, W: weight gradients)", _split_backward, _ensure_cut,
         applies=lambda c: c.schedule is not None and c.schedule.splits_backward,
         invariant="weight matmuls leave their weight gradients to the W actions; the same stages"),
    Pass("assemble (each rank's graphs)", _assemble, _ensure_program,
         invariant="a graph for every rank of the mesh"),
    Pass("mixed precision", _mixed_precision, _ensure_graphs_lint, applies=lambda c: c.options.policy is not None,
         invariant="placeholders take parameters and inputs as fed, cast at their first use; float32 loss"),
    Pass("step schedule", _step_schedule, _ensure_step,
         invariant="one program of actions per pp rank, simulated without deadlock"),
    Pass("memory and data parallelism (zero={c.options.zero}, over {c.mesh.zero_axis})", _memory_and_dp, _ensure_memory,
         invariant="per-rank memory estimate; dp collectives; zero > 0: a flat layout per rank"),
    Pass("reductions (dtypes of the gradient reductions)", _reductions, _nothing,
         invariant="the plan names the dtype each reduction runs in"),
    Pass("recompute", _recompute, _ensure_graphs_lint, applies=lambda c: c.options.recompute != "none",
         invariant="each recomputed layer's forward outlined into a region backward runs again"),
    Pass("inductor regions (compile=True)", _inductor, _ensure_regions, applies=lambda c: c.options.compile,
         invariant="the ATen ops between collectives and exchanges outlined into regions inductor compiles"),
)


def compile_program(
    model: torch.nn.Module, mesh: Mesh, options: Options, local: tuple[tuple, dict, Any], *, with_loss: bool,
    split_points: list[str] | None = None, placements: dict[str, Any] | None = None,
) -> Program:
    """Captures ``model`` on one local microbatch ``(args, kwargs, target)`` and lowers it for every rank.

    ``split_points`` (module names) fixes the pipeline cuts; by default they come
    from ``options`` or are chosen by cost, and the program records them.
    ``placements`` pins the tp placement of parameters (every graph of one model
    must agree with how the runtime stores them).
    """
    whole = None
    if mesh.cp > 1:  # the graph of one cp rank: its chunks of every sequence (cp rank 0's; all ranks' shapes)
        whole, local = local, cp_shard(local, mesh.cp, 0)
    c = Compilation(model, mesh, options, local, with_loss, split_points=split_points, pinned=placements,
                    whole=whole)
    check = os.environ.get(CHECK, "") not in ("", "0")
    seconds = []  # each pass's wall time, the capture's first
    for p in PASSES:
        if not p.applies(c):
            continue
        c.detail = ""
        start = time.perf_counter()
        with log_pass(p.name.format(c=c), _nodes(c)) as info:
            p.run(c)
            info["nodes"] = _nodes(c)
            if c.detail:
                info["detail"] = c.detail
        seconds.append(time.perf_counter() - start)
        if check:
            p.ensures(c)
    c.program.plan.timings = Timings(export=seconds[0], passes=sum(seconds[1:]))
    return c.program


def _nodes(c: Compilation) -> Any:
    """Nodes of the graphs a pass works on, for the log."""
    if c.stage_sets:
        return " + ".join(str(len(st.gm.graph.nodes)) for st in c.stage_sets[0])
    if c.lowered:
        return len(c.lowered[0].gm.graph.nodes)
    return None
