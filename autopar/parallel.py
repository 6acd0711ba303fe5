"""``parallelize`` and the ``ParallelModel`` it returns: compile on demand, run on the job's ranks.

``ParallelModel`` composes the pieces: ``compiled.ProgramCache`` (programs by
input shapes), ``rank_runtime.start_runtime`` (this rank's ``RankRuntime``,
built at the first run), ``step`` (training step and forward),
``rank_state`` / ``runtime.checkpoint`` (state dicts and checkpoints). The
user's module's parameter storage changes only in ``model_storage``.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.fx as fx

from autopar.compiler.compiled import ProgramCache
from autopar.core.graph import tied_aliases
from autopar.core.inductor import COMPILED
from autopar.core.mesh import Mesh
from autopar.core.plan import Plan
from autopar.rank.model_storage import released
from autopar.options import Options, Parallelism
from autopar.precision import check_model
from autopar.compiler.program import Program, check_supported
from autopar.rank.inputs import is_empty, rank_inputs, reads_batch
from autopar.rank.loader import in_step
from autopar.rank.build import check_ownership, seed_rng, start_runtime
from autopar.rank.state import checkpoint_state, full_state, local_state
from autopar.runtime import checkpoint
from autopar.runtime.groups import ensure_initialized, job_device
from autopar.runtime.rank import Optimizer, RankRuntime
from autopar.rank.step import forward, train_step


class ParallelModel:
    """An ``nn.Module`` compiled for a mesh. See ``parallelize``."""

    def __init__(self, model: torch.nn.Module, mesh: Mesh, options: Options) -> None:
        self.model = model
        self.mesh = mesh
        self.options = options
        self._programs = ProgramCache(model, mesh, options)
        self._rt: RankRuntime | None = None
        self.grad_norm: float | None = None  # with max_grad_norm: the last step's global norm, before clipping

    # compile time -----------------------------------------------------------
    def compile(self, args: tuple, kwargs: dict | None = None, target: Any = None, *, with_loss: bool = True) -> Program:
        """The program for a global batch ``(args, kwargs, target)`` (cached by shapes)."""
        return self._programs.compile((args, kwargs or {}, target), with_loss=with_loss, rt=self._rt)

    @property
    def plan(self) -> Plan:
        """The plan of the most recently compiled program."""
        return self._programs.require().plan

    def graph(self, rank: int) -> fx.GraphModule:
        """The rewritten GraphModule that ``rank`` runs (most recently compiled program)."""
        self.mesh.coords(rank)  # validates the rank
        return self._programs.require().graph(rank)

    # run time ---------------------------------------------------------------
    def _runtime(self, program: Program) -> RankRuntime:
        if self._rt is None:
            start = time.perf_counter()
            self._rt = start_runtime(self.model, self.mesh, self.options, program)
            if program.plan.timings is not None:
                program.plan.timings = dataclasses.replace(program.plan.timings, runtime=time.perf_counter() - start)
        return self._rt

    def _prepare(self, batch: tuple[tuple, dict, Any], *, with_loss: bool) -> tuple[Program, RankRuntime, list[list]]:
        """The program for ``batch``, the runtime, and this rank's microbatches of ``batch`` on its device,
        each as the flat inputs of the program's graphs (``autopar/rank/inputs.py``)."""
        local = self.options.batch == "local"
        program = self._programs.require() if local and is_empty(batch) else self.compile(*batch, with_loss=with_loss)
        rt = self._runtime(program)
        program.move_to(rt.groups.rank, rt.groups.device)
        check_ownership(self.model, program, rt)
        seed_rng(rt, self.mesh)
        if local and is_empty(batch) and reads_batch(program, rt.groups.rank):
            raise ValueError(f"batch='local': rank {rt.groups.rank} passed no batch, but a stage it computes reads "
                             f"the inputs or the target; pass its local batch (pm.reads_batch is True there)")
        return program, rt, rank_inputs(program, batch if with_loss else batch[:2], rt, self.mesh,
                                        self.options.microbatches, self.options.batch)

    @property
    def dp_size(self) -> int:
        """The number of data-parallel replicas (``DistributedSampler(num_replicas=pm.dp_size, ...)``)."""
        return self.mesh.dp

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel index (``DistributedSampler(rank=pm.dp_rank, ...)``); the tp and pp
        ranks of one replica share it."""
        return self.mesh.coords(_process_rank("pm.dp_rank")).dp

    @property
    def reads_batch(self) -> bool:
        """Whether this process's stages read the inputs or the target (under ``batch="local"`` a process
        whose stages read neither may pass nothing to ``step``)."""
        return reads_batch(self._programs.require(), _process_rank("pm.reads_batch"))

    def batches(self, loader: Iterable) -> Iterator[Any]:
        """``loader``'s batches, each once every rank has one: ``for x, y in pm.batches(loader): pm.step(...)``.
        Loaders that yield different numbers of batches on different ranks are an error on every rank naming
        the ranks and their counts (before the first batch where they have lengths), not a hang in the next
        step (``autopar/rank/loader.py``). Every rank iterates through it."""
        ensure_initialized()
        return in_step(loader, job_device())

    def step(self, *args: Any, target: Any = None, **kwargs: Any) -> float:
        """Forward, backward, gradient sync and optimizer step on the GLOBAL batch; the global mean loss."""
        if self.options.optimizer is None:
            raise ValueError("step() needs an optimizer: parallelize(..., optimizer=lambda params: torch.optim.SGD(params, lr=0.1))")
        program, rt, flats = self._prepare((args, kwargs, target), with_loss=True)
        start = time.perf_counter()
        with rt.progress.call("step"):
            loss, norm = train_step(self.model, self.mesh, program, rt, flats, self.options.max_grad_norm)
        if norm is not None:
            self.grad_norm = norm
        self._first_run(program, time.perf_counter() - start)
        return loss

    def _first_run(self, program: Program, seconds: float) -> None:
        """The plan told what the program's first step or forward took; under compile=True, what compiling the
        regions has cost this process so far."""
        timings = program.plan.timings
        if timings is not None and timings.first_step is None:
            program.plan.timings = dataclasses.replace(timings, first_step=seconds)
        if program.plan.compiled is not None:
            program.plan.compiled = dataclasses.replace(program.plan.compiled, seconds=COMPILED.seconds,
                                                        compiles=COMPILED.compiles)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only (no autograd graph is kept); the full output on every rank."""
        program, rt, flats = self._prepare((args, kwargs, None), with_loss=False)
        start = time.perf_counter()
        with rt.progress.call("forward"):
            out = forward(self.mesh, program, rt, flats, gather=self.options.batch == "global")
        self._first_run(program, time.perf_counter() - start)
        return out

    def timeline(self, *, layers: bool = False) -> list[tuple[str, float, float]]:
        """This rank's actions of the last step or forward: ``(action, start, end)`` (perf_counter seconds).

        ``layers``: with them, the events inside those actions, by start: ZeRO's gathers, backward compute and
        gradient reduce-scatters of each layer (``runtime/zero_trace.py``; docs/zero.md), and each wait of ring
        attention for a K/V block or its gradients (``"ring_wait"``: the ring's exposed communication).
        """
        if self._rt is None:
            return []
        actions = list(self._rt.executor.timeline)
        if not (layers and actions):
            return actions
        events = list(self._rt.binding.waits)
        if self._rt.zero is not None:
            events += self._rt.zero.trace.between(actions[0][1], actions[-1][2])
        return sorted(actions + events, key=lambda record: record[1])

    def communication(self, *, calls: bool = False) -> dict[str, int]:
        """Bytes (or, with ``calls``, calls) of the tensor-parallel collectives and ZeRO's gathers and
        reduce-scatters (``zero_all_gather@dp``, ...) counted since the runtime started, by ``op@axis``."""
        if self._rt is None:
            return {}
        b = self._rt.binding
        return {f"{op}@{axis}": (b.counts if calls else b.bytes)[(op, axis)] for op, axis in b.counts}

    def parameters(self) -> list[torch.nn.Parameter]:
        if self._rt is None:
            raise RuntimeError("the runtime starts at the first pm.step or pm(...) call")
        return self._rt.params

    @property
    def optimizer(self) -> Optimizer | None:
        """The optimizer the factory built on this rank's parameters (its shards under ZeRO), for LR schedulers."""
        return self._runtime(self._programs.require()).optimizer

    def memory(self) -> dict[str, int]:
        """Bytes of this rank's parameters, gradients and optimizer state, measured after the last step."""
        return self._runtime(self._programs.require()).memory.read()

    # state ------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded state under the original model's keys (CPU tensors), on every rank.

        Every rank must call it: it gathers ZeRO shards over dp, broadcasts each stage's tensors over
        pp and gathers tensor-parallel shards over tp.
        """
        program = self._programs.require()
        aliases = tied_aliases(self.model)
        full = full_state(self.model, self.mesh, program, self._rt) if self._rt is not None else {}
        return {k: full.get(aliases.get(k, k), v).detach().to("cpu", copy=True)
                for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Loads a full state (``state_dict()`` of this model from any mesh, or of the single-device model)."""
        program = self._programs.require()
        rt = self._runtime(program)
        local = local_state(self.model, self.mesh, program, rt.groups.rank, state)
        if program.pipelined:  # other stages' parameters are not kept here: nothing to load into them
            aliases, empty = tied_aliases(self.model), released(self.model)
            local = {k: empty.get(aliases.get(k, k), v) for k, v in local.items()}
        if rt.zero is not None:
            rt.zero.load_full_state_dict(local)
        else:
            self.model.load_state_dict(local)
            with torch.no_grad():  # mixed precision: the masters take the full-precision values
                for name, p in self.model.named_parameters():
                    if rt.master_of(p) is not p:
                        rt.master_of(p).copy_(local[name])

    def save(self, path: str, extra: Any = None) -> None:
        """Writes a new checkpoint version to the folder ``path``, each rank its own shards (every rank calls it).

        The checkpoint keeps the model's keys and full shapes, so ``load`` reads it on any mesh and ZeRO stage.
        """
        program = self._programs.require()
        rt = self._runtime(program)
        with rt.progress.call("save"):
            checkpoint.save(path, rt, checkpoint_state(self.model, self.mesh, program, rt, rt.full_shapes), extra)

    def load(self, path: str) -> Any:
        """Reads the latest complete checkpoint in ``path``, written on any mesh, resharded to this one; returns
        its ``extra``. Every rank calls it; a checkpoint of another model is refused on every rank, naming the
        first key that differs."""
        program = self._programs.require()
        rt = self._runtime(program)
        with rt.progress.call("load"):
            return checkpoint.load(path, rt, checkpoint_state(self.model, self.mesh, program, rt, rt.full_shapes))

    @property
    def runtime(self) -> RankRuntime | None:
        """This rank's ``RankRuntime``, for inspection (None until the first ``step`` or forward call): its
        process groups, parameters, optimizer, gradient sync, ZeRO state, step executor and collective counts."""
        return self._rt


def _process_rank(what: str) -> int:
    """This process's global rank: the process group's, or torchrun's ``RANK`` before the group starts."""
    if dist.is_initialized():
        return dist.get_rank()
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    raise RuntimeError(f"{what} needs this process's rank: run under autopar.launch or torchrun")


def parallelize(
    model: torch.nn.Module,
    mesh: Mesh | Parallelism | str | Any,
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
    precision: str = "fp32",
    reduce_dtype: str | torch.dtype | None = None,
    recompute: str | dict[str, str] | Callable[[str], str] | None = None,
    sequence_parallel: bool | None = None,
    batch: str = "global",
    cp_attention: str = "ring",
    compile: bool = False,
) -> ParallelModel:
    """Compiles ``model`` for ``mesh``; with ``example_inputs`` (a GLOBAL batch) it compiles now.

    ``loss_fn(out, target)`` is traced with the model; without it, ``step`` uses the
    model's own loss (a scalar output or the ``loss`` entry of its output).
    ``mesh="auto"``: the planner (``autopar.planner``) chooses the mesh, ZeRO stage,
    schedule and microbatches for the job's world size from ``example_inputs`` (rank 0
    plans and broadcasts its choice; ``autopar/planner/auto.py``); a
    ``Parallelism`` (the planner's choice: ``autopar.plan(...).best.parallelism``) runs
    that configuration.
    ``max_grad_norm``: clip the gradient to this global 2-norm before each optimizer
    step (as ``torch.nn.utils.clip_grad_norm_`` on one device); ``pm.grad_norm`` is
    the last step's norm.
    ``precision="bf16"``: float32 master parameters and optimizer state, bfloat16
    compute, activations, tp collectives, pipeline hops and ZeRO-3 gathers, gradients
    reduced in ``reduce_dtype`` ("fp32" by default, or "bf16"), float32 loss
    (``autopar/precision.py``); "fp32" (the default) runs the model in its own dtype.
    ``precision="mixed"``: the ZeRO paper's layout (DeepSpeed's bf16): bfloat16
    trainable parameters and gradients (microbatches accumulate in bf16), float32
    masters kept and stepped by the optimizer (sharded with its state under ZeRO):
    2 + 2 + 12 bytes per parameter with Adam; bf16 compute as under "bf16";
    gradients reduced in ``reduce_dtype`` ("bf16" by default, or "fp32");
    ``state_dict`` and checkpoints hold the float32 masters.
    ``recompute``: activation recomputation per layer (entry of a module list):
    ``"none"`` (default), ``"selective"`` (keep matmul and attention outputs,
    recompute the rest) or ``"full"`` (keep each layer's inputs), the same for
    every layer, or ``{layer or fnmatch pattern: mode}`` (first match; others
    ``"none"``), or a function ``layer -> mode``. Under ``mesh="auto"`` the
    planner chooses it unless given.
    ``sequence_parallel=True`` (needs tp > 1): the solver places the values
    between tensor-parallel regions (residual stream, norms, dropout) for the
    least activation memory per rank, sharded along the sequence (or batch),
    each forward all-reduce becoming a reduce-scatter and an all-gather of the
    same bytes (Korthikanti et al. 2022). Under ``mesh="auto"`` the planner
    chooses it (where memory is short) unless given.
    ``batch="local"``: each data-parallel rank passes its own shard of the batch
    (``pm.dp_rank`` of ``pm.dp_size``; the tp ranks of a replica pass the same one, a
    pipeline rank whose stages read no input may pass nothing), ``example_inputs`` are
    a local batch too, and ``pm(x)`` returns this rank's outputs (scalars such as a
    loss averaged over dp); training equals single-device training on the shards
    concatenated in dp order. "global" (the default): every rank passes the global batch.
    ``cp_attention`` (meshes with cp > 1): ``"ring"`` (the default) passes K/V blocks
    around the cp ranks, each exchange overlapped with a block's attention;
    ``"all_to_all"`` exchanges heads for sequence (DeepSpeed-Ulysses): each rank
    computes the whole sequence's attention for ``heads / cp`` heads, fewer bytes
    than the ring from cp = 4 on, not overlapped; the head count must divide by cp.
    ``"usp"`` (unified sequence parallelism, ``Mesh(cp=(ring, a2a))``): heads exchanged
    inside each group of ``a2a`` consecutive cp ranks, a ring over the ``ring`` groups;
    the head count must divide by ``a2a`` only.
    ``compile=True``: each rank's forward, backward and recomputed regions run through inductor
    (``torch._inductor``), the ATen ops between autopar's collectives and exchanges fused into compiled regions,
    each distinct region compiled once per process at its first call; the collectives, ZeRO's gathers, the
    pipeline's sends and the schedule keep their order (``passes/inductor_regions.py``; ``pm.plan`` lists the
    regions, what stays outside them and, once a step ran, the seconds compiling took).
    """
    if isinstance(mesh, str):
        from autopar.planner.auto import auto_parallelism

        mesh = auto_parallelism(model, mesh, example_inputs=example_inputs, example_kwargs=example_kwargs,
                                optimizer=optimizer, precision=precision, recompute=recompute,
                                batch=batch, compile=compile)
    if isinstance(mesh, Parallelism):
        chosen, mesh = mesh, mesh.mesh
        zero, schedule, microbatches = chosen.zero, chosen.schedule, chosen.microbatches
        stages_per_rank, precision = chosen.stages_per_rank, chosen.precision
        recompute = chosen.recompute if recompute is None else recompute
        sequence_parallel = chosen.sequence_parallel if sequence_parallel is None else sequence_parallel
        cp_attention = chosen.cp_attention
        compile = compile or chosen.compile
    if not isinstance(mesh, Mesh):
        mesh = Mesh.from_device_mesh(mesh)
    options = Options(loss_fn=loss_fn, optimizer=optimizer, zero=zero, zero_prefetch=zero_prefetch, schedule=schedule,
                      microbatches=microbatches, bucket_mb=bucket_mb,
                      split_points=tuple(split_points) if split_points else None, stages_per_rank=stages_per_rank,
                      max_grad_norm=max_grad_norm, precision=precision, reduce_dtype=reduce_dtype,
                      recompute="none" if recompute is None else recompute,
                      sequence_parallel=bool(sequence_parallel), batch=batch, cp_attention=cp_attention,
                      compile=compile)
    check_supported(mesh, options)
    check_model(model, options.policy)
    pm = ParallelModel(model, mesh, options)
    if example_inputs is not None:
        with_loss = example_target is not None  # without a target, the forward graph is compiled for inspection
        pm.compile(tuple(example_inputs), example_kwargs, example_target, with_loss=with_loss)
    return pm
