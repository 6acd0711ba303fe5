"""Compile: capture the model for one local microbatch, run the passes, keep each rank's graph and the plan.

Compilation needs no process group: every rank's program (and the plan that
describes them all) is computed in one process from the mesh and the model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from autopar.capture import Captured, capture
from autopar.core.buckets import bucket_sizes
from autopar.core.graph import Slot, StageGraph
from autopar.core.mesh import Mesh
from autopar.core.plan import Collective, PipelinePlan, Plan, StagePlan, memory, numel, replicated
from autopar.core.schedule import Schedule, add_communication, make_schedule
from autopar.core.simulate import simulate
from autopar.core.step_schedule import forward_step, local_schedule, training_step
from autopar.log import log_pass
from autopar.options import Options
from autopar.passes.cost import tensor_bytes
from autopar.passes.device import retarget_device
from autopar.passes.loss_count import normalize_by_global_count
from autopar.passes.pipeline import choose_split_points, shared_parameters, split_stages
from autopar.passes.split_backward import defer_weight_gradients
from autopar.passes.tensor_parallel import TensorParallel, tensor_parallel, with_graph
from autopar.precision import apply_to_program, check_model, describe_reductions
from autopar.recompute_compile import apply_recompute
from autopar.runtime.zero import check_optimizer
from autopar.zero_compile import apply_zero


@dataclass
class Program:
    """The compiled job for one input signature: the captured graph, each rank's graph, the plan."""

    captured: Captured
    graphs: dict[int, fx.GraphModule]
    plan: Plan
    stages: list[StageGraph] | None = None  # pipeline stages of tp index 0 (None without a pp axis)
    schedule: Schedule | None = None
    split_points: list[str] = field(default_factory=list)
    stage_sets: list[list[StageGraph]] = field(default_factory=list)  # pipeline stages by tp index
    placements: dict[str, Any] = field(default_factory=dict)  # parameter -> its tp placement (tp > 1)
    layouts: dict[str, Any] = field(default_factory=dict)  # parameter -> Interleave: stored re-ordered (tp > 1)
    param_of: dict[str, str] = field(default_factory=dict)  # placeholder name -> parameter name
    trainable: set[str] = field(default_factory=set)
    zero_layouts: dict[int, Any] = field(default_factory=dict)  # rank -> its ZeroLayout (zero > 0)
    rank_stages: Any = None  # rank -> its stages, when they differ by dp group (zero=3: a PerDpGroup)
    step: Schedule | None = None  # what every pp rank runs: the whole training step, or the forward pass
    device: torch.device = torch.device("cpu")  # where its graphs' device arguments and its constants point

    def move_to(self, rank: int, device: torch.device) -> None:
        """Points what ``rank`` runs at ``device``: the device arguments the capture wrote into its graphs
        (``passes/device.py``) and the captured constants. A process runs one rank: the first call moves them."""
        if self.device == device:
            return
        for stage in self.run_stages(rank):
            retarget_device(stage.gm, self.device, device)
        if self.captured.counts is not None:
            retarget_device(self.captured.counts.gm, self.device, device)
        self.captured.constants = {name: t.to(device) for name, t in self.captured.constants.items()}
        self.device = device

    def run_stages(self, rank: int) -> list[StageGraph]:
        """The stage graphs ``rank`` executes: its pipeline stages, or its whole graph as one stage."""
        stages = self.stages_for(rank)
        if stages is not None:
            return stages
        slots, inputs = [], 0
        for slot in self.captured.slots:  # the executor feeds inputs by their index in the flat batch
            slots.append(Slot("input", str(inputs)) if slot.kind == "input" else slot)
            inputs += slot.kind == "input"
        return [StageGraph(0, self.graphs[rank], slots, [], [], True, self.captured.param_names,
                           self.captured.mutated_buffers)]

    def stages_for(self, rank: int) -> list[StageGraph] | None:
        """The pipeline stages ``rank`` runs (those of its pp coordinate are its own), None without pp."""
        if self.rank_stages is not None:
            return self.rank_stages[rank]
        return self.stage_sets[self.plan.mesh.coords(rank)["tp"]] if self.stage_sets else self.stages

    def own_stages(self, rank: int) -> list[StageGraph] | None:
        """The stages ``rank`` holds and computes (those of its pp coordinate), None without pp."""
        stages = self.stages_for(rank)
        if stages is None:
            return None
        mine = self.schedule.stages_of(self.plan.mesh.coords(rank)["pp"])
        return [st for st in stages if st.index in mine]


def capture_device(model: torch.nn.Module) -> torch.device:
    """The device ``model`` is captured on: its parameters' and buffers' (the CPU for a model with neither)."""
    return next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))


def check_supported(mesh: Mesh, options: Options) -> None:
    """Rejects what cannot run, naming it (never a silent wrong answer)."""
    if options.sequence_parallel and mesh.tp == 1:
        raise ValueError(f"sequence_parallel=True shards the values between tensor-parallel regions, but the mesh "
                         f"{mesh} has tp=1; give the mesh tp > 1 or drop sequence_parallel")
    if mesh.hybrid and not options.zero:
        raise ValueError(f"{mesh} asks for hybrid sharding (ZeRO over dp_shard={mesh.dp_shard} inside each of "
                         f"dp_replicate={mesh.dp_replicate} replicas), but zero=0; pass zero=1, 2 or 3, or use "
                         f"{Mesh(**dict(mesh.axes))} for plain data parallelism")
    if options.zero:
        check_optimizer(options.optimizer, [torch.nn.Parameter(torch.zeros(1))], options.zero)


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
    check_supported(mesh, options)
    check_model(model, options.policy)
    args, kwargs, target = local
    with log_pass("capture (torch.export)") as info:
        cap = capture(model, args, kwargs, with_loss=with_loss, loss_fn=options.loss_fn, target=target,
                      compute_dtype=options.policy.compute if options.policy else None)
        info["nodes"] = len(cap.gm.graph.nodes)
    with log_pass("loss counts (means over counted items divided by the whole batch's count)") as info:
        cap.counts = normalize_by_global_count(cap)
        info["detail"] = f"{len(cap.counts.sources) if cap.counts else 0} terms: " \
                         f"{', '.join(cap.counts.sources) if cap.counts else '-'}"
    plan = _plan(model, mesh, options, cap, args)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lowered, pinned, placements, layouts = [cap], placements, {}, {}
    if mesh.tp > 1:
        with log_pass(f"tensor parallel (solve + lower, tp={mesh.tp})", len(cap.gm.graph.nodes)) as info:
            tp = tensor_parallel(cap, mesh.tp, trainable, fixed=pinned, sequence_parallel=options.sequence_parallel)
            info["nodes"] = len(tp.graphs[0].graph.nodes)
            info["detail"] = f"{sum(isinstance(p, Shard) for p in tp.placements.values())} parameters sharded"
        lowered, placements, layouts = [with_graph(cap, g) for g in tp.graphs], tp.placements, tp.layouts
        add_tensor_parallel_to_plan(plan, mesh, tp)
    if mesh.pp == 1:
        graphs = {rank: lowered[mesh.coords(rank)["tp"]].gm for rank in range(mesh.size)}
        return _finish(Program(captured=cap, graphs=graphs, plan=plan, placements=placements, layouts=layouts),
                       model, mesh, options, trainable, with_loss=with_loss)
    n_stages = mesh.pp * options.virtual_stages
    schedule = make_schedule(options.schedule, mesh.pp, options.microbatches, options.virtual_stages)
    simulate(add_communication(schedule))  # raises on a deadlock before anything runs
    if split_points is None:
        split_points = (list(options.split_points) if options.split_points
                        else choose_split_points(lowered[0].gm, n_stages))
    if len(split_points) != n_stages - 1:
        raise ValueError(f"{len(split_points)} split points give {len(split_points) + 1} stages, but pp={mesh.pp} "
                         f"x stages_per_rank={options.virtual_stages} needs {n_stages}; pass {n_stages - 1} split points")
    with log_pass(f"pipeline cut ({n_stages} stages)", len(lowered[0].gm.graph.nodes)) as info:
        cut: dict[int, list[StageGraph]] = {}  # tp ranks share one lowered graph: cut it once
        stage_sets = [cut.setdefault(id(c.gm), split_stages(c, split_points, trainable)) if id(c.gm) not in cut
                      else cut[id(c.gm)] for c in lowered]
        info["nodes"] = " + ".join(str(len(st.gm.graph.nodes)) for st in stage_sets[0])
        info["detail"] = "cuts before " + ", ".join(split_points)
    if schedule.splits_backward:
        stage_sets = _split_backward(stage_sets, trainable)
    graphs = {rank: stage_sets[mesh.coords(rank)["tp"]][mesh.coords(rank)["pp"]].gm for rank in range(mesh.size)}
    add_pipeline_to_plan(plan, stage_sets[0], schedule, split_points)
    return _finish(Program(captured=cap, graphs=graphs, plan=plan, stages=stage_sets[0], schedule=schedule,
                           split_points=split_points, stage_sets=stage_sets, placements=placements, layouts=layouts),
                   model, mesh, options, trainable, with_loss=with_loss)


def _split_backward(stage_sets: list[list[StageGraph]], trainable: set[str]) -> list[list[StageGraph]]:
    """Stages whose weight matmuls can leave their weight gradients to the schedule's ``W`` actions."""
    with log_pass("split backward (B: input gradients, W: weight gradients)") as info:
        out, done, count = [], {}, 0
        for stages in stage_sets:  # tp ranks may share one list of stages: rewrite each once
            if id(stages) not in done:
                split = [defer_weight_gradients(st.gm, st.slots, trainable) for st in stages]
                done[id(stages)] = [dataclasses.replace(st, gm=gm) for st, (gm, _) in zip(stages, split)]
                count = count or sum(n for _, n in split)
            out.append(done[id(stages)])
        info["detail"] = f"{count} weight matmuls defer their weight gradient"
    return out


def step_schedule(program: Program, mesh: Mesh, options: Options, *, training: bool) -> Schedule:
    """The schedule of a whole training step (``training``) or forward pass of ``program``."""
    m, unshard = options.microbatches, options.zero == 3
    if not training:
        if program.schedule is None:
            return forward_step(1, 1, m, unshard=unshard)
        return forward_step(mesh.pp, program.schedule.n_stages, m, unshard=unshard,
                            placement=program.schedule.stage_to_rank)
    compute = program.schedule if program.schedule is not None else local_schedule(m)
    holders = shared_parameters(program.stages, program.schedule) if program.stages is not None else {}
    return training_step(compute, reduce_grad=mesh.dp > 1 or options.zero > 0, unshard=unshard,
                         shared_ranks={r for ranks in holders.values() for r in ranks})


def rank_parameter_bytes(program: Program, mesh: Mesh, rank: int) -> tuple[int, int]:
    """(parameter bytes, trainable parameter bytes) ``rank`` holds: its stages' parameters, local shapes."""
    own = program.own_stages(rank)
    graphs = [st.gm for st in own] if own is not None else [program.graphs[rank]]
    sizes: dict[str, int] = {}
    for gm in graphs:
        placeholders = [nd for nd in gm.graph.nodes if nd.op == "placeholder"]
        for nd in placeholders:
            name = program.param_of.get(nd.name)
            if name is not None:
                sizes[name] = tensor_bytes(nd.meta.get("val"))
    trainable = sum(b for n, b in sizes.items() if n in program.trainable)
    return sum(sizes.values()), trainable


def _finish(program: Program, model: torch.nn.Module, mesh: Mesh, options: Options, trainable: set[str], *,
            with_loss: bool) -> Program:
    """Per-rank memory and data-parallel traffic from the ranks' own graphs (local shapes, their stages);
    the step schedule, checked by the simulator."""
    if options.policy is not None:
        with log_pass(f"mixed precision ({options.precision})") as info:
            apply_to_program(program, model, options.policy, with_loss=with_loss)
            info["detail"] = "fp32 placeholders cast at their first use"
    program.step = step_schedule(program, mesh, options, training=with_loss)
    simulate(program.step)  # raises on a broken or deadlocking step before anything runs
    placeholders = [nd for nd in program.captured.gm.graph.nodes if nd.op == "placeholder"]
    program.param_of = {nd.name: s.name for nd, s in zip(placeholders, program.captured.slots) if s.kind == "param"}
    program.trainable = trainable
    program.device = capture_device(model)
    factor = optimizer_state_factor(options)
    per_rank = {r: rank_parameter_bytes(program, mesh, r) for r in range(mesh.size)}
    if options.zero:  # ZeRO's layouts, estimate and dp collectives replace data parallelism's
        with log_pass(f"zero={options.zero} (layouts over {mesh.zero_axis}={mesh[mesh.zero_axis]})") as info:
            collectives = apply_zero(program, model, mesh, options, factor=factor,
                                     frozen_bytes={r: p - t for r, (p, t) in per_rank.items()})
            info["detail"] = f"{len(program.zero_layouts[0].groups)} flat groups on rank 0"
        program.plan.collectives = [c for c in program.plan.collectives if c.axis != "dp"] + collectives
        return apply_recompute(describe_reductions(program, options.policy), options)
    worst = max(per_rank, key=lambda r: per_rank[r][0])
    params, grads = per_rank[worst]
    program.plan.memory = memory({"parameters": params, "gradients": grads, "optimizer": factor * grads}, worst)
    program.plan.collectives = [
        Collective(c.axis, c.op, len(bucket_sizes(grads, options.bucket_bytes)), grads, c.what) if c.axis == "dp" else c
        for c in program.plan.collectives
    ]
    return apply_recompute(describe_reductions(program, options.policy), options)


def add_tensor_parallel_to_plan(plan: Plan, mesh: Mesh, tp: TensorParallel) -> None:
    plan.params = [dataclasses.replace(p.with_placement("tp", tp.placements.get(p.name, Replicate())),
                                       interleave=tp.layouts[p.name].blocks if p.name in tp.layouts else None)
                   for p in plan.params]
    for (direction, op), count in sorted(tp.collectives.items()):
        plan.collectives.append(Collective("tp", op, count * plan.microbatches,
                                           tp.bytes[(direction, op)] * plan.microbatches,
                                           f"{direction}, {count} per microbatch", direction))
    plan.fallbacks = tp.fallbacks
    plan.tensor_parallel = tp.layer  # the memory estimate comes later, from each rank's local shapes


def add_pipeline_to_plan(plan: Plan, stages: list[StageGraph], schedule: Schedule, split_points: list[str]) -> None:
    shared = shared_parameters(stages, schedule)
    plan.pipeline = PipelinePlan(
        n_stages=len(stages), pp_ranks=schedule.n_ranks, microbatches=schedule.n_microbatches,
        bubble=simulate(schedule).bubble_fraction, cuts=tuple(split_points),
        stages=tuple(StagePlan(st.index, schedule.stage_to_rank[st.index], len(st.params), len(st.gm.graph.nodes),
                               len(st.send), sum(b.dtype.itemsize * numel(b.shape) for b in st.send))
                     for st in stages),
        shared=tuple((name, tuple(ranks)) for name, ranks in shared.items()),
    )


def _plan(model: torch.nn.Module, mesh: Mesh, options: Options, cap: Captured, args: tuple) -> Plan:
    params = dict(model.named_parameters())
    shapes = [replicated(name, tuple(params[name].shape), mesh) for name in cap.param_names]
    trainable = [params[n] for n in cap.param_names if params[n].requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    collectives = []
    if mesh.dp > 1 and trainable:
        n_buckets = len(bucket_sizes(grad_bytes, options.bucket_bytes))
        collectives.append(Collective("dp", "all_reduce", n_buckets, grad_bytes, "gradient buckets, overlapped with backward"))
    batch = next((tuple(a.shape) for a in args if isinstance(a, torch.Tensor)), ())
    return Plan(
        mesh=mesh,
        nodes=len(cap.gm.graph.nodes),
        local_batch=batch,
        microbatches=options.microbatches,
        params=shapes,
        collectives=collectives,
        tied=dict(cap.aliases),
        loss_counts=tuple(cap.counts.sources) if cap.counts else (),
    )  # the memory estimate comes in _finish, from each rank's graphs


def optimizer_state_factor(options: Options) -> int:
    """Optimizer bytes per byte of a trainable parameter as stored: state elements per parameter element (2 for
    Adam-like, 1 for SGD with momentum), and under ``precision="mixed"`` with the float32 master counted as one
    more, each as many times the stored element's bytes as float32 has."""
    if options.optimizer is None:
        return 0
    probe = torch.nn.Parameter(torch.zeros(1))
    opt = options.optimizer([probe])
    name = type(opt).__name__.lower()
    states = 2
    if "adam" in name:
        states = 2
    elif name == "sgd":
        states = 1 if opt.defaults.get("momentum", 0) else 0
    pol = options.policy
    if pol is not None and pol.separate_masters:
        return (states + 1) * pol.master.itemsize // pol.stored.itemsize
    return states
