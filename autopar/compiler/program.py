"""The compiled program (each rank's graphs, the step schedule, the plan) and what the passes use to build it.

The passes run in order in ``autopar/compiler/driver.py``.

Compilation needs no process group: every rank's program (and the plan that
describes them all) is computed in one process from the mesh and the model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import Placement, Replicate

from autopar.compiler.capture import Captured
from autopar.core.buckets import assign_buckets, bucket_sizes
from autopar.core.buffer_writes import written_placeholders
from autopar.core.errors import UnsupportedError
from autopar.core.layout import Interleave
from autopar.core.graph import SlotKind, StageGraph, origin
from autopar.core.mesh import Mesh
from autopar.core.optimizers import state_elements
from autopar.core.plan import Collective, PipelinePlan, Plan, StagePlan, numel, replicated
from autopar.core.schedule import Schedule
from autopar.core.simulate import simulate
from autopar.core.step_schedule import forward_step, local_schedule, training_step
from autopar.core.zero_layout import ZeroLayout
from autopar.options import Options
from autopar.passes.cost import tensor_bytes
from autopar.passes.device import retarget_device
from autopar.passes.expert_parallel import check_composes
from autopar.passes.stage_cuts import shared_parameters
from autopar.passes.split_backward import defer_weight_gradients
from autopar.passes.tensor_parallel import TensorParallel
from autopar.runtime.zero import check_optimizer


Rewrite = Callable[[list[int], StageGraph], StageGraph]  # (the ZeRO group's ranks, one of its stages) -> rewritten


@dataclass
class RankGraphs:
    """What every rank runs, one container for every mesh: each rank's list of stage graphs.

    With a pipeline a rank's list holds every stage at its tp index (the executor indexes it by stage), of
    which it computes its own (``schedule.stages_of`` its pp coordinate); without one, its whole graph as
    stage 0. Ranks share the lists of their tp index (``by_tp``) until a per-group rewrite (ZeRO-3's gathers)
    gives each ZeRO group (its dp group, or its dp_shard group under hybrid sharding) its own stages, made
    when a rank of the group is first asked for: each rank's runtime rewrites only its own graphs, and
    inspecting a rank rewrites that rank's group.
    """

    mesh: Mesh
    by_tp: list[list[StageGraph]]  # the stages of each tp index, before any per-group rewrite
    schedule: Schedule | None = None  # the pipeline's (None: no pipeline)
    group_rewrites: list[Rewrite] = field(default_factory=list)  # applied in order to a group's own stages
    _groups: dict[int, list[StageGraph]] = field(default_factory=dict, repr=False)

    @property
    def pipelined(self) -> bool:
        return self.schedule is not None

    @property
    def per_group(self) -> bool:
        """Whether ZeRO groups have stages of their own (made on first access)."""
        return bool(self.group_rewrites)

    def stages(self, rank: int) -> list[StageGraph]:
        """Every stage at ``rank``'s tp index, its own rewritten for its ZeRO group."""
        tp = self.mesh.coords(rank).tp  # a rank outside the mesh is refused by name
        if not self.group_rewrites:
            return self.by_tp[tp]
        if rank not in self._groups:  # (ranks of other ep indices hold other experts: other layouts)
            index, mine = self.mesh.coord(rank, "ep"), self.own_indices(rank)
            ranks = [r for r in self.mesh.group_of(rank, self.mesh.zero_axis) if self.mesh.coord(r, "ep") == index]
            stages = [self._rewritten(ranks, st) if st.index in mine else st for st in self.by_tp[tp]]
            self._groups.update(dict.fromkeys(ranks, stages))
        return self._groups[rank]

    def own(self, rank: int) -> list[StageGraph]:
        """The stages ``rank`` holds and computes."""
        mine = self.own_indices(rank)
        return [st for st in self.stages(rank) if st.index in mine]

    def own_indices(self, rank: int) -> set[int]:
        return set(self.schedule.stages_of(self.mesh.coords(rank).pp)) if self.pipelined else {0}

    def graph(self, rank: int) -> fx.GraphModule:
        """The graph ``rank`` runs: the stage of its pp coordinate (its whole graph without a pipeline)."""
        return self.stages(rank)[self.mesh.coords(rank).pp].gm

    def distinct(self) -> list[StageGraph]:
        """Every stage of every tp index once (tp indices may share graphs), before per-group rewrites."""
        return list({id(st.gm): st for stages in self.by_tp for st in stages}.values())

    def rewrite(self, fn: Callable[[StageGraph], StageGraph]) -> None:
        """Every stage rewritten by ``fn``: now, or (once groups have stages of their own) each group's own
        stages when first asked for. A stage shared by several tp indices is rewritten once."""
        if self.group_rewrites:
            self.rewrite_per_group(lambda ranks, st: fn(st))
            return
        done = {id(st): st for stages in self.by_tp for st in stages}
        done = {key: fn(st) for key, st in done.items()}
        self.by_tp = [[done[id(st)] for st in stages] for stages in self.by_tp]

    def rewrite_per_group(self, fn: Rewrite) -> None:
        """Each ZeRO group's own stages rewritten by ``fn(its ranks, stage)`` when a rank of it is first asked for
        (under expert parallelism the group's ranks of one ep index: they hold the same experts)."""
        self.group_rewrites.append(fn)
        self._groups.clear()

    def _rewritten(self, ranks: list[int], st: StageGraph) -> StageGraph:
        for fn in self.group_rewrites:
            st = fn(ranks, st)
        return st


def whole_graph_stage(captured: Captured, gm: fx.GraphModule) -> StageGraph:
    """``gm`` (one of ``captured``'s lowered graphs) as the one stage of a rank without a pipeline."""
    return StageGraph(0, gm, list(captured.slots), [], [], True, captured.param_names, captured.mutated_buffers)


@dataclass
class Program:
    """The compiled job for one input signature: the captured graph, each rank's graphs, the plan."""

    captured: Captured
    graphs: RankGraphs
    plan: Plan
    split_points: list[str] = field(default_factory=list)
    placements: dict[str, Placement] = field(default_factory=dict)  # parameter -> its tp placement (tp > 1)
    layouts: dict[str, Interleave] = field(default_factory=dict)  # parameter -> stored re-ordered (tp > 1)
    param_of: dict[str, str] = field(default_factory=dict)  # placeholder name -> parameter name
    cp_local: int = 0  # context parallelism: the tokens of each sequence a cp rank holds (0: no cp)
    cp_shifted: dict[int, float] = field(default_factory=dict)  # cp: flat inputs shifted left first -> fill
    trainable: set[str] = field(default_factory=set)
    zero_layouts: dict[int, ZeroLayout] = field(default_factory=dict)  # rank -> its ZeRO layout (zero > 0)
    step: Schedule | None = None  # what every pp rank runs: the whole training step, or the forward pass
    device: torch.device = torch.device("cpu")  # where its graphs' device arguments and its constants point

    @property
    def schedule(self) -> Schedule | None:
        """The pipeline's schedule (None without a pipeline)."""
        return self.graphs.schedule

    @property
    def pipelined(self) -> bool:
        return self.graphs.pipelined

    @property
    def pipeline_stages(self) -> list[StageGraph]:
        """The pipeline's stages as cut (of tp index 0; none without a pipeline)."""
        return self.graphs.by_tp[0] if self.pipelined else []

    def graph(self, rank: int) -> fx.GraphModule:
        """The graph ``rank`` runs (``pm.graph(rank)``)."""
        return self.graphs.graph(rank)

    def run_stages(self, rank: int) -> list[StageGraph]:
        """The stage graphs ``rank`` executes: its pipeline stages, or its whole graph as one stage."""
        return self.graphs.stages(rank)

    def own_stages(self, rank: int) -> list[StageGraph]:
        """The stages ``rank`` holds and computes (its whole graph without a pipeline)."""
        return self.graphs.own(rank)

    def shared_parameters(self) -> dict[str, list[int]]:
        """Parameters that stages on several pipeline ranks use, with those pp ranks (none without a pipeline)."""
        return shared_parameters(self.pipeline_stages, self.schedule) if self.pipelined else {}

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
                         f"{Mesh(**(mesh.sizes | {'dp': mesh.dp}))} for plain data parallelism")
    if options.zero:
        check_optimizer(options.optimizer, [torch.nn.Parameter(torch.zeros(1))], options.zero)
    if mesh.ep > 1:
        check_composes(mesh)
    if mesh.cp > 1:
        check_context_parallel(mesh, options)


def check_buffer_updates(captured: Captured, mesh: Mesh, options: Options) -> None:
    """Refuses a model that updates buffers in forward (a step counter, BatchNorm's running statistics in train
    mode) where the runtime would update them otherwise than one device does: once per step on the whole batch.
    Under a pipeline a buffer lives on one stage's rank while others may read it; with microbatches each
    microbatch's forward updates it again."""
    _check_no_parameter_writes(captured)
    updated = captured.updated_buffers
    if not updated or (mesh.pp == 1 and options.microbatches == 1):
        return
    names = ", ".join(updated[:4]) + (f" and {len(updated) - 4} more" if len(updated) > 4 else "")
    if mesh.pp > 1:
        raise UnsupportedError(f"{mesh}: the model updates buffers in forward ({names}), which pipelines do not "
                               f"support; use pp=1, or put the modules that update them in eval mode")
    raise UnsupportedError(f"microbatches={options.microbatches}: the model updates buffers in forward ({names}), "
                           f"which each microbatch's forward would update again, where one device updates them "
                           f"once per step on the whole batch; pass microbatches=1, or put the modules that "
                           f"update them in eval mode")


def _check_no_parameter_writes(captured: Captured) -> None:
    """Refuses a forward that writes a parameter in place (``self.w.clamp_(-c, c)`` under ``no_grad``): the
    optimizer owns the parameters, and a rank may hold a shard or a temporary gather of one (tp, ZeRO-3)."""
    written = written_placeholders(captured.gm)
    for node, slot in zip([n for n in captured.gm.graph.nodes if n.op == "placeholder"], captured.slots):
        if slot.kind is SlotKind.PARAM and node in written:
            where = f" {origin(written[node])}" if origin(written[node]) else ""
            raise UnsupportedError(f"the model writes its parameter {slot.name} in place in forward "
                                   f"({written[node].target}{where}), which autopar does not support: the "
                                   f"optimizer owns the parameters, and a rank may hold a shard or a temporary "
                                   f"gather of one; constrain it after the optimizer step instead (a step hook), "
                                   f"or compute the constrained weight in forward (torch.nn.utils.parametrize)")


def check_context_parallel(mesh: Mesh, options: Options) -> None:
    """Context parallelism composes with dp, ZeRO 1-3 (sharded over dp x cp, or dp_shard x cp under hybrid
    sharding), mixed precision, recomputation, tp and pp; what it does not compose with is refused by name."""
    others = {"ep": mesh.ep > 1, f"batch={options.batch!r}": options.batch != "global"}
    refused = [name for name, on in others.items() if on]
    if refused:
        raise UnsupportedError(f"{mesh} with {', '.join(refused)}: context parallelism (cp={mesh.cp}) does not "
                               f"compose with expert parallelism or batch='local' in this version; use "
                               f"{_without_ep(mesh)} with batch='global', or drop cp")
    how = options.cp_attention
    if how in ("all_to_all", "usp") and mesh.tp > 1:
        raise UnsupportedError(f"{mesh} with cp_attention={how!r}: the all-to-all attention has no tp sharding "
                               f"rule in this version (the ring has: its heads are sharded over tp); use "
                               f"cp_attention='ring' with tp={mesh.tp}, or tp=1")
    check_usp(mesh, how)


def check_usp(mesh: Mesh, how: str) -> None:
    """``cp_attention="usp"`` runs on ``Mesh(cp=(ring, a2a))`` with both sizes above 1, and only it reads that
    split (docs/decisions.md)."""
    if how == "usp" and (mesh.cp_split is None or 1 in mesh.cp_split):
        splits = [(mesh.cp // a, a) for a in range(2, mesh.cp) if mesh.cp % a == 0]
        raise UnsupportedError(f"{mesh} with cp_attention='usp': unified sequence parallelism needs cp split into a "
                               f"ring of all-to-all groups, Mesh(cp=(ring, a2a)) with ring x a2a = cp = {mesh.cp} and "
                               f"both above 1 ({f'cp=(ring, a2a) in {splits}' if splits else 'none for this cp'}); "
                               f"for one of them alone use cp_attention='ring' or 'all_to_all' with "
                               f"Mesh(cp={mesh.cp})")
    if how != "usp" and mesh.cp_split is not None:
        raise UnsupportedError(f"{mesh} with cp_attention={how!r}: the split cp={mesh.cp_split} (ring, a2a) is read "
                               f"by cp_attention='usp' only; pass cp_attention='usp', or Mesh(cp={mesh.cp}) for "
                               f"{how!r} over all {mesh.cp} cp ranks")


def _without_ep(mesh: Mesh) -> str:
    """``mesh`` without ep (and its dp split kept)."""
    return repr(Mesh(**mesh.sizes))


def split_backward(stage_sets: list[list[StageGraph]], trainable: set[str]) -> tuple[list[list[StageGraph]], int]:
    """Stages whose weight matmuls can leave their weight gradients to the schedule's ``W`` actions, and how
    many matmuls of one tp index's stages do."""
    out, done, count = [], {}, 0
    for stages in stage_sets:  # tp ranks may share one list of stages: rewrite each once
        if id(stages) not in done:
            split = [defer_weight_gradients(st.gm, st.slots, trainable) for st in stages]
            done[id(stages)] = [dataclasses.replace(st, gm=gm) for st, (gm, _) in zip(stages, split)]
            count = count or sum(n for _, n in split)
        out.append(done[id(stages)])
    return out, count


def step_schedule(program: Program, mesh: Mesh, options: Options, *, training: bool) -> Schedule:
    """The schedule of a whole training step (``training``) or forward pass of ``program``."""
    m, unshard = options.microbatches, options.zero == 3
    if not training:
        if program.schedule is None:
            return forward_step(1, 1, m, unshard=unshard)
        return forward_step(mesh.pp, program.schedule.n_stages, m, unshard=unshard,
                            placement=program.schedule.stage_to_rank)
    compute = program.schedule if program.schedule is not None else local_schedule(m)
    holders = program.shared_parameters()
    return training_step(compute, reduce_grad=mesh.dp > 1 or mesh.cp > 1 or options.zero > 0, unshard=unshard,
                         shared_ranks={r for ranks in holders.values() for r in ranks})


def rank_parameter_bytes(program: Program, mesh: Mesh, rank: int) -> tuple[int, int]:
    """(parameter bytes, trainable parameter bytes) ``rank`` holds: its stages' parameters, local shapes."""
    sizes = _rank_sizes(program, mesh, rank)
    trainable = sum(b for n, b in sizes.items() if n in program.trainable)
    return sum(sizes.values()), trainable


def rank_expert_bytes(program: Program, mesh: Mesh, rank: int) -> int:
    """Bytes of the trainable routed experts' parameters ``rank`` holds (its ep index's experts)."""
    sizes = _rank_sizes(program, mesh, rank)
    return sum(b for n, b in sizes.items() if n in program.trainable and n in program.plan.expert_params)


def rank_gradient_buckets(program: Program, mesh: Mesh, rank: int, order: list[str], bucket_bytes: int,
                          routed: bool = False) -> int:
    """How many buckets the trainable gradients ``rank`` holds (the routed experts' with ``routed``, else the
    others) make as ``runtime.grad_sync`` lays them out: in reverse ``order`` (the model's parameter order),
    each tensor whole (``core.buckets.assign_buckets``; one dtype); 1 where it holds none."""
    sizes = _rank_sizes(program, mesh, rank)
    names = [n for n in reversed(order) if n in sizes and n in program.trainable
             and (n in program.plan.expert_params) == routed]
    return len(assign_buckets([sizes[n] for n in names], [0] * len(names), bucket_bytes)) or 1


def _rank_sizes(program: Program, mesh: Mesh, rank: int) -> dict[str, int]:
    """Bytes of each parameter ``rank`` holds, at its local shape."""
    sizes: dict[str, int] = {}
    for gm in [st.gm for st in program.own_stages(rank)]:
        placeholders = [nd for nd in gm.graph.nodes if nd.op == "placeholder"]
        for nd in placeholders:
            name = program.param_of.get(nd.name)
            if name is not None:
                sizes[name] = tensor_bytes(nd.meta.get("val"))
            if name in program.plan.expert_params:  # expert parallelism: what this rank's ep index holds
                shape = tuple(nd.meta["val"].shape)
                local = program.plan.expert_params[name].local_shape(shape, mesh.coord(rank, "ep"))
                sizes[name] = sizes[name] * numel(local) // max(numel(shape), 1)
    return sizes


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


def initial_plan(model: torch.nn.Module, mesh: Mesh, options: Options, cap: Captured, args: tuple) -> Plan:
    """The plan before the passes: the parameters replicated, data parallelism's gradient all-reduce."""
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
    )  # the memory estimate comes later (autopar/compiler/driver.py), from each rank's graphs


def optimizer_state_factor(options: Options) -> int:
    """Optimizer bytes per byte of a trainable parameter as stored: state elements per parameter element (2 for
    Adam-like, 1 for SGD with momentum), and under ``precision="mixed"`` with the float32 master counted as one
    more, each as many times the stored element's bytes as float32 has."""
    if options.optimizer is None:
        return 0
    states = state_elements(options.optimizer([torch.nn.Parameter(torch.zeros(1))]))
    pol = options.policy
    if pol is not None and pol.separate_masters:
        return (states + 1) * pol.master.itemsize // pol.stored.itemsize
    return states
