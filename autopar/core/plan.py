"""The plan as data: what autopar decided, as small frozen values; ``Plan.render`` prints it.

Every field is a value a program can read (placements are DTensor ``Placement``
objects per mesh axis, the pipeline and the tensor-parallel layer are records);
the text of ``print(pm.plan)`` is made from them and never parsed back.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.placement_types import Placement

from autopar.core.expert_layout import ExpertLayer, ExpertParam, render_experts
from autopar.core.mesh import Mesh


class FlatShard(Placement):
    """ZeRO-3 storage over an axis: the parameter is a piece of a flat group, sharded along the flattened group."""

    def __repr__(self) -> str:
        return "Shard(flat)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FlatShard)

    def __hash__(self) -> int:
        return hash(FlatShard)


@dataclass(frozen=True)
class ZeroShard:
    """How ZeRO treats a parameter: ``stage`` 1-3, in the flat group named ``group``, sharded over ``axis``."""

    stage: int
    group: str
    axis: str = "dp"  # dp, or dp_shard under hybrid sharding

    def render(self) -> str:
        what = {1: "optimizer state sharded", 2: "gradients + optimizer state sharded",
                3: "stored sharded"}[self.stage] + f" over {self.axis}"
        what += ", gathered per layer" if self.stage == 3 else ""
        return f"zero={self.stage}: {what} in {self.group!r}"


@dataclass(frozen=True)
class ParamPlan:
    """One parameter: full shape, its placement on each mesh axis (``axes[i]`` -> ``placements[i]``)."""

    name: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    placements: tuple[Placement, ...]
    interleave: int | None = None  # stored as this many blocks interleaved per tp rank
    zero: ZeroShard | None = None
    dtypes: tuple[torch.dtype, torch.dtype] | None = None  # mixed precision: (stored, computed in)

    def placement(self, axis: str) -> Placement:
        return self.placements[self.axes.index(axis)]

    def with_placement(self, axis: str, placement: Placement) -> ParamPlan:
        i = self.axes.index(axis)
        return dataclasses.replace(self, placements=self.placements[:i] + (placement,) + self.placements[i + 1:])

    def render_placement(self) -> str:
        # the tp axis prints DTensor's short form (S(0), R), the others the long one
        text = "(" + ", ".join(f"{axis}: {p if axis == 'tp' else repr(p)}"
                               for axis, p in zip(self.axes, self.placements)) + ")"
        if self.dtypes is not None:
            text = f"{dtype_name(self.dtypes[0])}, computed in {dtype_name(self.dtypes[1])}  " + text
        if self.interleave is not None:
            text += f" (stored as {self.interleave} blocks interleaved per rank)"
        if self.zero is not None:
            text += f"  {self.zero.render()}"
        return text


def replicated(name: str, shape: tuple[int, ...], mesh: Mesh) -> ParamPlan:
    return ParamPlan(name, shape, mesh.names, tuple(Replicate() for _ in mesh.names))


@dataclass(frozen=True)
class Collective:
    """One kind of collective a step performs: on ``axis``, ``count`` times, ``bytes`` per rank in total."""

    axis: str
    op: str
    count: int
    bytes: int
    what: str
    direction: str | None = None  # "forward" | "backward" where the kind is one direction's
    dtypes: tuple[torch.dtype, ...] = ()  # what travels, when the plan shows dtypes (mixed precision)

    def render(self) -> str:
        dtypes = f" in {', '.join(dtype_name(d) for d in self.dtypes)}" if self.dtypes else ""
        return f"{self.op:<14} on {self.axis}: {self.count} x, {mib(self.bytes)} total{dtypes}  ({self.what})"


@dataclass(frozen=True)
class StagePlan:
    index: int
    rank: int  # its pp rank
    params: int
    nodes: int
    sends: int  # tensors sent per microbatch
    send_bytes: int
    dtypes: tuple[torch.dtype, ...] = ()  # of the tensors sent, when the plan shows dtypes (mixed precision)

    def render(self) -> str:
        dtypes = ", ".join(dict.fromkeys(dtype_name(d) for d in self.dtypes))
        return (f"stage {self.index} on pp rank {self.rank}: {self.params} parameters, {self.nodes} nodes, "
                f"sends {self.sends} tensors ({dtypes + ', ' if dtypes else ''}{mib(self.send_bytes)}) per microbatch")


@dataclass(frozen=True)
class PipelinePlan:
    n_stages: int
    pp_ranks: int
    microbatches: int
    bubble: float  # simulated, backward = 2 x forward
    cuts: tuple[str, ...]  # module names the stages begin at
    stages: tuple[StagePlan, ...]
    shared: tuple[tuple[str, tuple[int, ...]], ...] = ()  # parameter -> pp ranks using it

    def render(self) -> list[str]:
        lines = [f"{self.n_stages} stages over {self.pp_ranks} pp ranks, {self.microbatches} microbatches; "
                 f"bubble {self.bubble:.1%} (simulated, backward = 2 x forward)",
                 "cuts before: " + (", ".join(self.cuts) or "-")]
        lines += [st.render() for st in self.stages]
        lines += [f"{name} is used on pp ranks {list(ranks)}: gradients all-reduced among them"
                  for name, ranks in self.shared]
        return lines


@dataclass(frozen=True)
class MatmulRow:
    """A matmul-like op of the layer: where (module inside the layer), the ATen op, its parallel style."""

    where: str
    op: str
    style: str


@dataclass(frozen=True)
class CollectiveRow:
    op: str
    role: str


@dataclass(frozen=True)
class LayerLayout:
    """The first repeated layer as Megatron draws it: its matmuls and tp collectives in graph order."""

    block: str
    rows: tuple[MatmulRow | CollectiveRow, ...]
    inside: tuple[str, ...] = ()  # ops whose local replacement communicates (vocab-parallel loss, ...)
    saved: tuple[int, int] | None = None  # sequence parallelism: bytes saved for backward per rank, (with, without)

    def render(self) -> list[str]:
        lines = [f"one layer ({self.block}; every identical layer is laid out the same):"]
        for row in self.rows:
            if isinstance(row, CollectiveRow):
                lines.append(f"    {'':<22} >> {row.op}: {row.role}")
            else:
                lines.append(f"    {row.where:<22} {row.op:<28} {row.style}")
        if self.inside:
            lines.append(f"    plus collectives inside local replacements of: {', '.join(self.inside)}")
        if self.saved is not None:
            lines.append(f"    sequence parallel: the values between tensor-parallel regions are sharded; the forward "
                         f"of a microbatch saves {self.saved[0] / 2**20:.2f} MiB per rank for backward "
                         f"({self.saved[1] / 2**20:.2f} MiB without)")
        return lines


@dataclass(frozen=True)
class RecomputePlan:
    """Which layers recompute their activations in backward, and how; per pipeline stage when there are stages."""

    modes: tuple[tuple[str, str], ...]  # (layer, "none" | "selective" | "full") in execution order
    stages: tuple[tuple[int, tuple[str, ...]], ...] = ()  # (stage, its layers)
    skipped: tuple[tuple[str, str], ...] = ()  # (layer, why it is not recomputed though asked)

    def render(self) -> list[str]:
        mode = dict(self.modes)
        if self.stages:
            lines = [f"stage {s}: " + (_modes_text(tuple((la, mode[la]) for la in layers)) or "no layers")
                     for s, layers in self.stages]
        else:
            lines = [_modes_text(self.modes)]
        lines += [f"{layer} is not recomputed: {why}" for layer, why in self.skipped]
        return lines


def _modes_text(modes: tuple[tuple[str, str], ...]) -> str:
    """``"selective on transformer.h.0-3; none on ..."``: layers grouped by mode, runs of one list shortened."""
    by_mode: dict[str, list[str]] = {}
    for layer, mode in modes:
        by_mode.setdefault(mode, []).append(layer)
    return "; ".join(f"{mode} on {_layer_runs(layers)}" for mode, layers in by_mode.items())


def _layer_runs(layers: list[str]) -> str:
    """``transformer.h.0-3, lm.1`` for consecutive entries of one module list."""
    parts: list[str] = []
    run: list[tuple[str, int]] = []
    for layer in layers + [""]:
        prefix, _, index = layer.rpartition(".")
        if run and index.isdigit() and prefix == run[-1][0] and int(index) == run[-1][1] + 1:
            run.append((prefix, int(index)))
            continue
        if run:
            p, lo, hi = run[0][0], run[0][1], run[-1][1]
            parts.append(f"{p}.{lo}" if lo == hi else f"{p}.{lo}-{hi}")
            run = []
        if index.isdigit():
            run = [(prefix, int(index))]
        elif layer:
            parts.append(layer)
    return ", ".join(parts)


@dataclass(frozen=True)
class CompiledPlan:
    """``compile=True``: the inductor regions of rank 0's graphs, what stays outside them, the compile cost."""

    regions: int
    distinct: int  # regions of different structure: each compiles once per process and input signature
    compiled_ops: int
    outside: tuple[tuple[str, int], ...]  # ops left outside the regions, by kind, with their counts
    collectives: tuple[tuple[str, int], ...] = ()  # tp's collectives inside the regions (functional collectives)
    seconds: float | None = None  # inductor's compile time in this process, once a step or forward ran
    compiles: int = 0

    def render(self) -> list[str]:
        outside = ", ".join(f"{kind} x{n}" for kind, n in self.outside) or "none"
        cost = (f"compiled in {self.seconds:.1f} s in this process ({self.compiles} compilations, each distinct "
                f"region and input signature once)" if self.seconds is not None
                else "each distinct region compiles at its first call (the first step or forward)")
        return [f"{self.regions} inductor regions ({self.distinct} distinct) hold {self.compiled_ops} ops of rank 0's "
                f"graphs; {cost}", *self._inside(), f"outside the regions, run as before: {outside}"]

    def _inside(self) -> list[str]:
        if not self.collectives:
            return []
        listed = ", ".join(f"{kind} x{n}" for kind, n in self.collectives)
        return [f"inside the regions, as torch's functional collectives (inductor schedules around them): {listed}"]


@dataclass(frozen=True)
class Timings:
    """Wall seconds from ``parallelize`` to the end of the first step, in this process.

    ``export``: ``torch.export`` of the model (or reading an export another process wrote); ``passes``: every
    pass after it, for every rank's graphs; ``runtime``: the runtime's start at the first step (process groups,
    parameters placed and sharded, optimizer); ``first_step``: the first step or forward itself (inductor's
    compilation of the regions included under ``compile=True``).
    """

    export: float
    passes: float
    runtime: float | None = None
    first_step: float | None = None

    def render(self) -> str:
        parts = [f"export {self.export:.2f} s", f"passes {self.passes:.2f} s"]
        parts += [] if self.runtime is None else [f"runtime start {self.runtime:.2f} s"]  # (None: started before)
        parts += [] if self.first_step is None else [f"first step {self.first_step:.2f} s"]
        total = self.export + self.passes + (self.runtime or 0.0) + (self.first_step or 0.0)
        return ", ".join(parts) + f" ({total:.2f} s in all, this process)"


@dataclass(frozen=True)
class MemoryEstimate(Mapping):
    """Bytes per rank by kind (parameters, gradients, optimizer, gathered), for rank ``largest_on``."""

    parts: tuple[tuple[str, int], ...]
    largest_on: int | None = None  # the rank with the largest estimate, where ranks differ

    def __getitem__(self, key: str) -> int:
        return dict(self.parts)[key]

    def __iter__(self) -> Iterator[str]:
        return iter(k for k, _ in self.parts)

    def __len__(self) -> int:
        return len(self.parts)

    def scaled(self, factors: Mapping[str, float]) -> MemoryEstimate:
        return MemoryEstimate(tuple((k, int(v * factors.get(k, 1))) for k, v in self.parts), self.largest_on)


def memory(parts: Mapping[str, int], largest_on: int | None = None) -> MemoryEstimate:
    return MemoryEstimate(tuple(parts.items()), largest_on)


@dataclass
class Plan:
    """What autopar decided, as data; ``print(pm.plan)`` renders it."""

    mesh: Mesh
    nodes: int
    local_batch: tuple[int, ...]
    microbatches: int
    params: list[ParamPlan]
    collectives: list[Collective] = field(default_factory=list)
    memory: MemoryEstimate = field(default_factory=lambda: MemoryEstimate(()))  # per rank
    fallbacks: list[str] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)
    pipeline: PipelinePlan | None = None
    tensor_parallel: LayerLayout | None = None  # one layer's tensor-parallel layout
    precision: str | None = None  # mixed precision: what each dtype is (None: the model's own dtype throughout)
    recompute: RecomputePlan | None = None  # None: every activation is kept for backward
    loss_counts: tuple[str, ...] = ()  # loss nodes divided by the whole batch's count (``passes/global_count.py``)
    experts: tuple[ExpertLayer, ...] = ()  # expert parallelism: each layer's routed experts over ep
    expert_params: dict[str, ExpertParam] = field(default_factory=dict)  # where each expert parameter lives
    compiled: CompiledPlan | None = None  # compile=True: the inductor regions (None: the graphs run eagerly)
    timings: Timings | None = None  # compile time; rendered once the first step ran (``Timings``)

    def __str__(self) -> str:
        return self.render(per_parameter=True)

    def summary(self) -> str:
        """The plan without the per-parameter table."""
        return self.render(per_parameter=False)

    def render(self, *, per_parameter: bool) -> str:
        n_params = sum(numel(p.shape) for p in self.params)
        lines = [
            f"autopar plan for {self.mesh} ({self.mesh.size} ranks)",
            f"  graph: {self.nodes} ATen nodes; local batch per microbatch {list(self.local_batch)}; "
            f"{self.microbatches} microbatch(es) per step",
            f"  parameters: {len(self.params)} tensors, {n_params:,} elements",
        ]
        if self.mesh.hybrid:
            lines.append("  " + hybrid_text(self.mesh))
        if self.precision is not None:
            lines.insert(2, f"  precision: {self.precision}")
        if self.loss_counts:
            lines.insert(2, f"  loss: {', '.join(self.loss_counts)} divided by the count of the items it counts over "
                         f"the whole batch (every microbatch and dp rank), as one device divides")
        for alias, canonical in self.tied.items():
            lines.append(f"    {alias} is tied to {canonical} (one tensor, gradients summed)")
        width = max((len(p.name) for p in self.params), default=0)
        for p in self.params if per_parameter else []:
            expert = f"; {self.expert_params[p.name].render()}" if p.name in self.expert_params else ""
            lines.append(f"    {p.name:<{width}}  {str(list(p.shape)):<16} {p.render_placement()}{expert}")
        if self.pipeline is not None:
            pipeline = self.pipeline.render()
            lines.append("  pipeline: " + pipeline[0])
            lines += [f"    {line}" for line in pipeline[1:]]
        if self.tensor_parallel is not None:
            layer = self.tensor_parallel.render()
            lines.append("  tensor parallelism, " + layer[0])
            lines += layer[1:]
        if self.experts:
            lines += ["  " + line for line in render_experts(list(self.experts), self.mesh)]
        if self.recompute is not None:
            recompute = self.recompute.render()
            lines.append("  activation recomputation: " + recompute[0])
            lines += [f"    {line}" for line in recompute[1:]]
        if self.compiled is not None:
            compiled = self.compiled.render()
            lines.append("  compiled: " + compiled[0])
            lines += [f"    {line}" for line in compiled[1:]]
        if self.timings is not None and self.timings.first_step is not None:
            lines.append("  time to the first step: " + self.timings.render())
        lines.append("  collectives per step (per rank):")
        for c in self.collectives:
            lines.append(f"    {c.render()}")
        if not self.collectives:
            lines.append("    none")
        if self.fallbacks:
            lines.append("  ops run replicated (no sharding rule): " + ", ".join(self.fallbacks))
        note = f", largest on rank {self.memory.largest_on}" if self.memory.largest_on is not None else ""
        lines.append(f"  memory per rank (estimate{note}): " + ", ".join(f"{k} {mib(v)}" for k, v in self.memory.items()))
        return "\n".join(lines)


def hybrid_text(mesh: Mesh) -> str:
    """How hybrid sharding lays dp out, with rank 0's groups."""
    return (f"hybrid sharding: dp={mesh.dp} as {mesh.dp_replicate} replicas x {mesh.dp_shard} shards; ZeRO shards "
            f"over dp_shard (rank 0's group {mesh.group_of(0, 'dp_shard')}), and each shard's gradient is all-reduced "
            f"over dp_replicate, the ranks holding that shard (rank 0's group {mesh.group_of(0, 'dp_replicate')})")


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a floating dtype (fp32, bf16, ...), else torch's."""
    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
    return short.get(dtype, str(dtype).removeprefix("torch."))


def numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**16 else f"{n:,} B"
