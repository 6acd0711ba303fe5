"""``parallelize`` and the ``ParallelModel`` it returns: compile on demand, run on the job's ranks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.mesh import Mesh
from autopar.options import Options
from autopar.program import Program, check_supported, compile_program
from runtime.batch import signature, split_batch
from runtime.grad_sync import BucketedAllReduce
from runtime.groups import Groups, join


@dataclass
class _Runtime:
    """What one rank holds while running: groups, its parameters and buffers, optimizer, gradient sync."""

    groups: Groups
    state: dict[str, torch.Tensor]  # canonical name -> this rank's tensor (parameters and buffers)
    params: list[torch.nn.Parameter]
    optimizer: Any
    grad_sync: BucketedAllReduce | None


class ParallelModel:
    """An ``nn.Module`` compiled for a mesh. See ``parallelize``."""

    def __init__(self, model: torch.nn.Module, mesh: Mesh, options: Options) -> None:
        self.model = model
        self.mesh = mesh
        self.options = options
        self._programs: dict[tuple, Program] = {}
        self._last: Program | None = None
        self._rt: _Runtime | None = None

    # compile time -----------------------------------------------------------
    def compile(self, args: tuple, kwargs: dict | None = None, target: Any = None, *, with_loss: bool = True) -> Program:
        """The program for a global batch ``(args, kwargs, target)`` (cached by shapes)."""
        parts = self._split((args, kwargs or {}, target))
        local = parts[0]
        key = (with_loss, signature(local))
        if key not in self._programs:
            self._programs[key] = compile_program(self.model, self.mesh, self.options, local, with_loss=with_loss)
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
    def _runtime(self) -> _Runtime:
        if self._rt is None:
            self._rt = self._start()
        return self._rt

    def _start(self) -> _Runtime:
        groups = join(self.mesh)
        with torch.no_grad():
            for t in [*self.model.parameters(), *self.model.buffers()]:
                t.data = t.data.to(groups.device)
                dist.broadcast(t.data, src=0)  # every replica starts from rank 0's values, as DDP does
        state = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = self.options.optimizer(params) if self.options.optimizer is not None else None
        sync = None
        if groups["dp"] is not None:
            sync = BucketedAllReduce(params, groups["dp"], self.options.bucket_bytes)
        return _Runtime(groups=groups, state=state, params=params, optimizer=opt, grad_sync=sync)

    def _local_parts(self, tree: Any, rt: _Runtime) -> list[Any]:
        tree = pytree.tree_map(lambda x: x.to(rt.groups.device) if isinstance(x, torch.Tensor) else x, tree)
        m = self.options.microbatches
        i = rt.groups.coord("dp")
        return self._split(tree)[i * m : (i + 1) * m]

    def step(self, *args: Any, target: Any = None, **kwargs: Any) -> float:
        """Forward, backward, gradient sync and optimizer step on the GLOBAL batch; the global mean loss."""
        if self.options.optimizer is None:
            raise ValueError("step() needs an optimizer: parallelize(..., optimizer=lambda params: torch.optim.SGD(params, lr=0.1))")
        rt = self._runtime()
        program = self.compile(args, kwargs, target, with_loss=True)
        gm = program.graphs[rt.groups.rank]
        parts = self._local_parts((args, kwargs, target), rt)
        total = torch.zeros((), dtype=torch.float64, device=rt.groups.device)
        for i, part in enumerate(parts):
            if rt.grad_sync is not None:
                rt.grad_sync.enabled = i == len(parts) - 1
            loss = program.captured.run(rt.state, pytree.tree_leaves(part), gm)
            (loss / len(parts)).backward()
            total += loss.detach().double()
        if rt.grad_sync is not None:
            rt.grad_sync.finish()
        rt.optimizer.step()
        rt.optimizer.zero_grad(set_to_none=True)
        total /= len(parts) * self.mesh.dp
        if rt.groups["dp"] is not None:
            dist.all_reduce(total, group=rt.groups["dp"])
        return float(total)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only (no autograd graph is kept); the full output on every rank."""
        rt = self._runtime()
        program = self.compile(args, kwargs, None, with_loss=False)
        gm = program.graphs[rt.groups.rank]
        with torch.no_grad():
            outs = [program.captured.run(rt.state, pytree.tree_leaves((a, k)), gm) for a, k, _ in self._local_parts((args, kwargs, None), rt)]
            return _gather_batch(outs, rt.groups["dp"], self.mesh.dp)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded state under the original model's keys (CPU tensors)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._runtime().params


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
) -> ParallelModel:
    """Compiles ``model`` for ``mesh``; with ``example_inputs`` (a GLOBAL batch) it compiles now.

    ``loss_fn(out, target)`` is traced with the model; without it, ``step`` uses the
    model's own loss (a scalar output or the ``loss`` entry of its output).
    """
    if not isinstance(mesh, Mesh):
        mesh = Mesh.from_device_mesh(mesh)
    options = Options(loss_fn=loss_fn, optimizer=optimizer, zero=zero, schedule=schedule,
                      microbatches=microbatches, bucket_mb=bucket_mb)
    check_supported(mesh, options)
    pm = ParallelModel(model, mesh, options)
    if example_inputs is not None:
        with_loss = example_target is not None  # without a target, the forward graph is compiled for inspection
        pm.compile(tuple(example_inputs), example_kwargs, example_target, with_loss=with_loss)
    return pm
