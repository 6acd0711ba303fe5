"""Building a rank's ``RankRuntime`` from a program: groups, parameters, optimizer, gradient sync, executor.

``start_runtime`` runs once per ``ParallelModel``, at its first step or forward,
on every rank of the job; it joins the process groups, lays the user's
parameters out for this rank (``model_storage``) and builds the optimizer
(ZeRO's, or the user's factory on this rank's parameters).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from autopar.core.collectives import Binding
from autopar.core.mesh import Mesh
from autopar.rank.model_storage import hold_experts, place_on_rank, release_other_stages, shard_for_tp, store_trainable_in
from autopar.options import Options
from autopar.compiler.program import Program
from autopar.runtime.grad_sync import BucketedAllReduce, GradSyncs
from autopar.runtime.groups import Groups, job_store, join
from autopar.runtime.host_memory import keep_freed_memory
from autopar.runtime.master import Masters, build_optimizer, check_groups_unsharded, fused_steps
from autopar.runtime.memory import MemoryAccount
from autopar.runtime.progress import Progress
from autopar.runtime.step_executor import Executor
from autopar.runtime.rank import GradSync, NoParameters, Optimizer, RankRuntime
from autopar.runtime.zero import ZeroRuntime, ZeroSettings
from autopar.compiler.zero_program import shared_across_pp


def start_runtime(model: torch.nn.Module, mesh: Mesh, options: Options, program: Program) -> RankRuntime:
    """This rank's runtime for ``program``; every later program of the model must keep its parameter placement."""
    groups = join(mesh)
    if groups.device.type == "cpu":
        keep_freed_memory()  # (runtime/host_memory.py: warm pages for each microbatch's tensors)
    place_on_rank(model, groups.device)
    binding = Binding(dict(groups.by_axis))  # the autopar::* ops of this rank's steps run on it (autopar/rank/step.py)
    full_shapes = shard_for_tp(model, program.placements, program.layouts, mesh.tp, groups.coords.tp)
    experts = program.plan.expert_params
    elsewhere = hold_experts(model, experts, groups.coord("ep")) if experts else set()  # other ep ranks' experts
    pol = options.policy
    separate = pol is not None and pol.separate_masters
    values = store_trainable_in(model, pol.stored) if separate else None  # the masters' values
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    mine = set(state) - elsewhere
    if program.pipelined:
        mine = {n for st in program.own_stages(groups.rank) for n in st.params} - elsewhere
    params = [p for n, p in model.named_parameters() if p.requires_grad and n in mine]
    zero = None
    factory = options.optimizer  # compile=True: the optimizer steps in torch's fused kernel where it has one
    if options.compile and factory is not None:
        factory = fused_steps(factory)
    if options.zero:
        settings = ZeroSettings(options.zero, options.bucket_bytes, factory, pol.reduce if pol else None)
        zero = ZeroRuntime(model, groups, settings, params, alone=shared_across_pp(program), values=values,
                           binding=binding, routed=frozenset(experts))
        if zero.layout != program.zero_layouts[groups.rank]:
            raise RuntimeError(f"internal error: rank {groups.rank} laid out its parameters as "
                               f"{zero.layout.describe()}, the compiler as "
                               f"{program.zero_layouts[groups.rank].describe()}; please report it with the model")
    opt: Optimizer | None = zero.optimizer if zero else None
    masters = zero.masters if zero else None
    if zero is None and values is not None:  # (kept without an optimizer too: the state is the fp32 values)
        names = {id(p): n for n, p in model.named_parameters()}
        masters = Masters(params, [values[names[id(p)]] for p in params])
    if zero is None and options.optimizer is not None:  # a pp rank whose stages hold no parameters
        names = {id(p): n for n, p in model.named_parameters()}
        check_groups_unsharded(options.optimizer, params, [full_shapes.get(names[id(p)], p.shape) for p in params])
        opt = build_optimizer(factory, params, masters) if params else NoParameters()
    sync: GradSync | None = zero
    if groups["dp"] is not None and zero is None and experts:
        sync = expert_grad_sync(model, params, experts, groups, options.bucket_bytes, binding)
    elif grad_group(groups) is not None and zero is None:
        sync = BucketedAllReduce(params, grad_group(groups), options.bucket_bytes,
                                 counted=_counter(binding, "dp_cp" if mesh.cp > 1 else "dp"))
        if pol is not None and pol.reduce != pol.stored:
            sync.reduce_in(pol.reduce)  # (ZeRO's flat groups read the policy from the options)
    placement = program.schedule.stage_to_rank if program.schedule is not None else (0,)
    executor = Executor(lambda stage: pp_rank_fn(mesh, groups)(placement[stage]), groups.device, groups.wire,
                        regather=options.sequence_parallel)
    rt = RankRuntime(groups=groups, state=zero.state if zero else state, params=zero.params if zero else params,
                     optimizer=opt, grad_sync=sync, binding=binding, full_shapes=full_shapes, zero=zero, executor=executor,
                     masters=masters, memory=zero.memory if zero else
                     MemoryAccount(lambda: [*params, *frozen_parameters(model)], lambda: [p.grad for p in params], opt),
                     progress=Progress(job_store(), groups.rank, mesh.size))
    if program.pipelined:
        release_other_stages(model, mine)
        rt.shared = shared_groups(mesh, program, groups, state.__getitem__ if zero is None else zero.shard_of)
        rt.holders = {n: len(r) for n, r in program.shared_parameters().items()}
    return rt


def _counter(binding: Binding, axis: str) -> Callable[[torch.Tensor], None]:
    """Counts a gradient bucket's all-reduce over ``axis`` on the rank's binding (``pm.communication()``)."""
    return lambda flat: binding.record("all_reduce", axis, flat)


def expert_grad_sync(model: torch.nn.Module, params: list[torch.nn.Parameter], experts: dict, groups: Groups,
                     bucket_bytes: int, binding: Binding) -> GradSyncs:
    """Non-expert gradients averaged over dp; expert gradients summed over the ranks holding the same experts
    (``ep_replicate``) and divided by dp: each already sums the gradients of its ep group's tokens."""
    expert_ids = {id(p) for n, p in model.named_parameters() if n in experts}
    dense = [p for p in params if id(p) not in expert_ids]
    routed = [p for p in params if id(p) in expert_ids]
    dp = groups.mesh.dp
    return GradSyncs([BucketedAllReduce(dense, groups["dp"], bucket_bytes, counted=_counter(binding, "dp")),
                      BucketedAllReduce(routed, groups["ep_replicate"], bucket_bytes, divisor=dp,
                                        counted=_counter(binding, "ep_replicate"))])


def grad_group(groups: Groups) -> dist.ProcessGroup | None:
    """Where gradients are averaged: over dp, or under context parallelism over dp x cp (each cp rank's
    gradients are its tokens' part of its sequences')."""
    return groups["dp_cp"] if groups.mesh.cp > 1 else groups["dp"]


def frozen_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters without gradients (as this rank holds them: other stages' are empty)."""
    return [p for p in model.parameters() if not p.requires_grad]


def shared_groups(mesh: Mesh, program: Program, groups: Groups,
                  tensor_of: Callable[[str], torch.Tensor]) -> list[tuple[torch.Tensor, dist.ProcessGroup]]:
    """One process group per set of pp ranks sharing a parameter (whose ``tensor_of(name)`` gets the
    summed gradient); every rank creates every group."""
    out = []
    for name, pp_ranks in sorted(program.shared_parameters().items()):
        for ranks in mesh.groups("pp"):
            group = dist.new_group([ranks[i] for i in pp_ranks])
            if groups.rank in ranks and groups.coords.pp in pp_ranks:
                out.append((tensor_of(name), group))
    return out


def pp_rank_fn(mesh: Mesh, groups: Groups) -> Callable[[int], int]:
    """The global rank of pp rank ``pp`` with this rank's dp and tp coordinates."""
    coords = groups.coords
    return lambda pp: mesh.rank_at(coords.replace(pp=pp))


def seed_rng(rt: RankRuntime, mesh: Mesh) -> None:
    """Tensor- and context-parallel ranks draw the same random numbers: dropout masks agree in replicated
    regions, and each cp rank keeps its rows of the whole sequence's (``autopar/core/cp_dropout.py``). The
    seed is the initial seed of the group's rank at tp=0, cp=0, plus the calls made so far."""
    if mesh.tp == 1 and mesh.cp == 1:
        return
    if rt.rng_base is None:
        base = torch.tensor([torch.initial_seed() % 2**31], dtype=torch.int64, device=rt.groups.device)
        for axis in ("tp", "cp"):  # tp=0's seed over each tp group, then cp=0's (now its tp=0's) over cp
            if getattr(mesh, axis) > 1:
                src = mesh.rank_at(rt.groups.coords.replace(**{axis: 0}))
                dist.broadcast(base, src=src, group=rt.groups[axis])
        rt.rng_base = int(base)
    rt.rng_calls += 1
    torch.manual_seed(rt.rng_base + rt.rng_calls)


def check_ownership(model: torch.nn.Module, program: Program, rt: RankRuntime) -> None:
    """Every program must place this rank's parameters on this rank's stages (the runtime holds them there)."""
    if not program.pipelined:
        return
    own = program.own_stages(rt.groups.rank)
    pp = rt.groups.coords.pp
    used = {n for st in own for n in st.params}
    mine = rt.zero.owned_parameters() if rt.zero is not None else rt.params
    held = {n for n, p in model.named_parameters() if any(p is q for q in mine)}
    experts = program.plan.expert_params  # other ep indices' experts: read by the graph, held elsewhere
    held |= {n for n, e in experts.items() if not e.stacked and e.holder() != rt.groups.coord("ep")}
    if not used <= held | {n for n, p in model.named_parameters() if not p.requires_grad}:
        raise RuntimeError(f"internal error: this input's program uses parameters {sorted(used - held)[:3]} on pp "
                           f"rank {pp}, which holds other ones; please report it with the model")
