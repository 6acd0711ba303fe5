"""``parallelize`` and the ``ParallelModel`` it returns: compile on demand, run on the job's ranks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.mesh import Mesh
from autopar.options import Options
from autopar.program import Program, check_supported, compile_program, shared_parameters
from runtime.batch import signature, split_batch
from runtime.grad_sync import BucketedAllReduce
from runtime.groups import Groups, join
from runtime.pipeline import PipelineRunner, output_metas


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

    # compile time -----------------------------------------------------------
    def compile(self, args: tuple, kwargs: dict | None = None, target: Any = None, *, with_loss: bool = True) -> Program:
        """The program for a global batch ``(args, kwargs, target)`` (cached by shapes)."""
        parts = self._split((args, kwargs or {}, target))
        local = parts[0]
        key = (with_loss, signature(local))
        if key not in self._programs:
            self._programs[key] = compile_program(self.model, self.mesh, self.options, local, with_loss=with_loss,
                                                  split_points=self._split_points)
            self._split_points = self._programs[key].split_points  # every later graph is cut the same way
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
        state = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        mine = set(state)
        if program.stages is not None:
            pp = groups.coord("pp")
            mine = {n for st in program.stages if program.schedule.stage_to_rank[st.index] == pp for n in st.params}
        params = [p for n, p in self.model.named_parameters() if p.requires_grad and n in mine]
        opt = self.options.optimizer(params) if self.options.optimizer is not None else None
        sync = None
        if groups["dp"] is not None:
            sync = BucketedAllReduce(params, groups["dp"], self.options.bucket_bytes)
        rt = _Runtime(groups=groups, state=state, params=params, optimizer=opt, grad_sync=sync)
        if program.stages is not None:
            rt.shared = self._shared_groups(program, groups, state)
            rt.pipeline = PipelineRunner(program.schedule, groups.coord("pp"), self._pp_rank_fn(groups),
                                         groups.device)
        return rt

    def _pp_rank_fn(self, groups: Groups) -> Callable[[int], int]:
        coords = self.mesh.coords(groups.rank)
        return lambda pp: self.mesh.rank_of(**{**coords, "pp": pp})

    def _shared_groups(self, program: Program, groups: Groups, state: dict) -> list[tuple[torch.Tensor, Any]]:
        """One process group per set of pp ranks sharing a parameter; every rank creates every group."""
        out = []
        for name, pp_ranks in sorted(shared_parameters(program.stages, program.schedule).items()):
            for ranks in self.mesh.groups("pp"):
                group = dist.new_group([ranks[i] for i in pp_ranks])
                if groups.rank in ranks and groups.coord("pp") in pp_ranks:
                    out.append((state[name], group))
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
        parts = self._local_parts((args, kwargs, target), rt)
        if rt.pipeline is not None:
            loss = self._pipeline_step(program, parts, rt)
        else:
            loss = self._local_step(program, parts, rt)
        if rt.grad_sync is not None:
            rt.grad_sync.finish()
        for param, group in rt.shared:  # copies of one parameter on several stages get the summed gradient
            if param.grad is not None:
                dist.all_reduce(param.grad, group=group)
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

        rt.shared_on_rank = _shared_within_rank(program, rt.groups.coord("pp"))
        flat = [pytree.tree_leaves(p) for p in parts]
        loss = rt.pipeline.step(program.stages, flat, rt.state, program.captured.constants, before_backward)
        if loss is None:
            loss = torch.zeros((), dtype=torch.float64, device=rt.groups.device)
        src = self._pp_rank_fn(rt.groups)(program.schedule.stage_to_rank[last])
        dist.broadcast(loss, src=src, group=rt.groups["pp"])
        return loss

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only (no autograd graph is kept); the full output on every rank."""
        program = self.compile(args, kwargs, None, with_loss=False)
        rt = self._runtime(program)
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
        flats = rt.pipeline.forward(program.stages, [pytree.tree_leaves((a, k)) for a, k, _ in parts], rt.state,
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
        """The full, unsharded state under the original model's keys (CPU tensors)."""
        program = self._require_program()
        if self._rt is not None and program.stages is not None:
            self._gather_pipeline_state(program)
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def _gather_pipeline_state(self, program: Program) -> None:
        """Each tensor's owner (the pp rank of the first stage using it) broadcasts it to the other pp ranks."""
        rt = self._rt
        owner: dict[str, int] = {}
        for st in program.stages:
            for slot in st.slots:
                owner.setdefault(slot.name, program.schedule.stage_to_rank[st.index])
        to_rank = self._pp_rank_fn(rt.groups)
        with torch.no_grad():
            for name, t in rt.state.items():
                dist.broadcast(t.data, src=to_rank(owner.get(name, 0)), group=rt.groups["pp"])

    def parameters(self) -> list[torch.nn.Parameter]:
        if self._rt is None:
            raise RuntimeError("the runtime starts at the first pm.step or pm(...) call")
        return self._rt.params


def _shared_within_rank(program: Program, pp: int) -> bool:
    """Whether two stages of this pp rank use one parameter (its gradient completes only after both)."""
    seen: set[str] = set()
    for st in program.stages:
        if program.schedule.stage_to_rank[st.index] == pp:
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
    schedule: str = "1f1b",
    microbatches: int = 1,
    bucket_mb: float = 25.0,
    split_points: list[str] | None = None,
    stages_per_rank: int | None = None,
) -> ParallelModel:
    """Compiles ``model`` for ``mesh``; with ``example_inputs`` (a GLOBAL batch) it compiles now.

    ``loss_fn(out, target)`` is traced with the model; without it, ``step`` uses the
    model's own loss (a scalar output or the ``loss`` entry of its output).
    """
    if not isinstance(mesh, Mesh):
        mesh = Mesh.from_device_mesh(mesh)
    options = Options(loss_fn=loss_fn, optimizer=optimizer, zero=zero, schedule=schedule,
                      microbatches=microbatches, bucket_mb=bucket_mb,
                      split_points=tuple(split_points) if split_points else None, stages_per_rank=stages_per_rank)
    check_supported(mesh, options)
    pm = ParallelModel(model, mesh, options)
    if example_inputs is not None:
        with_loss = example_target is not None  # without a target, the forward graph is compiled for inspection
        pm.compile(tuple(example_inputs), example_kwargs, example_target, with_loss=with_loss)
    return pm
