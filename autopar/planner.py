"""The planner: choose data, tensor and pipeline parallelism, ZeRO, schedule and microbatches, and say why.

``plan(model, devices=N, cluster=..., global_batch=..., seq_len=...)`` profiles
the model once from its graph (``autopar.cost_model``; a meta-device model
needs no memory), then evaluates every configuration of the search space:

- meshes ``dp x pp x tp = N`` (tp among the sizes the profile analyzed);
- ZeRO stage 0-3 over dp;
- schedule (GPipe, 1F1B, interleaved 1F1B with 2 or 4 stages per rank);
- microbatch size ``b`` (every divisor of the dp rank's batch up to
  ``max_microbatch``) and with it the microbatch count;
- activation recomputation on or off.

Candidates that fit the device memory are ranked by estimated step time;
each carries its memory per device, step-time breakdown, throughput, and
whether autopar's runtime runs it today (``runnable``). The result explains
the choice in checkable sentences: what the largest layer needs, why a
smaller tp or pp does not fit or is slower, what the bubble and the exposed
communication cost.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import sympy
import torch
import torch.distributed as dist

from autopar.cluster import Cluster, gb
from autopar.cost_model import (OPTIMIZER_STATES, PRECISIONS, Config, CostModel, Estimate, Precision, b_sym,
                                precision_of)
from autopar.model_profile import ModelProfile, profile_model
from autopar.mesh import Mesh

TIME_KEYS = ("compute", "tensor_parallel", "pipeline_p2p", "bubble", "shared_cores", "data_parallel")


@dataclass
class Candidate:
    """One evaluated configuration."""

    config: Config
    estimate: Estimate
    fits: bool
    runnable: bool  # autopar's runtime runs this configuration today
    not_runnable: str = ""  # why not, when it does not

    @property
    def mesh(self) -> Mesh:
        c = self.config
        sizes = {k: v for k, v in (("dp", c.dp), ("pp", c.pp), ("tp", c.tp)) if v > 1}
        return Mesh(**(sizes or {"dp": 1}))

    @property
    def memory(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.estimate.memory.items()}

    @property
    def total_memory(self) -> float:
        return float(self.estimate.total_memory)

    @property
    def step_time(self) -> float:
        return float(self.estimate.step_time)

    def parallelize_options(self) -> dict[str, Any]:
        """Keyword arguments of ``autopar.parallelize`` that run this configuration."""
        c = self.config
        return {"zero": c.zero, "schedule": c.schedule, "microbatches": c.microbatches,
                "stages_per_rank": c.stages_per_rank if c.schedule == "interleaved-1f1b" else None}

    def as_dict(self) -> dict[str, Any]:
        c, e = self.config, self.estimate
        return {
            "mesh": {"dp": c.dp, "pp": c.pp, "tp": c.tp}, "zero": c.zero, "schedule": c.schedule,
            "stages_per_rank": c.stages_per_rank, "microbatches": c.microbatches,
            "microbatch_size": c.microbatch_size, "recompute": c.recompute,
            "memory_bytes": {**self.memory, "total": self.total_memory},
            "time_s": {**{k: float(v) for k, v in e.time.items()}, "step": self.step_time},
            "tokens_per_s": float(e.tokens_per_s), "flops_per_device": float(e.flops_per_device),
            "fits": self.fits, "runnable": self.runnable, "not_runnable": self.not_runnable,
        }


@dataclass
class PlanResult:
    """Ranked candidates (fitting ones first, fastest first) and the explanation of the best."""

    model: str
    devices: int
    cluster: Cluster
    precision: Precision
    global_batch: int
    seq_len: int
    candidates: list[Candidate]
    explanation: list[str]
    considered: int
    seconds: float
    profile: ModelProfile
    cost: CostModel = field(repr=False)

    @property
    def best(self) -> Candidate:
        if not self.candidates or not self.candidates[0].fits:
            need = min((c.total_memory for c in self.candidates), default=0.0)
            raise ValueError(f"no configuration of {self.model} fits {gb(self.cluster.memory)} per device on "
                             f"{self.devices} devices; the smallest needs {gb(need)}. Use more devices, a smaller "
                             f"global batch or sequence, or recompute=(True,)")
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
        head = (f"{'#':>3}  {'mesh dp x pp x tp':<18} {'zero':>4}  {'schedule':<17} {'m x b':>8}  {'rc':<2} "
                f"{'params+grads+opt':>16} {'activ.':>9} {'total':>9}  {'step':>9} {'tokens/s':>10} {'TF/dev':>7}  run")
        lines = [head]
        for i, c in enumerate(self.candidates[:top], 1):
            cfg, m = c.config, c.memory
            v = f"/{cfg.stages_per_rank}" if cfg.stages_per_rank > 1 else ""
            sched = "-" if cfg.pp == 1 else cfg.schedule + v
            state = m["parameters"] + m["gradients"] + m["optimizer"]
            lines.append(
                f"{i:>3}  {f'{cfg.dp} x {cfg.pp} x {cfg.tp}':<18} {cfg.zero:>4}  {sched:<17} "
                f"{f'{cfg.microbatches}x{cfg.microbatch_size}':>8}  {'y' if cfg.recompute else '-':<2} "
                f"{gb(state):>16} {gb(m['activations']):>9} {gb(c.total_memory):>9}{'' if c.fits else '!'} "
                f"{_seconds(c.step_time):>9} {c.estimate.tokens_per_s:>10,.0f} "
                f"{c.estimate.flops_per_device / 1e12:>7.1f}"
                f"  {'yes' if c.runnable else 'no'}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()

    def render(self, top: int = 10) -> str:
        """The header, the ranked table (``top`` rows) and the explanation."""
        fitting = sum(c.fits for c in self.candidates)
        lines = [f"autopar plan: {self.model} ({_count(self.profile.total_params)} parameters) on {self.devices} x "
                 f"{self.cluster.name}; global batch {self.global_batch} x {self.seq_len} tokens, "
                 f"{self.precision.name} precision",
                 f"  {self.considered} configurations planned in {self.seconds:.1f} s, {fitting} fit "
                 f"{gb(self.cluster.memory)} per device; '!' = does not fit, rc = activation recomputation, "
                 "run = autopar runs it today", "", self.table(top), "", "why:"]
        lines += [f"  - {line}" for line in self.explanation]
        return "\n".join(lines)

    def to_json(self, top: int = 20) -> str:
        return json.dumps({
            "model": self.model, "parameters": self.profile.total_params, "devices": self.devices,
            "cluster": self.cluster.name, "precision": self.precision.name, "global_batch": self.global_batch,
            "seq_len": self.seq_len, "considered": self.considered, "seconds": self.seconds,
            "candidates": [c.as_dict() for c in self.candidates[:top]], "explanation": self.explanation,
        }, indent=2)


def plan(
    model: torch.nn.Module,
    devices: int,
    *,
    cluster: Cluster | str = "dgx-a100",
    global_batch: int,
    seq_len: int | None = None,
    precision: str | Precision = "mixed",
    optimizer: str = "adam",
    example_inputs: tuple | None = None,
    example_kwargs: dict | None = None,
    zero: tuple[int, ...] = (0, 1, 2, 3),
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b"),
    recompute: tuple[bool, ...] = (False, True),
    tp: tuple[int, ...] | None = None,
    pp: tuple[int, ...] | None = None,
    max_microbatch: int = 16,
    runnable_only: bool = False,
    overlap_grad_sync: bool = True,
    profile: ModelProfile | None = None,
) -> PlanResult:
    """Ranked configurations for training ``model`` on ``devices`` devices of ``cluster``.

    ``model`` may live on the meta device. ``seq_len``: tokens per sequence
    (``None`` for a model whose inputs have no sequence dim). ``precision``:
    ``"fp32"`` or ``"mixed"`` (bf16 weights, gradients and activations; fp32
    master weights and optimizer state). ``optimizer``: ``"adam"`` (2 state
    elements per parameter), ``"sgd-momentum"`` (1) or ``"sgd"`` (0).
    ``tp`` / ``pp``: restrict the sizes searched. ``overlap_grad_sync``: the
    dp gradient reduction overlaps backward (DDP, autopar) rather than
    following it (Megatron-LM in 2021). ``profile``: reuse a
    ``profile_model`` result (planning several clusters or batch sizes).
    """
    start = time.perf_counter()
    cluster = Cluster.preset(cluster) if isinstance(cluster, str) else cluster
    prec = PRECISIONS[precision] if isinstance(precision, str) else precision
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATES)}")
    _check_positive(devices=devices, global_batch=global_batch, max_microbatch=max_microbatch)
    if profile is None:
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"plan needs an nn.Module (on the meta device is fine) or profile=..., "
                             f"got {type(model).__name__}")
        tp_sizes = tuple(t for t in _powers_of_two(min(devices, cluster.devices_per_node)) if devices % t == 0)
        profile = profile_model(model, example_inputs=example_inputs, example_kwargs=example_kwargs,
                                sequence=seq_len is not None, tp_sizes=tuple(tp or tp_sizes))
    cost = CostModel(profile, cluster, prec, seq_len=seq_len or 1, optimizer_states=OPTIMIZER_STATES[optimizer],
                     overlap_grad_sync=overlap_grad_sync)
    evaluated = [c for config in search_space(profile, devices, global_batch, zero=zero, schedules=schedules,
                                              recompute=recompute, tp=tp, pp=pp, max_microbatch=max_microbatch)
                 if (c := _evaluate(cost, config, cluster, prec, profile)) is not None]
    if not evaluated:
        layers = sum(seg.count for seg in profile.layers)
        raise ValueError(f"no configuration of {devices} devices applies: global batch {global_batch} must divide by "
                         f"dp x microbatches, and pp x stages per rank must not exceed the {layers} layers; "
                         "change the batch or the device count")
    candidates = [c for c in evaluated if c.runnable or not runnable_only]
    if not candidates:
        raise ValueError(f"none of the {len(evaluated)} configurations is one autopar runs today (e.g. "
                         f"{evaluated[0].config.describe()}: {evaluated[0].not_runnable}); plan with "
                         "runnable_only=False to see them all")
    # fitting first, fastest first; within 0.1% of the same time the lower ZeRO stage, then less memory
    candidates.sort(key=lambda c: (not c.fits, float(f"{c.step_time if c.fits else c.total_memory:.3g}"),
                                   c.config.zero, c.total_memory))
    result = PlanResult(model=profile.name, devices=devices, cluster=cluster, precision=prec,
                        global_batch=global_batch, seq_len=seq_len or 1, candidates=candidates, explanation=[],
                        considered=len(evaluated), seconds=0.0, profile=profile, cost=cost)
    result.explanation = explain(result)
    result.seconds = time.perf_counter() - start
    return result


def search_space(profile: ModelProfile, devices: int, global_batch: int, *, zero: tuple[int, ...] = (0, 1, 2, 3),
                 schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b"),
                 recompute: tuple[bool, ...] = (False, True), tp: tuple[int, ...] | None = None,
                 pp: tuple[int, ...] | None = None, max_microbatch: int = 16) -> Iterator[Config]:
    """Every configuration of ``devices`` devices that splits ``global_batch`` evenly."""
    layers = sum(seg.count for seg in profile.layers)
    for t in sorted(profile.tp_sizes):
        if devices % t or (tp is not None and t not in tp):
            continue
        for p in _divisors(devices // t):
            if p > max(layers, 1) or (pp is not None and p not in pp):
                continue
            dp = devices // (t * p)
            if global_batch % dp:
                continue
            local = global_batch // dp
            for b in [d for d in _divisors(local) if d <= max_microbatch]:
                m = local // b
                for sched, v in _schedules(schedules, p, m, layers):
                    for z in [z for z in zero if dp > 1 or z == 0]:
                        for rc in recompute:
                            yield Config(dp=dp, pp=p, tp=t, zero=z, schedule=sched, stages_per_rank=v,
                                         microbatches=m, microbatch_size=b, recompute=rc)


def _schedules(names: tuple[str, ...], pp: int, m: int, layers: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [(n, 1) for n in names if n in ("gpipe", "1f1b")]
    if "interleaved-1f1b" in names:
        out += [("interleaved-1f1b", v) for v in (2, 4) if m % pp == 0 and pp * v <= layers]
    return out


def _evaluate(cost: CostModel, config: Config, cluster: Cluster, prec: Precision,
              profile: ModelProfile) -> Candidate | None:
    try:
        est = cost.estimate(config)
    except ValueError:
        return None
    reason = not_runnable(config, prec, profile)
    return Candidate(config=config, estimate=est, fits=float(est.total_memory) <= cluster.memory,
                     runnable=not reason, not_runnable=reason)


def not_runnable(config: Config, prec: Precision, profile: ModelProfile) -> str:
    """Why autopar's runtime cannot run ``config`` today ("" when it can)."""
    if config.recompute:
        return "activation recomputation is planned, not yet run"
    if prec != precision_of(profile.dtype):
        return f"autopar runs the model in its own dtype ({profile.dtype}), not {prec.name} precision"
    return ""


# ---------------------------------------------------------------------------
# explanations
# ---------------------------------------------------------------------------

def explain(result: PlanResult) -> list[str]:
    """Sentences a person can check against the table: what is needed, what does not fit, what it costs."""
    cands = result.candidates
    best = cands[0]
    prec, mem = result.precision, result.cluster.memory
    out = [_largest_layer(result)]
    for axis in ("tp", "pp"):
        out += _axis_reasons(result, axis)
    out += [f"note: {note}" for note in result.profile.notes if "not analyzed" in note]
    if not best.fits:
        out.append(f"nothing fits {gb(mem)} per device: the smallest configuration ({best.config.describe()}) needs "
                   f"{gb(best.total_memory)}; add devices, lower the global batch or sequence, or use recomputation")
        return out
    c, e = best.config, best.estimate
    out += _zero_reason(result)
    b_max = result.max_microbatch_size(c)
    expr = result.memory_expr(c)
    at_one, at_two = float(expr.subs(b_sym, 1)), float(expr.subs(b_sym, 2))
    slope, const = at_two - at_one, 2 * at_one - at_two
    out.append(f"memory per device of the best is {gb(const)} + {gb(slope)} x b for microbatch size b; the largest b "
               f"that fits {gb(mem)} is {b_max}; chosen b={c.microbatch_size} with {c.microbatches} microbatches")
    t = {k: float(v) for k, v in e.time.items()}
    total = best.step_time
    parts = ", ".join(f"{k.replace('_', ' ')} {_seconds(v)} ({v / total:.0%})" for k, v in t.items() if v > 0)
    out.append(f"step time {_seconds(total)}: {parts}")
    if c.pp > 1:
        out.append(f"pipeline bubble (pp-1)/(v*m) = {c.pp - 1}/({c.stages_per_rank}*{c.microbatches}) = "
                   f"{(c.pp - 1) / (c.stages_per_rank * c.microbatches):.1%} of the compute time")
    peak = result.cluster.peak(prec.name)
    out.append(f"throughput {e.tokens_per_s:,.0f} tokens/s; {_rate(e.flops_per_device)} of model FLOPs per device = "
               f"{e.flops_per_device / peak:.0%} of the {_rate(peak)} peak")
    runnable = next((x for x in cands if x.fits and x.runnable), None)
    if not best.runnable:
        other = (f"{runnable.config.describe()} at {_seconds(runnable.step_time)}" if runnable
                 else "none fits" if any(x.runnable for x in cands) else "none of these")
        out.append(f"the best is not run by autopar today ({best.not_runnable}); the best it runs: {other}")
    return out


def _largest_layer(result: PlanResult) -> str:
    prec = result.precision
    per_param = prec.param + prec.grad + prec.master + result.cost.states * prec.state
    layers = result.profile.layers
    if not layers:
        return f"{result.profile.total_params:,} parameters, no repeated layers; {per_param} bytes per parameter"
    seg = max(layers, key=lambda s: s.parts[1].param_elements)
    n = seg.parts[1].param_elements
    count = sum(s.count for s in layers)
    return (f"{count} layers; the largest ({seg.name}) has {_count(n)} parameters and needs {gb(n * per_param)} "
            f"for parameters, gradients and optimizer state ({prec.name}: {per_param} bytes per parameter)")


def _axis_reasons(result: PlanResult, axis: str) -> list[str]:
    """For each other size of ``axis``: why it was not chosen (does not fit, or slower)."""
    best = result.candidates[0]
    chosen = getattr(best.config, axis)
    out = []
    sizes = sorted({getattr(c.config, axis) for c in result.candidates})
    for size in sizes:
        if size == chosen:
            continue
        group = [c for c in result.candidates if getattr(c.config, axis) == size]
        fitting = [c for c in group if c.fits]
        if not fitting:
            smallest = min(group, key=lambda c: c.total_memory)
            out.append(f"with {axis}={size} nothing fits: the smallest need is {gb(smallest.total_memory)} per device "
                       f"({smallest.config.describe()}) > {gb(result.cluster.memory)} -> {axis}={chosen}")
        elif best.fits:
            fastest = min(fitting, key=lambda c: c.step_time)
            worse = _biggest_difference(fastest, best)
            out.append(f"{axis}={size} fits but its best ({fastest.config.describe()}) takes "
                       f"{_seconds(fastest.step_time)} per step, {fastest.step_time / best.step_time:.2f}x the best"
                       + (f" ({worse})" if worse else ""))
    if axis == "tp" and chosen > 1:
        span = result.cluster.devices_per_node
        where = "inside one node" if chosen <= span else f"across nodes ({span} devices per node)"
        out.append(f"tp={chosen} all-reduces run {where} at {gb(result.cluster.link(chosen).bandwidth)}/s")
    return out


def _biggest_difference(other: Candidate, best: Candidate) -> str:
    diffs = {k: float(other.estimate.time[k]) - float(best.estimate.time[k]) for k in TIME_KEYS}
    key = max(diffs, key=lambda k: diffs[k])
    if diffs[key] <= 0:
        return ""
    return (f"{key.replace('_', ' ')} {_seconds(float(other.estimate.time[key]))} vs "
            f"{_seconds(float(best.estimate.time[key]))}")


def _zero_reason(result: PlanResult) -> list[str]:
    best = result.candidates[0]
    c = best.config
    if c.dp == 1:
        return []
    state = lambda x: x.memory["parameters"] + x.memory["gradients"] + x.memory["optimizer"]  # noqa: E731
    out = []
    for z in range(4):
        if z == c.zero:
            continue
        twin = next((x for x in result.candidates if x.config == dataclasses.replace(c, zero=z)), None)
        if twin is None:
            continue
        verdict = "does not fit" if not twin.fits else f"{twin.step_time / best.step_time:.2f}x the step time"
        out.append(f"zero={z} instead of {c.zero}: parameters+gradients+optimizer {gb(state(twin))} vs "
                   f"{gb(state(best))} per device; {verdict}")
    return out[:2]


# ---------------------------------------------------------------------------
# parallelize(model, "auto")
# ---------------------------------------------------------------------------

def auto_choice(model: torch.nn.Module, spec: str, *, example_inputs: tuple | None, example_kwargs: dict | None,
                optimizer: Callable | None) -> Candidate:
    """The best configuration autopar runs for the job's world size (``parallelize(model, "auto")``).

    Every rank plans the same way; under a running job rank 0's choice is
    broadcast so that all ranks agree even if two plans tie.
    """
    if spec != "auto":
        raise ValueError(f"mesh {spec!r} is not a Mesh; pass autopar.Mesh(...) or the string 'auto'")
    if example_inputs is None:
        raise ValueError("parallelize(model, 'auto') needs example_inputs=(...) (a global batch) to plan for its "
                         "batch and sequence sizes")
    devices = _world_size()
    first = next((a for a in example_inputs if isinstance(a, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        raise ValueError("parallelize(model, 'auto') needs a tensor input with the batch in dim 0")
    seq = first.shape[1] if sequence_of(example_inputs) else None
    small = tuple(_two_rows(a) if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == first.shape[0] else a
                  for a in example_inputs)  # the profile's capture needs a batch of 2, whatever the global one
    states = _optimizer_states(optimizer)
    cluster = _local_cluster(devices)
    result = plan(model, devices, cluster=cluster, global_batch=first.shape[0], seq_len=seq,
                  precision=precision_of(next(model.parameters()).dtype), optimizer=states,
                  example_inputs=small, example_kwargs=example_kwargs, runnable_only=True, recompute=(False,))
    chosen = result.best
    if dist.is_available() and dist.is_initialized():
        box = [chosen.config]
        dist.broadcast_object_list(box, src=0)
        if box[0] != chosen.config:
            chosen = _evaluate(result.cost, box[0], cluster, result.precision, result.profile) or chosen
    return chosen


def _two_rows(x: torch.Tensor) -> torch.Tensor:
    return x[:2] if x.shape[0] >= 2 else torch.cat([x, x])[:2]


def sequence_of(inputs: tuple | None) -> bool:
    """Whether a model's inputs have a sequence dim 1: token ids (B, S), or (B, S, H) and wider; default yes."""
    first = next((a for a in inputs or () if isinstance(a, torch.Tensor)), None)
    if first is None:
        return inputs is None
    return first.dim() >= 3 or (first.dim() == 2 and not first.is_floating_point())


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    raise ValueError("parallelize(model, 'auto') plans for the job's world size, but no job is running "
                     "(no process group, no WORLD_SIZE); launch the script with torchrun or autopar.launch, "
                     "or call autopar.plan(model, devices=N, ...) and pass its best mesh")


def _optimizer_states(optimizer: Callable | None) -> str:
    if optimizer is None:
        return "sgd"
    from autopar.options import Options
    from autopar.program import optimizer_state_factor

    return {2: "adam", 1: "sgd-momentum", 0: "sgd"}[optimizer_state_factor(Options(optimizer=optimizer))]


def _local_cluster(devices: int) -> Cluster:
    """The preset nearest this job's machines: CPU ranks sharing this node's cores, or the local GPU model."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", devices))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return Cluster.preset("dgx-a100").replace(name=f"local {props.name}", memory=0.93 * props.total_memory,
                                                  devices_per_node=per_node)
    return Cluster.preset("cpu").replace(devices_per_node=per_node, cores=os.cpu_count() or 1)


# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n < 10_000 else \
        sorted({x for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0 for x in (d, n // d)})


def _powers_of_two(limit: int) -> list[int]:
    out, p = [], 1
    while p <= limit:
        out.append(p)
        p *= 2
    return out


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")


def _count(n: float) -> str:
    """1234567 -> "1.2M"; parameters, in the units people quote them."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f}{unit}" if n < 100 * scale else f"{n / scale:,.0f}{unit}"
    return f"{n:.0f}"


def _rate(flops: float) -> str:
    return f"{flops / 1e12:.1f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.1f} GFLOP/s"


def _seconds(t: float) -> str:
    return f"{t:.2f} s" if t >= 1 else f"{t * 1e3:.1f} ms" if t >= 1e-3 else f"{t * 1e6:.0f} us"


def gpt(layers: int, hidden: int, heads: int, *, vocab: int = 51200, positions: int = 2048) -> torch.nn.Module:
    """A GPT (Hugging Face GPT-2 architecture) of the given size on the meta device: no memory, for planning."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=positions,
                        use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    with torch.device("meta"):
        return GPT2LMHeadModel(config)


def gpt3_175b() -> torch.nn.Module:
    """GPT-3 175B (Brown et al. 2020): 96 layers, hidden 12288, 96 heads, 2048 positions, on the meta device."""
    return gpt(96, 12288, 96, vocab=50257)


__all__ = ["Candidate", "PlanResult", "plan", "search_space", "explain", "auto_choice", "sequence_of", "gpt",
           "gpt3_175b"]
