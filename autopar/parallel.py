"""``parallelize`` and the ``ParallelModel`` it returns: compile on demand, run on the job's ranks."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.tensor import Shard
from torch.utils import _pytree as pytree

from autopar.core.collectives import Binding, set_process_binding
from autopar.core.graph import tied_aliases
from autopar.core.layout import to_storage
from autopar.core.mesh import Mesh
from autopar.options import Options
from autopar.program import Program, check_supported, compile_program, shared_parameters
from autopar.rank_state import checkpoint_state, full_state, local_state
from autopar.runtime import checkpoint
from autopar.runtime.batch import signature, split_batch
from autopar.runtime.clip import clip, global_grad_norm
from autopar.runtime.grad_sync import BucketedAllReduce
from autopar.runtime.groups import Groups, join
from autopar.runtime.memory import MemoryAccount
from autopar.runtime.pipeline import PipelineRunner, output_metas
from autopar.runtime.zero import ZeroRuntime
from autopar.zero_compile import shared_across_pp


@dataclass
class _Runtime:
    """What one rank holds while running: groups, its parameters and buffers, optimizer, gradient sync."""

    groups: Groups
    state: dict[str, torch.Tensor]  # canonical name -> this rank's tensor (parameters and buffers)
    params: list[torch.nn.Parameter]
    optimizer: Any
    grad_sync: BucketedAllReduce | None
    shared: list[tuple[torch.Tensor, dist.ProcessGroup]] = field(default_factory=list)  # params on several pp ranks
    pipeline: PipelineRunner | None = None
    shared_on_rank: bool = False  # a parameter used by two stages of this rank: reduce after backward, not in it
    holders: dict[str, int] = field(default_factory=dict)  # parameter -> pp ranks holding it, when several
    zero: ZeroRuntime | None = None  # ZeRO over dp (zero=1|2|3): also the optimizer's owner and the grad sync
    memory: MemoryAccount | None = None


class NoParameters:
    """The optimizer of a rank whose pipeline stages hold no trainable parameter: nothing to update."""

    def __init__(self) -> None:
        self.param_groups: list = []
        self.state: dict = {}
        self._hooks: list[Callable] = []

    def register_step_post_hook(self, hook: Callable) -> None:
        self._hooks.append(hook)

    def step(self) -> None:
        for hook in self._hooks:
            hook(self, (), {})

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state: dict) -> None:
        pass


class ParallelModel:
    """An ``nn.Module`` compiled for a mesh. See ``parallelize``."""

    def __init__(self, model: torch.nn.Module, mesh: Mesh, options: Options) -> None:
        self.model = model
        self.mesh = mesh
        self.options = options
        self._programs: dict[tuple, Program] = {}
        self._last: Program | None = None
        self._rt: _Runtime | None = None
        self._split_points: list[str] | None = None
        self._full_shapes: dict[str, tuple[int, ...]] = {}
        self._placements: dict[str, Any] | None = None
        self._rng_base: int | None = None
        self.grad_norm: float | None = None  # with max_grad_norm: the last step's global norm, before clipping
        self._rng_calls = 0

    # compile time -----------------------------------------------------------
    def compile(self, args: tuple, kwargs: dict | None = None, target: Any = None, *, with_loss: bool = True) -> Program:
        """The program for a global batch ``(args, kwargs, target)`` (cached by shapes)."""
        parts = self._split((args, kwargs or {}, target))
        local = parts[0]
        key = (with_loss, signature(local))
        if key not in self._programs:
            full_size = self._rt.zero.full_size_parameters() if self._rt and self._rt.zero else contextlib.nullcontext()
            with full_size, self._full_size_tp():  # ranks keep shards; the capture reads full parameter shapes
                self._programs[key] = compile_program(self.model, self.mesh, self.options, local,
                                                      with_loss=with_loss, split_points=self._split_points,
                                                      placements=self._placements)
            self._split_points = self._programs[key].split_points  # every later graph is cut the same way
            self._placements = self._placements or self._programs[key].placements  # ... and sharded the same way
        self._last = self._programs[key]
        return self._last

    @property
    def plan(self) -> Any:
        """The plan of the most recently compiled program."""
        return self._require_program().plan

    def graph(self, rank: int) -> fx.GraphModule:
        """The rewritten GraphModule that ``rank`` runs (most recently compiled program)."""
        self.mesh.coords(rank)  # validates the rank
        return self._require_program().graphs[rank]

    def _require_program(self) -> Program:
        if self._last is None:
            raise RuntimeError(
                "nothing is compiled yet: pass example_inputs=(...) to parallelize, or call pm.step / pm(...) once"
            )
        return self._last

    def _split(self, tree: Any) -> list[Any]:
        m = self.options.microbatches
        parts = split_batch(tree, self.mesh.dp * m, dp=self.mesh.dp, microbatches=m)
        return parts

    # run time ---------------------------------------------------------------
    def _runtime(self, program: Program) -> _Runtime:
        if self._rt is None:
            self._rt = self._start(program)
        return self._rt

    def _start(self, program: Program) -> _Runtime:
        groups = join(self.mesh)
        with torch.no_grad():
            for t in [*self.model.parameters(), *self.model.buffers()]:
                t.data = t.data.to(groups.device)
                dist.broadcast(t.data, src=0)  # every replica starts from rank 0's values, as DDP does
        self._shard_for_tp(program, groups)
        state = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        mine = set(state)
        if program.stages is not None:
            mine = {n for st in program.own_stages(groups.rank) for n in st.params}
        params = [p for n, p in self.model.named_parameters() if p.requires_grad and n in mine]
        zero = None
        if self.options.zero:
            zero = ZeroRuntime(self.model, groups, self.options, params, alone=shared_across_pp(program))
            if zero.layout != program.zero_layouts[groups.rank]:
                raise RuntimeError(f"internal error: rank {groups.rank} laid out its parameters as "
                                   f"{zero.layout.describe()}, the compiler as "
                                   f"{program.zero_layouts[groups.rank].describe()}; please report it with the model")
        opt = zero.optimizer if zero else None
        if zero is None and self.options.optimizer is not None:  # a pp rank whose stages hold no parameters
            opt = self.options.optimizer(params) if params else NoParameters()  # (a head-less interleaved stage)
        sync = zero
        if groups["dp"] is not None and zero is None:
            sync = BucketedAllReduce(params, groups["dp"], self.options.bucket_bytes)
        rt = _Runtime(groups=groups, state=zero.state if zero else state, params=zero.params if zero else params,
                      optimizer=opt, grad_sync=sync, zero=zero,
                      memory=zero.memory if zero else MemoryAccount(lambda: params, lambda: [p.grad for p in params], opt))
        if program.stages is not None:
            with torch.no_grad():  # other stages' parameters are not kept (a capture gives them shapes again)
                for n, p in self.model.named_parameters():
                    if n not in mine:
                        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            rt.shared = self._shared_groups(program, groups, state.__getitem__ if zero is None else zero.shard_of)
            rt.holders = {n: len(r) for n, r in shared_parameters(program.stages, program.schedule).items()}
            rt.pipeline = PipelineRunner(program.schedule, groups.coord("pp"), self._pp_rank_fn(groups),
                                         groups.device)
        return rt

    def _seed_rng(self) -> None:
        """Tensor-parallel ranks draw the same random numbers (dropout masks agree in replicated regions)."""
        if self.mesh.tp == 1:
            return
        if self._rng_base is None:
            base = torch.tensor([torch.initial_seed() % 2**31], dtype=torch.int64, device=self._rt.groups.device)
            dist.broadcast(base, src=self.mesh.rank_of(**{**self.mesh.coords(self._rt.groups.rank), "tp": 0}),
                           group=self._rt.groups["tp"])
            self._rng_base = int(base)
        self._rng_calls += 1
        torch.manual_seed(self._rng_base + self._rng_calls)

    def _shard_for_tp(self, program: Program, groups: Groups) -> None:
        """Each tp rank keeps its chunk of every parameter the plan shards; collectives bind to the groups."""
        binding = Binding(dict(groups.by_axis))
        set_process_binding(binding)
        self._binding = binding
        n, i = self.mesh.tp, groups.coord("tp")
        self._full_shapes = {name: tuple(p.shape) for name, p in self.model.named_parameters()}
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                placement = program.placements.get(name)
                if name in program.layouts:
                    p.data = to_storage(p.data, program.layouts[name])
                if isinstance(placement, Shard):
                    p.data = p.data.chunk(n, placement.dim)[i].clone()

    @contextlib.contextmanager
    def _full_size_tp(self) -> Iterator[None]:
        """Parameters sharded over tp temporarily take their full shapes (uninitialized) for a capture."""
        shards = {}
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in self._full_shapes and tuple(p.shape) != self._full_shapes[name]:
                    shards[name] = (p.data, p.grad)  # (zero=1 keeps gradients, of the shard's shape)
                    p.grad = None
                    p.data = torch.empty(self._full_shapes[name], dtype=p.dtype, device=p.device)
        try:
            yield
        finally:
            for name, p in self.model.named_parameters():
                if name in shards:
                    p.data, p.grad = shards[name]

    def _check_ownership(self, program: Program, rt: _Runtime) -> None:
        """Every program must place this rank's parameters on this rank's stages (the runtime holds them there)."""
        own = program.own_stages(rt.groups.rank)
        if own is None:
            return
        pp = rt.groups.coord("pp")
        used = {n for st in own for n in st.params}
        mine = rt.zero.owned_parameters() if rt.zero is not None else rt.params
        held = {n for n, p in self.model.named_parameters() if any(p is q for q in mine)}
        if not used <= held | {n for n, p in self.model.named_parameters() if not p.requires_grad}:
            raise RuntimeError(f"internal error: this input's program uses parameters {sorted(used - held)[:3]} on pp "
                               f"rank {pp}, which holds other ones; please report it with the model")

    def _pp_rank_fn(self, groups: Groups) -> Callable[[int], int]:
        coords = self.mesh.coords(groups.rank)
        return lambda pp: self.mesh.rank_of(**{**coords, "pp": pp})

    def _shared_groups(self, program: Program, groups: Groups,
                       tensor_of: Callable[[str], torch.Tensor]) -> list[tuple[torch.Tensor, Any]]:
        """One process group per set of pp ranks sharing a parameter (whose ``tensor_of(name)`` gets the
        summed gradient); every rank creates every group."""
        out = []
        for name, pp_ranks in sorted(shared_parameters(program.stages, program.schedule).items()):
            for ranks in self.mesh.groups("pp"):
                group = dist.new_group([ranks[i] for i in pp_ranks])
                if groups.rank in ranks and groups.coord("pp") in pp_ranks:
                    out.append((tensor_of(name), group))
        return out

    def _local_parts(self, tree: Any, rt: _Runtime) -> list[Any]:
        tree = pytree.tree_map(lambda x: x.to(rt.groups.device) if isinstance(x, torch.Tensor) else x, tree)
        m = self.options.microbatches
        i = rt.groups.coord("dp")
        return self._split(tree)[i * m : (i + 1) * m]

    def step(self, *args: Any, target: Any = None, **kwargs: Any) -> float:
        """Forward, backward, gradient sync and optimizer step on the GLOBAL batch; the global mean loss."""
        if self.options.optimizer is None:
            raise ValueError("step() needs an optimizer: parallelize(..., optimizer=lambda params: torch.optim.SGD(params, lr=0.1))")
        program = self.compile(args, kwargs, target, with_loss=True)
        rt = self._runtime(program)
        self._check_ownership(program, rt)
        self._seed_rng()
        parts = self._local_parts((args, kwargs, target), rt)
        if rt.pipeline is not None:
            loss = self._pipeline_step(program, parts, rt)
        else:
            loss = self._local_step(program, parts, rt)
        if rt.grad_sync is not None:
            rt.grad_sync.finish()
        for param, group in rt.shared:  # copies of one parameter on several stages get the summed gradient
            if param.grad is None:  # (every holder takes part, with zeros if its stages made no gradient)
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, group=group)
        if self.options.max_grad_norm is not None:
            self.grad_norm = global_grad_norm(rt, self.model, program.placements, rt.holders)
            clip(rt, self.grad_norm, self.options.max_grad_norm)
        rt.optimizer.step()
        rt.optimizer.zero_grad(set_to_none=True)
        loss /= self.mesh.dp
        if rt.groups["dp"] is not None:
            dist.all_reduce(loss, group=rt.groups["dp"])
        return float(loss)

    def _local_step(self, program: Program, parts: list[Any], rt: _Runtime) -> torch.Tensor:
        gm = program.graphs[rt.groups.rank]
        total = torch.zeros((), dtype=torch.float64, device=rt.groups.device)
        for i, part in enumerate(parts):
            if rt.grad_sync is not None:
                rt.grad_sync.enabled = i == len(parts) - 1
            loss = program.captured.run(rt.state, pytree.tree_leaves(part), gm)
            (loss / len(parts)).backward()
            total += loss.detach().double()
        return total / len(parts)

    def _pipeline_step(self, program: Program, parts: list[Any], rt: _Runtime) -> torch.Tensor:
        last = len(program.stages) - 1

        def before_backward(mb: int) -> None:
            if rt.grad_sync is not None:
                rt.grad_sync.enabled = mb == len(parts) - 1 and not rt.shared_on_rank

        rt.shared_on_rank = _shared_within_rank(program, rt.groups.rank)
        flat = [pytree.tree_leaves(p) for p in parts]
        loss = rt.pipeline.step(program.stages_for(rt.groups.rank), flat, rt.state, program.captured.constants, before_backward)
        if loss is None:
            loss = torch.zeros((), dtype=torch.float64, device=rt.groups.device)
        src = self._pp_rank_fn(rt.groups)(program.schedule.stage_to_rank[last])
        dist.broadcast(loss, src=src, group=rt.groups["pp"])
        return loss

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only (no autograd graph is kept); the full output on every rank."""
        program = self.compile(args, kwargs, None, with_loss=False)
        rt = self._runtime(program)
        self._check_ownership(program, rt)
        self._seed_rng()
        parts = self._local_parts((args, kwargs, None), rt)
        with torch.no_grad():
            if rt.pipeline is not None:
                outs = self._pipeline_forward(program, parts, rt)
            else:
                gm = program.graphs[rt.groups.rank]
                outs = [program.captured.run(rt.state, pytree.tree_leaves((a, k)), gm) for a, k, _ in parts]
            return _gather_batch(outs, rt.groups["dp"], self.mesh.dp)

    def _pipeline_forward(self, program: Program, parts: list[Any], rt: _Runtime) -> list[Any]:
        """Pipelined forward; the last stage broadcasts its outputs to the other pp ranks."""
        last = program.stages[-1]
        flats = rt.pipeline.forward(program.stages_for(rt.groups.rank), [pytree.tree_leaves((a, k)) for a, k, _ in parts], rt.state,
                                    program.captured.constants)
        if flats is None:
            flats = [[torch.empty(b.shape, dtype=b.dtype, device=rt.groups.device) for b in output_metas(last)]
                     for _ in parts]
        src = self._pp_rank_fn(rt.groups)(program.schedule.stage_to_rank[last.index])
        for flat in flats:
            for t in flat:
                dist.broadcast(t, src=src, group=rt.groups["pp"])
        return [pytree.tree_unflatten(flat, program.captured.out_spec) for flat in flats]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded state under the original model's keys (CPU tensors), on every rank.

        Every rank must call it: it gathers ZeRO shards over dp, broadcasts each stage's tensors over
        pp and gathers tensor-parallel shards over tp.
        """
        program = self._require_program()
        aliases = tied_aliases(self.model)
        full = full_state(self.model, self.mesh, program, self._rt) if self._rt is not None else {}
        return {k: full.get(aliases.get(k, k), v).detach().to("cpu", copy=True)
                for k, v in self.model.state_dict().items()}

    def timeline(self) -> list[tuple[str, float, float]]:
        """This rank's pipeline actions of the last step: ``(action, start, end)`` (perf_counter seconds)."""
        rt = self._rt
        return list(rt.pipeline.timeline) if rt is not None and rt.pipeline is not None else []

    def communication(self, *, calls: bool = False) -> dict[str, int]:
        """Tensor-parallel collective bytes (or, with ``calls``, calls) counted since the runtime started,
        by ``op@axis``."""
        if self._rt is None or self.mesh.tp == 1:
            return {}
        b = self._binding
        return {f"{op}@{axis}": (b.counts if calls else b.bytes)[(op, axis)] for op, axis in b.counts}

    def parameters(self) -> list[torch.nn.Parameter]:
        if self._rt is None:
            raise RuntimeError("the runtime starts at the first pm.step or pm(...) call")
        return self._rt.params

    @property
    def optimizer(self) -> Any:
        """The optimizer the factory built on this rank's parameters (its shards under ZeRO), for LR schedulers."""
        return self._runtime(self._require_program()).optimizer

    def memory(self) -> dict[str, int]:
        """Bytes of this rank's parameters, gradients and optimizer state, measured after the last step."""
        return self._runtime(self._require_program()).memory.read()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Loads a full state (``state_dict()`` of this model from any mesh, or of the single-device model)."""
        program = self._require_program()
        rt = self._runtime(program)
        local = local_state(self.model, self.mesh, program, rt.groups.rank, state)
        if program.stages is not None:  # other stages' parameters are not kept here: nothing to load into them
            aliases = tied_aliases(self.model)
            released = {n: p.data for n, p in self.model.named_parameters() if p.numel() == 0}
            local = {k: released.get(aliases.get(k, k), v) for k, v in local.items()}
        if rt.zero is not None:
            rt.zero.load_full_state_dict(local)
        else:
            self.model.load_state_dict(local)

    def save(self, path: str, extra: Any = None) -> None:
        """Writes a new checkpoint version to the folder ``path``, each rank its own shards (every rank calls it).

        The checkpoint keeps the model's keys and full shapes, so ``load`` reads it on any mesh and ZeRO stage.
        """
        program = self._require_program()
        rt = self._runtime(program)
        checkpoint.save(path, rt, checkpoint_state(self.model, self.mesh, program, rt, self._full_shapes), extra)

    def load(self, path: str) -> Any:
        """Reads the latest complete checkpoint in ``path``, written on any mesh, resharded to this one; returns
        its ``extra``. Every rank calls it; a checkpoint of another model is refused on every rank, naming the
        first key that differs."""
        program = self._require_program()
        rt = self._runtime(program)
        return checkpoint.load(path, rt, checkpoint_state(self.model, self.mesh, program, rt, self._full_shapes))


def _shared_within_rank(program: Program, rank: int) -> bool:
    """Whether two stages of this rank use one parameter (its gradient completes only after both)."""
    seen: set[str] = set()
    for st in program.own_stages(rank):
        if seen & set(st.params):
            return True
        seen |= set(st.params)
    return False


def _gather_batch(outs: list[Any], group: dist.ProcessGroup | None, dp: int) -> Any:
    """Microbatch outputs concatenated, then dp slices all-gathered, along dim 0; scalars averaged."""
    flats = [pytree.tree_flatten(o) for o in outs]
    spec = flats[0][1]
    merged = []
    for leaves in zip(*(f for f, _ in flats)):
        first = leaves[0]
        if not isinstance(first, torch.Tensor):
            merged.append(first)
            continue
        local = torch.cat(leaves) if first.dim() > 0 else torch.stack(leaves).mean(0)
        if group is not None:
            if local.dim() > 0:
                pieces = [torch.empty_like(local) for _ in range(dp)]
                dist.all_gather(pieces, local.contiguous(), group=group)
                local = torch.cat(pieces)
            else:
                local = local.clone()
                dist.all_reduce(local, group=group)
                local /= dp
        merged.append(local)
    return pytree.tree_unflatten(merged, spec)


def parallelize(
    model: torch.nn.Module,
    mesh: Mesh | Any,
    *,
    example_inputs: tuple | None = None,
    example_kwargs: dict | None = None,
    example_target: Any = None,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    optimizer: Callable[[list], Any] | None = None,
    zero: int = 0,
    zero_prefetch: int = 1,
    schedule: str = "1f1b",
    microbatches: int = 1,
    bucket_mb: float = 25.0,
    split_points: list[str] | None = None,
    stages_per_rank: int | None = None,
    max_grad_norm: float | None = None,
) -> ParallelModel:
    """Compiles ``model`` for ``mesh``; with ``example_inputs`` (a GLOBAL batch) it compiles now.

    ``loss_fn(out, target)`` is traced with the model; without it, ``step`` uses the
    model's own loss (a scalar output or the ``loss`` entry of its output).
    ``mesh="auto"``: the planner (``autopar.planner``) chooses the mesh, ZeRO stage,
    schedule and microbatches for the job's world size from ``example_inputs``.
    ``max_grad_norm``: clip the gradient to this global 2-norm before each optimizer
    step (as ``torch.nn.utils.clip_grad_norm_`` on one device); ``pm.grad_norm`` is
    the last step's norm.
    """
    if isinstance(mesh, str):
        from autopar.planner import auto_choice

        chosen = auto_choice(model, mesh, example_inputs=example_inputs, example_kwargs=example_kwargs,
                             optimizer=optimizer)
        mesh, auto = chosen.mesh, chosen.parallelize_options()
        zero, schedule, microbatches, stages_per_rank = (auto["zero"], auto["schedule"], auto["microbatches"],
                                                         auto["stages_per_rank"])
    if not isinstance(mesh, Mesh):
        mesh = Mesh.from_device_mesh(mesh)
    options = Options(loss_fn=loss_fn, optimizer=optimizer, zero=zero, zero_prefetch=zero_prefetch, schedule=schedule,
                      microbatches=microbatches, bucket_mb=bucket_mb,
                      split_points=tuple(split_points) if split_points else None, stages_per_rank=stages_per_rank,
                      max_grad_norm=max_grad_norm)
    check_supported(mesh, options)
    pm = ParallelModel(model, mesh, options)
    if example_inputs is not None:
        with_loss = example_target is not None  # without a target, the forward graph is compiled for inspection
        pm.compile(tuple(example_inputs), example_kwargs, example_target, with_loss=with_loss)
    return pm
