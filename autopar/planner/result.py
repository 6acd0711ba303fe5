"""What a plan is: the candidates (``Candidate``), the ranked result (``PlanResult``) and its table.

``search.py`` builds a ``PlanResult``; ``report.py`` writes the explanation it
holds; ``bound.py`` ranks candidates. This module imports none of them, so each
may import it.

Invariant: every number printed is one of the candidates' estimates or the
cost model's; nothing here changes a candidate.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import sympy

from autopar.core.mesh import Mesh
from autopar.options import Parallelism
from autopar.planner.cluster import Cluster, gb
from autopar.planner.config import Config
from autopar.planner.cost_model import CostModel, Estimate, Precision
from autopar.planner.model_profile import ModelProfile
from autopar.planner.units import as_count, as_seconds


@dataclass
class Candidate:
    """One evaluated configuration: its memory, and its step time once asked for (``estimate``)."""

    config: Config
    fits: bool
    runnable: bool  # autopar's runtime runs this configuration today
    not_runnable: str = ""  # why not, when it does not
    precision: str = ""  # the planner's precision name ("fp32", "bf16", "mixed", ...)
    recompute: str | dict[str, str] = "none"  # what parallelize(recompute=...) takes (a mix: layer -> mode)
    known: Estimate | None = field(default=None, repr=False)  # memory only (time None) until the time is asked
    cost: CostModel | None = field(default=None, repr=False, compare=False)
    per_sample: bool = field(default=False, compare=False)  # planned for a local batch: ranked by ``pace``
    compiled: bool = field(default=False, compare=False)  # planned as inductor-compiled steps (``compile=True``)

    @property
    def estimate(self) -> Estimate:
        """Memory and step time (``CostModel.estimate``); the time is estimated on first use."""
        if self.known is None or self.known.time is None:
            self.known = self.cost.estimate(self.config)
        return self.known

    @property
    def timed(self) -> bool:
        return self.known is not None and self.known.time is not None

    @property
    def mesh(self) -> Mesh:
        c = self.config
        sizes = {k: v for k, v in (("dp", c.dp), ("pp", c.pp), ("tp", c.tp)) if v > 1}
        if c.dp_shard:  # hybrid sharding: Mesh(dp=(replicate, shard))
            sizes["dp"] = (c.replicas, c.dp_shard)
        if c.ep > 1:  # expert parallelism folded onto dp: Mesh(dp=, ep=)
            sizes = {"dp": sizes["dp"], "ep": c.ep, **{k: v for k, v in sizes.items() if k != "dp"}}
        if c.cp > 1:  # context parallelism: an axis of its own after dp, Mesh(dp=, cp=) (usp: cp=(ring, a2a))
            sizes = {**{k: v for k, v in sizes.items() if k == "dp"}, "cp": c.cp_split or c.cp,
                     **{k: v for k, v in sizes.items() if k != "dp"}}
        return Mesh(**(sizes or {"dp": 1}))

    @property
    def memory(self) -> dict[str, float]:
        return {k: float(v) for k, v in (self.known or self.estimate).memory.items()}

    @property
    def total_memory(self) -> float:
        return float((self.known or self.estimate).total_memory)

    @property
    def step_time(self) -> float:
        return float(self.estimate.step_time)

    @property
    def pace(self) -> float:
        """What the plan ranks by: the step time; planned for a local batch (``per_sample``), where a configuration
        with dp ranks trains dp local batches per step, the step time over dp (seconds per local batch)."""
        return self.step_time / self.config.dp if self.per_sample else self.step_time

    @property
    def parallelism(self) -> Parallelism:
        """This configuration as ``autopar.parallelize(model, candidate.parallelism)`` runs it."""
        c = self.config
        return Parallelism(self.mesh, zero=c.zero, schedule=c.schedule, microbatches=c.microbatches,
                           stages_per_rank=c.stages_per_rank if c.schedule == "interleaved-1f1b" else None,
                           precision=self.precision if self.precision in ("bf16", "mixed") else "fp32",
                           recompute=self.recompute, sequence_parallel=c.sequence_parallel,
                           cp_attention=c.cp_attention,  # (usp's split travels in the mesh)
                           compile=self.compiled)

    def parallelize_options(self) -> dict[str, Any]:
        """The keyword arguments of ``autopar.parallelize`` that run this configuration on its mesh."""
        chosen = self.parallelism
        return {f.name: getattr(chosen, f.name) for f in dataclasses.fields(chosen) if f.name != "mesh"}

    def as_dict(self) -> dict[str, Any]:
        c, e = self.config, self.estimate
        return {
            "mesh": {"dp": c.dp, "pp": c.pp, "tp": c.tp, "ep": c.ep, "cp": c.cp}, "cp_attention": c.cp_attention,
            "cp_a2a": c.cp_a2a, "dp_shard": c.dp_shard, "zero": c.zero,
            "schedule": c.schedule,
            "stages_per_rank": c.stages_per_rank, "microbatches": c.microbatches,
            "microbatch_size": c.microbatch_size, "recompute": c.recompute, "full_layers": c.full_layers,
            "sequence_parallel": c.sequence_parallel,
            "memory_bytes": {**self.memory, "total": self.total_memory},
            "time_s": {**{k: float(v) for k, v in e.time.items()}, "step": self.step_time},
            "tokens_per_s": float(e.tokens_per_s), "flops_per_device": float(e.flops_per_device),
            "fits": self.fits, "runnable": self.runnable, "not_runnable": self.not_runnable,
        }


@dataclass
class PlanResult:
    """Ranked candidates (fitting ones first, fastest first) and the explanation of the best.

    ``candidates``: every configuration that does not fit, and of those that fit the ones that can rank
    (``autopar/planner/bound.py``): the best ``top``, the best of each tp and each pp size, the best autopar
    runs, and any other whose lower bound did not rule it out; ``candidate(config)`` finds any configuration of
    the search.
    """

    model: str
    devices: int
    cluster: Cluster
    precision: Precision
    global_batch: int  # 0 when planned for a local batch (each candidate's is ``local_batch`` x its dp)
    seq_len: int
    candidates: list[Candidate]
    explanation: list[str]
    considered: int
    seconds: float
    profile: ModelProfile
    cost: CostModel = field(repr=False)
    top: int | None = None  # the candidates' first ``top`` are the best ``top`` (None: every one is ranked)
    fitting: int = 0  # configurations that fit, ranked or bounded out
    every: dict[Config, Candidate] = field(default_factory=dict, repr=False)  # each configuration searched
    local_batch: int = 0  # planned for this batch per data-parallel rank (``batch="local"``); 0: a global batch
    compiled: bool = False  # planned as inductor-compiled steps (``plan(compile=True)``)

    def candidate(self, config: Config) -> Candidate | None:
        """The candidate of ``config`` if the search had it (bounded out or not), else None."""
        return self.every.get(config)

    @property
    def timed(self) -> int:
        """How many configurations' step times were estimated."""
        return sum(c.timed for c in self.every.values())

    @property
    def best(self) -> Candidate:
        if not self.candidates or not self.candidates[0].fits:
            need = min((c.total_memory for c in self.candidates), default=0.0)
            raise ValueError(f"no configuration of {self.model} fits {gb(self.cluster.memory)} per device on "
                             f"{self.devices} devices; the smallest needs {gb(need)}. Use more devices, a smaller "
                             f"global batch or sequence, or recompute=('full',)")
        return self.candidates[0]

    def memory_expr(self, config: Config) -> sympy.Expr:
        """Memory per device of ``config`` as a sympy expression in the microbatch size ``b``."""
        return sympy.nsimplify(self.cost.estimate(config, symbolic=True).total_memory, rational=True)

    def step_time_expr(self, config: Config) -> sympy.Expr:
        """Step time of ``config`` (seconds) as a sympy expression in the microbatch size ``b``."""
        return self.cost.estimate(config, symbolic=True).step_time

    def max_microbatch_size(self, config: Config, memory: float | None = None) -> int:
        """The largest microbatch size for which ``config`` fits ``memory`` (default: the device's)."""
        return self.cost.max_microbatch_size(config, self.cluster.memory if memory is None else memory)

    def table(self, top: int = 10) -> str:
        """The ranked candidates, ``top`` rows: mesh, ZeRO, schedule, memory, step time, throughput."""
        return render_table(self, top)

    def __str__(self) -> str:
        return self.render()

    def render(self, top: int = 10) -> str:
        """The header, the ranked table (``top`` rows) and the explanation."""
        return render_plan(self, top)

    def to_json(self, top: int = 20) -> str:
        return json.dumps({
            "model": self.model, "parameters": self.profile.total_params, "devices": self.devices,
            "cluster": self.cluster.name, "precision": self.precision.name, "global_batch": self.global_batch,
            "local_batch": self.local_batch, "compiled": self.compiled,
            "seq_len": self.seq_len, "considered": self.considered, "timed": self.timed, "seconds": self.seconds,
            "candidates": [c.as_dict() for c in self.candidates[:top]], "explanation": self.explanation,
        }, indent=2)


# ---------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------

RC = {"none": "-", "selective": "s", "full": "f"}


def rc_label(cfg: Config) -> str:
    """The ``rc`` column: ``-``, ``s``, ``f``, or a mix: ``f3+s`` (full on 3 layers per stage, selective on the
    rest), ``f3`` (full on 3, none on the rest)."""
    if not cfg.full_layers:
        return RC[cfg.recompute]
    return f"f{cfg.full_layers}" + ("" if cfg.recompute == "none" else f"+{RC[cfg.recompute]}")


def render_table(result: PlanResult, top: int = 10) -> str:
    """The ranked candidates, ``top`` rows: mesh, ZeRO, schedule, memory, step time, throughput."""
    head = (f"{'#':>3}  {'mesh dp x pp x tp':<18} {'zero':>4}  {'schedule':<18} {'m x b':>8}  {'rc':<5} "
            f"{'params+grads+opt':>16} {'activ.':>9} {'total':>9}  {'step':>9} {'tokens/s':>10} {'TF/dev':>7}  run")
    lines = [head]
    for i, c in enumerate(result.candidates[:top], 1):
        if result.top is not None and i == result.top + 1:
            lines.append(f"  (below row {result.top}: the best of the other tp and pp sizes and what else was timed, "
                         f"not every configuration; plan with top={top} to rank {top})")
        cfg, m = c.config, c.memory
        v = f"/{cfg.stages_per_rank}" if cfg.stages_per_rank > 1 else ""
        sched = "-" if cfg.pp == 1 else cfg.schedule + v
        state = m["parameters"] + m["gradients"] + m["optimizer"]
        mesh = f"{cfg.dp_label()}{_ep(cfg)} x {cfg.pp} x {cfg.tp}" + ("+sp" if cfg.sequence_parallel else "")
        lines.append(
            f"{i:>3}  {mesh:<18} "
            f"{cfg.zero:>4}  {sched:<18} "
            f"{f'{cfg.microbatches}x{cfg.microbatch_size}':>8}  {rc_label(cfg):<5} "
            f"{gb(state):>16} {gb(m['activations']):>9} {gb(c.total_memory):>9}{'' if c.fits else '!'} "
            f"{as_seconds(c.step_time):>9} {c.estimate.tokens_per_s:>10,.0f} "
            f"{c.estimate.flops_per_device / 1e12:>7.1f}"
            f"  {'yes' if c.runnable else 'no'}")
    return "\n".join(lines)


def _ep(cfg: Config) -> str:
    """The mesh column's expert and context parallelism: ``" ep4"`` (folded onto dp), ``" cp4"`` (its own axis,
    multiplying the ranks), nothing at 1."""
    return (f" ep{cfg.ep}" if cfg.ep > 1 else "") + (f" cp{cfg.cp}" if cfg.cp > 1 else "")


def _batch(result: PlanResult) -> str:
    if result.local_batch:
        return f"local batch {result.local_batch} per data-parallel rank"
    return f"global batch {result.global_batch}"


def render_plan(result: PlanResult, top: int = 10) -> str:
    """The header, the ranked table (``top`` rows) and the explanation."""
    lines = [f"autopar plan: {result.model} ({as_count(result.profile.total_params)} parameters) on {result.devices} x "
             f"{result.cluster.name}; {_batch(result)} x {result.seq_len} tokens, "
             f"{result.precision.name} precision" + (", compiled (inductor)" if result.compiled else ""),
             f"  {result.considered} configurations planned in {result.seconds:.1f} s ({result.timed} timed, the "
             f"others' lower bounds could not rank), {result.fitting} fit "
             f"{gb(result.cluster.memory)} per device; '!' = does not fit, rc = activation recomputation (s selective, "
             "f full, f2+s full on 2 layers per stage and selective on the others), +sp = sequence parallelism, "
             "run = autopar runs it today", "", render_table(result, top), "", "why:"]
    lines += [f"  - {line}" for line in result.explanation]
    return "\n".join(lines)
