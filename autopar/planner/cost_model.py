"""Memory per device and step time of one configuration, from a model's profile.

``CostModel(profile, cluster, precision, ...)`` turns a ``ModelProfile``
(``autopar/planner/model_profile.py``: the model's costs read from its own graph) into
memory per device and step time for one ``Config`` (mesh, ZeRO stage,
schedule, microbatches, recomputation), as numbers or, with ``symbolic=True``,
as sympy expressions in the microbatch size ``b``. The formulas are in
docs/planner.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import sympy

from autopar.core.buckets import bucket_sizes
from autopar.core.schedule import make_schedule
from autopar.core.zero_bubble import v_placement
from autopar.passes.pipeline import balanced_cuts
from autopar.planner.comm_time import collective, p2p, ring_all_reduce, ring_gather, ring_scatter
from autopar.planner import recompute_cost
from autopar.planner.core_sharing import Comm, Phase, makespan, step_programs
from autopar.planner.memory_formulas import (  # noqa: F401  (the planner's precision names, read from here too)
    OPTIMIZER_STATES, PRECISIONS, Precision, precision_of, state_bytes,
)
from autopar.planner.model_profile import ModelProfile, Segment, b_sym, s_sym

# ---------------------------------------------------------------------------
# memory and time of one configuration
# ---------------------------------------------------------------------------

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")
ZERO_BUBBLE = ("zb-h1", "zbv")  # backwards split into B and W (bubble: `zero_bubble_units`)
RECOMPUTE = ("none", "selective", "full")  # autopar.core.recompute.MODES


@dataclass(frozen=True)
class Config:
    """One way to run a training step: the mesh, ZeRO stage, schedule, microbatches and recomputation."""

    dp: int
    pp: int = 1
    tp: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    microbatches: int = 1
    microbatch_size: int = 1
    recompute: str | bool = "none"  # "none" | "selective" | "full" (True: "full", False: "none")
    zero_prefetch: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "stages_per_rank", "microbatches", "microbatch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero={self.zero} must be 0, 1, 2 or 3")
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(f"unknown schedule {self.schedule!r}; the schedules are {', '.join(SCHEDULE_NAMES)}")
        if self.schedule == "zbv" and self.stages_per_rank != 2:
            raise ValueError(f"schedule='zbv' holds 2 stages per rank, got stages_per_rank={self.stages_per_rank}")
        if self.stages_per_rank > 1 and self.schedule not in ("interleaved-1f1b", "zbv"):
            raise ValueError(f"stages_per_rank={self.stages_per_rank} needs schedule='interleaved-1f1b'")
        object.__setattr__(self, "recompute", {True: "full", False: "none"}.get(self.recompute, self.recompute))
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r} must be one of {', '.join(RECOMPUTE)}")

    @property
    def devices(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def global_batch(self) -> int:
        return self.dp * self.microbatches * self.microbatch_size

    def describe(self) -> str:
        mesh = f"dp={self.dp} pp={self.pp} tp={self.tp}"
        v = f"/v={self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        sched = "" if self.pp == 1 else f" {self.schedule}{v}"
        return (f"{mesh} zero={self.zero}{sched} m={self.microbatches}x{self.microbatch_size}"
                + ("" if self.recompute == "none" else f" recompute={self.recompute}"))


@dataclass
class Estimate:
    """Memory per device (worst rank, bytes) and step time (seconds) of a ``Config``; sympy when symbolic."""

    config: Config
    memory: dict[str, Any]  # parameters, gradients, optimizer, activations, buffers
    time: dict[str, Any]  # compute, tensor_parallel, pipeline_p2p, bubble, shared_cores, data_parallel, optimizer
    worst_rank: int  # the pp index whose memory is largest
    per_rank: list[dict[str, Any]]  # memory of every pp index (dp and tp ranks of one pp index are alike)
    stages: list[list[str]]  # segment names of each pipeline stage
    model_flops: float  # FLOPs of one step of the model itself (3 x forward), not counting recomputation
    seq_len: int

    @property
    def total_memory(self) -> Any:
        return sum(self.memory.values())

    @property
    def step_time(self) -> Any:
        return sum(self.time.values())

    @property
    def tokens_per_s(self) -> float:
        return self.config.global_batch * self.seq_len / self.step_time

    @property
    def flops_per_device(self) -> float:
        """Model FLOP/s per device (what MFU compares with the peak)."""
        return self.model_flops / self.step_time / self.config.devices


@dataclass(frozen=True)
class _Values:
    """A segment's numbers at one (tp, b, s): floats, or sympy expressions in ``b``."""

    flops: Any  # forward, counting a matmul of narrower weight dim w as (1 + cluster.narrow / w) times its FLOPs
    traffic: Any  # forward bytes read and written by memory-bound operators
    activations: Any  # bytes saved for backward per microbatch
    entering: Any  # bytes received per microbatch
    entering_head: Any  # the part of ``entering`` the head made (read by every layer, one tensor)
    kept_selective: Any  # bytes of matmul and attention outputs (kept by selective recomputation)
    communicated: Any  # bytes of tp collectives' forward outputs (kept by recomputation)
    collectives: tuple[tuple[str, str, Any], ...]  # (op, direction, bytes)
    ops: int
    params: dict[str, int]
    trainable: frozenset[str]
    kind: str
    owner: str  # a layer's module path and a dot: the parameters under it are the layer's own

    def shared(self) -> dict[str, int]:
        """Parameters stored once per rank: the head's, the tail's, those a layer uses but does not own (T5's)."""
        return self.params if self.kind != "layer" else {
            k: e for k, e in self.params.items() if not k.startswith(self.owner)}


class CostModel:
    """Evaluates ``Config``s for one profile, cluster, precision, optimizer and sequence length."""

    def __init__(self, profile: ModelProfile, cluster: Any, precision: Precision, *, seq_len: int = 1,
                 optimizer_states: int = 2, bucket_bytes: int = 25 * 2**20, overlap_grad_sync: bool = True,
                 scatter_gather: bool = False, recompute_collectives: bool = False) -> None:
        self.profile = profile
        self.cluster = cluster
        self.precision = precision
        self.seq_len = seq_len if profile.has_sequence else 1
        self.states = optimizer_states
        self.bucket_bytes = bucket_bytes
        self.overlap = overlap_grad_sync  # dp gradient reduction overlaps backward (DDP, autopar) or follows it
        self.scatter_gather = scatter_gather  # pipeline hops send 1/tp per rank, then all-gather (Megatron-LM)
        self.recompute_collectives = recompute_collectives  # full recomputation re-runs tp all-reduces (Megatron-LM)
        self._values: dict[tuple, _Values] = {}
        self._cuts: dict[tuple, list[list[int]]] = {}

    # per segment ------------------------------------------------------------
    def values(self, seg: Segment, tp: int, b: Any) -> _Values:
        key = (id(seg), tp, b)
        if key not in self._values:
            part = self.profile.part(seg, tp)
            at = {b_sym: b, s_sym: self.seq_len}
            act_bytes = self.precision.activation
            attention = part.attention_fused if self.cluster.fused_attention else part.attention
            ev = (lambda e: float(e.xreplace(at))) if not isinstance(b, sympy.Basic) else (lambda e: e.xreplace(at))
            self._values[key] = _Values(
                flops=ev(part.flops + self.cluster.narrow * part.narrow),
                traffic=ev(part.traffic * act_bytes),
                activations=ev((part.saved + attention) * act_bytes + part.saved_other),
                entering=ev(seg.entering * act_bytes), entering_head=ev(seg.entering_head * act_bytes),
                kept_selective=ev(part.kept_selective * act_bytes), communicated=ev(part.communicated * act_bytes),
                collectives=tuple((c.op, c.direction, ev(c.elements * act_bytes)) for c in part.collectives),
                ops=part.ops, params=part.params, trainable=frozenset(part.trainable), kind=seg.kind,
                owner=seg.name.removesuffix(".*") + ".")
        return self._values[key]

    def stages(self, config: Config) -> list[list[int]]:
        """Indices into ``profile.sequence()`` of each pipeline stage; cuts only before layers, FLOPs balanced."""
        n = config.pp * config.stages_per_rank
        key = (n, config.tp)
        if key not in self._cuts:
            seq = self.profile.sequence()
            weights = [float(self.values(seg, config.tp, 1).flops) for seg in seq]
            starts = [i for i, seg in enumerate(seq) if seg.kind == "layer"]
            if n - 1 > len(starts):
                raise ValueError(f"{n} pipeline stages need {n - 1} cuts between layers, but the model has "
                                 f"{len(starts)} layers; use pp * stages_per_rank <= {len(starts)}")
            self._cuts[key] = _balanced(weights, starts, n)
        return self._cuts[key]

    def placement(self, config: Config) -> tuple[int, ...]:
        """The pp rank of every stage: looped, or the V of ``zbv``."""
        if config.schedule == "zbv":
            return v_placement(config.pp)
        return tuple(s % config.pp for s in range(config.pp * config.stages_per_rank))

    # the estimate ---------------------------------------------------------------
    def estimate(self, config: Config, *, symbolic: bool = False) -> Estimate:
        """Memory per device and step time of ``config``; with ``symbolic``, sympy in the microbatch size ``b``."""
        if config.tp not in self.profile.tp_sizes:
            raise ValueError(f"tp={config.tp} was not analyzed for this model (analyzed: "
                             f"{list(self.profile.tp_sizes)}); pass tp_sizes=... to profile_model")
        b = b_sym if symbolic else config.microbatch_size
        seq = self.profile.sequence()
        stages = self.stages(config)
        placement = self.placement(config)
        ranks = [[s for s in range(len(stages)) if placement[s] == r] for r in range(config.pp)]
        memories = [self._memory(config, [[self.values(seq[i], config.tp, b) for i in stages[s]] for s in mine], r)
                    for r, mine in enumerate(ranks)]
        worst = max(range(config.pp), key=lambda r: _number(sum(memories[r].values())))
        times = self._time(config, [[[self.values(seq[i], config.tp, b) for i in stages[s]] for s in mine]
                                    for mine in ranks])
        forward = sum(float(self.profile.part(seg, 1).flops.xreplace({b_sym: 1, s_sym: self.seq_len}))
                      for seg in seq) * config.global_batch
        return Estimate(config=config, memory=memories[worst], time=times, worst_rank=worst, per_rank=memories,
                        stages=[[seq[i].name for i in st] for st in stages], model_flops=3 * float(forward),
                        seq_len=self.seq_len)

    def _memory(self, c: Config, stages: list[list[_Values]], rank: int) -> dict[str, Any]:
        total, trainable = _state_elements([u for st in stages for u in st])
        return {**state_bytes(total, trainable, self.precision, self.states, zero=c.zero, dp=c.dp),
                "activations": self._activations(c, stages, rank),
                "buffers": self._buffers(c, stages, trainable)}

    def _activations(self, c: Config, stages: list[list[_Values]], rank: int) -> Any:
        """Activation bytes on pp rank ``rank``: kept per stage (``recompute_cost``) x microbatches in flight."""
        again = self.recompute_collectives
        def copies(st: list[_Values]) -> Any:  # bf16 weight copies autograd saves (ZeRO-3 re-gathers its own)
            keep = c.recompute == "none" and c.zero < 3
            return self.precision.copy * sum(sum(u.params.values()) for u in st) if keep else 0

        per_stage = [recompute_cost.kept(c.recompute, st, recompute_collectives=again) + copies(st) for st in stages]
        if c.pp == 1:
            held = per_stage[0]  # microbatches run one after another (gradient accumulation)
        elif c.schedule == "gpipe":
            held = sum(per_stage) * c.microbatches
        elif c.schedule in ZERO_BUBBLE:  # every rank holds up to p microbatches (a W keeps its activations)
            held = sum(per_stage) * min(c.pp, c.microbatches)
        elif c.stages_per_rank == 1:
            held = per_stage[0] * min(c.pp - rank, c.microbatches)
        else:  # interleaved: warm-up forwards of chunks, each a 1/v share of the rank's layers
            v = c.stages_per_rank
            chunks = min((c.pp - rank - 1) * 2 + (v - 1) * c.pp + 1, c.microbatches * v)
            held = sum(per_stage) / v * chunks
        return held + recompute_cost.rebuilt(c.recompute, [u for st in stages for u in st], recompute_collectives=again)

    def _buffers(self, c: Config, stages: list[list[_Values]], trainable: int) -> Any:
        p = self.precision
        out: Any = 0
        if c.zero == 3 and c.dp > 1:  # gathered layers: the one in use and those prefetched
            sizes = sorted((sum(u.params.values()) for st in stages for u in st), reverse=True)
            out += sum(sizes[: 1 + c.zero_prefetch]) * (p.gather or p.param)
        elif c.dp > 1:
            out += _min([self.bucket_bytes, trainable * p.grad])  # the gradient bucket being reduced
        if c.pp > 1:  # a received activation and a received gradient per stage
            out += sum(2 * st[0].entering for st in stages)
        return out

    def _time(self, c: Config, ranks: list[list[list[_Values]]]) -> dict[str, Any]:
        cl = self.cluster
        step_bytes = self.precision.step_bytes(self.states) / cl.memory_bandwidth
        trainable = [_state_elements([u for st in stages for u in st])[1] for stages in ranks]
        optimizer = [t * step_bytes / (c.dp if c.zero else 1) for t in trainable]
        # a gradient added into an existing one reads two and writes one: every microbatch after the first
        # (stages 0-1); stage 1's first too, since its gradients are views of the flat buffer it reduces
        adds = c.microbatches - 1 + (c.zero == 1) if c.zero < 2 else 0
        accumulate = [3 * adds * t * self.precision.grad / cl.memory_bandwidth for t in trainable]
        numeric = not any(isinstance(u.flops, sympy.Basic) for stages in ranks for st in stages for u in st)
        shared = bool(cl.cores) and numeric
        links = [cl.link(c.tp), cl.link(c.tp * c.pp), cl.link(c.devices)]
        per_rank = [[sum(x) for x in zip(*(self._stage(c, st, *links[:2]) for st in stages))] for stages in ranks]
        compute, tp, p2p_t, forward, backward, _ = max(per_rank, key=lambda t: _number(t[0] + t[1] + t[2]))
        per_microbatch = compute + tp + p2p_t
        m = c.microbatches
        sync = self._pipeline_sync(c, ranks, links[1])
        out = {
            "compute": m * compute + max(accumulate),
            "tensor_parallel": m * tp,
            "pipeline_p2p": m * p2p_t + sync,
            "bubble": self._bubble(c, per_microbatch),
            "shared_cores": 0,
            "data_parallel": self._data_parallel(c, ranks, forward, backward, links[2]),
            "optimizer": max(optimizer),
        }
        if shared:
            self._simulate_shared_cores(c, ranks, optimizer, accumulate, sync, out)
        elif cl.cores:  # symbolic in b: the node's total work over its cores bounds the step from below
            nodes = math.ceil(c.devices / cl.devices_per_node)
            work = sum(m * t[0] + a + o for t, a, o in zip(per_rank, accumulate, optimizer)) * c.dp * c.tp / (
                cl.cores * nodes)
            out["shared_cores"] = _max([work - sum(out.values()) + out["data_parallel"], 0])
        return out

    def _bubble(self, c: Config, per_microbatch: Any) -> Any:
        """Idle time of the busiest rank: (p - 1) / v microbatches, or a zero-bubble schedule's (`zero_bubble_units`)."""
        if c.schedule not in ZERO_BUBBLE or c.pp == 1:
            return (c.pp - 1) / c.stages_per_rank * per_microbatch
        return zero_bubble_units(c.schedule, c.pp, c.microbatches) / (3 * c.stages_per_rank) * per_microbatch

    def _stage(self, c: Config, st: list[_Values], tp_link: Any, pp_link: Any) -> tuple[Any, ...]:
        """One microbatch of one stage: compute, tp, pipeline, forward, backward and recomputed seconds."""
        cl = self.cluster
        matmul = [u.flops / (cl.peak(self.precision.name) * cl.efficiency) for u in st]
        other = [u.traffic / cl.memory_bandwidth + u.ops * cl.op_overhead for u in st]
        f = sum(matmul) + sum(other)
        redo = sum(recompute_cost.redo(c.recompute, u, a, b) for u, a, b in zip(st, matmul, other))
        comm = {d: sum(collective(op, nbytes, c.tp, tp_link) for u in st for op, dd, nbytes in u.collectives
                       if dd == d) for d in ("forward", "backward")}
        comm_again = comm["forward"] if c.recompute != "none" and self.recompute_collectives else 0
        hops = 2 * self._hop(c, st, tp_link, pp_link.p2p()) if c.pp > 1 else 0
        return (3 * f + redo, comm["forward"] + comm["backward"] + comm_again, hops, f + comm["forward"],
                2 * f + comm["backward"] + redo + comm_again, redo)

    def _hop(self, c: Config, st: list[_Values], tp_link: Any, pp_link: Any) -> Any:
        """A stage's input arriving: whole from every tp rank, or Megatron's 1/tp then an all-gather."""
        if not self.scatter_gather:
            return p2p(st[0].entering, pp_link)
        return p2p(st[0].entering / c.tp, pp_link) + ring_gather(st[0].entering, c.tp, tp_link)

    def _simulate_shared_cores(self, c: Config, ranks: list[list[list[_Values]]], optimizer: list[float],
                               accumulate: list[float], sync: float, out: dict[str, Any]) -> None:
        """Ranks sharing a node's cores: the step simulated (``core_sharing``), once with a core per rank.

        The run with a core per rank gives the bubble (what is left after the
        slowest rank's own parts); the run on the node's cores adds
        ``shared_cores``: ranks computing at ``cores / busy`` of their speed,
        and pipeline messages sent while every core is taken waiting as long
        as a collective's step instead of ``p2p_latency``.
        """
        cl = self.cluster
        tp_link, pp_link = cl.link(c.tp), cl.link(c.tp * c.pp)
        placement = self.placement(c)
        stages = [ranks[r][placement[:s].count(r)] for s, r in enumerate(placement)]  # in pipeline order
        hops = [Comm(self._hop(c, st, tp_link, pp_link), self._hop(c, st, tp_link, pp_link.p2p())) for st in stages]
        forward, backward, weight = [], [], []
        split = c.schedule in ZERO_BUBBLE  # B computes input gradients, W weight gradients (a forward's work)
        for st in stages:
            work, _, _, f_time, b_time, redo = self._stage(c, st, tp_link, pp_link)
            f = (work - redo) / 3  # a forward's work
            b = 2 * f + redo - (f if split else 0)
            forward.append(Phase(f, Comm(f_time - f, f_time - f)))
            backward.append(Phase(b, Comm(b_time - b - f * split, b_time - b - f * split)))
            weight.append(Phase(f))
        after = out["data_parallel"] + sync
        tails = [[Phase(a, Comm(after, after)), Phase(o)] for a, o in zip(accumulate, optimizer)]
        schedule = make_schedule(c.schedule, c.pp, c.microbatches, c.stages_per_rank) if c.pp > 1 else None
        programs = step_programs(schedule, forward, backward, hops, hops[1:] + [Comm()], tails, c.microbatches,
                                 weight)
        nodes = math.ceil(c.devices / cl.devices_per_node)
        alone = makespan(programs, replicas=c.dp * c.tp)
        on_cores = makespan(programs, replicas=c.dp * c.tp, cores=cl.cores * nodes)
        own = out["compute"] + out["tensor_parallel"] + out["data_parallel"] + out["optimizer"] + sync
        out["pipeline_p2p"] = min(out["pipeline_p2p"] - sync, max(alone - own, 0.0)) + sync
        out["bubble"] = max(alone - own - out["pipeline_p2p"] + sync, 0.0)  # rounding can leave -1e-18
        out["shared_cores"] = on_cores - alone

    def _data_parallel(self, c: Config, ranks: list[list[list[_Values]]], forward: Any, backward: Any,
                       link: Any) -> Any:
        """Exposed seconds of the dp collectives: DDP's all-reduce (zero=0) or ZeRO's, per step.

        Gradients travel in buckets (stages 0-2: ``autopar.core.buckets``, a small
        first bucket, then ``bucket_bytes`` each) or per layer (stage 3), each
        collective paying its latency. Up to ``cluster.overlap`` of it hides
        behind backward (stage 3's forward gathers behind forward); the last
        bucket, launched when backward ends, never hides.
        """
        if c.dp == 1:
            return 0
        p = self.precision
        elements, groups = max((_state_elements(units)[1], len(units))
                               for units in ([u for st in stages for u in st] for stages in ranks))
        grads, params = elements * p.grad, elements * p.param
        gathered = elements * (p.gather or p.param)  # what stage 3 gathers per layer
        sizes = bucket_sizes(grads, self.bucket_bytes)  # a small first bucket, as the runtime cuts them
        buckets, last = len(sizes), sizes[-1]
        hide = self.cluster.overlap if self.overlap else 0.0
        n, m = c.dp, c.microbatches

        def exposed(t: Any, window: Any, tail: Any) -> Any:
            return _max([t - hide * window, tail, (1 - hide) * t])

        loss = ring_all_reduce(8, n, link.p2p())  # the step's loss averaged over dp: one element, no payload
        if c.zero == 0:
            return loss + exposed(ring_all_reduce(grads, n, link, buckets), backward, ring_all_reduce(last, n, link))
        reduce = exposed(ring_scatter(grads, n, link, buckets), backward, ring_scatter(last, n, link))
        gather_params = ring_gather(params, n, link, buckets)  # updated shards after the optimizer step
        if c.zero == 1:
            return loss + reduce + gather_params
        if c.zero == 2:
            return loss + m * reduce + gather_params
        gather, scatter = ring_gather(gathered, n, link, groups), ring_scatter(grads, n, link, groups)
        first = ring_gather(gathered / groups, n, link)  # the first layer's gather has nothing to hide behind
        return loss + m * (exposed(gather, forward, first) + exposed(gather + scatter, backward, first))

    def _pipeline_sync(self, c: Config, ranks: list[list[list[_Values]]], link: Any) -> Any:
        """Seconds of a pipeline's once-per-step collectives.

        The loss broadcast from the last stage's rank, and the all-reduce of
        the gradient of each parameter that stages on several ranks use (tied
        embeddings) among its holders.
        """
        if c.pp == 1:
            return 0
        holders: dict[str, set[int]] = {}
        sizes: dict[str, int] = {}
        for r, stages in enumerate(ranks):
            for u in (u for st in stages for u in st):
                for name, numel in u.shared().items():
                    if name in u.trainable:
                        holders.setdefault(name, set()).add(r)
                        sizes[name] = numel
        shared = sum(ring_all_reduce(sizes[k] * self.precision.grad, len(h), link) for k, h in holders.items()
                     if len(h) > 1)
        return (c.pp - 1) * link.p2p().latency + shared

    def max_microbatch_size(self, config: Config, memory: float) -> int:
        """The largest microbatch size whose estimate fits ``memory`` bytes per device (0 when none does).

        Memory is linear in ``b`` unless a term saturates (a bucket, a max over
        layers): then it is solved exactly, else searched on the expression.
        """
        total = self.estimate(config, symbolic=True).total_memory
        try:
            poly = sympy.Poly(total, b_sym)
        except sympy.PolynomialError:
            poly = None
        if poly is not None and poly.degree() == 1:
            slope, const = (float(x) for x in poly.all_coeffs())
            return max(0, math.floor((memory - const) / slope)) if slope > 0 else 0
        lo, hi = 0, 1
        while _number(total.xreplace({b_sym: hi})) <= memory and hi < 2**20:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if _number(total.xreplace({b_sym: mid})) <= memory else (lo, mid)
        return lo


def _state_elements(units: list[_Values]) -> tuple[int, int]:
    """(parameter, trainable parameter) elements a rank stores for ``units``: every layer instance's own
    parameters, and once each the others (``_Values.shared``: a tied embedding is one tensor)."""
    total = trainable = 0
    shared: dict[str, tuple[int, bool]] = {}
    for u in units:
        common = u.shared()
        total += sum(e for k, e in u.params.items() if k not in common)
        trainable += sum(e for k, e in u.params.items() if k not in common and k in u.trainable)
        shared.update({k: (e, k in u.trainable) for k, e in common.items()})
    return total + sum(e for e, _ in shared.values()), trainable + sum(e for e, t in shared.values() if t)


def zero_bubble_units(schedule: str, pp: int, microbatches: int) -> int:
    """Idle steps of a rank when F, B and W of one stage take a step each: ZB-H1 idles ``p - 1`` (a third of
    1F1B's ``3(p - 1)``) once ``m >= p``, more below; ZBV ``p - 1`` steps of half-size stages. The simulator
    (``autopar.core.simulate``) measures the same for the generated schedules (tests/test_zero_bubble.py)."""
    if schedule == "zbv":
        return pp - 1
    return 2 * (pp - 1) - (min(microbatches, pp) - 1)


def _balanced(weights: list[float], starts: list[int], n: int) -> list[list[int]]:
    """The indices of each of ``n`` stages, cut at positions in ``starts`` balancing ``weights`` (FLOPs):
    ``passes.pipeline``'s policy, on segments."""
    bounds = [0, *balanced_cuts(weights, starts, n), len(weights)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(n)]


def _number(x: Any) -> float:
    """A float for ordering; a sympy expression is evaluated at b = 1."""
    return float(x.xreplace({b_sym: 1})) if isinstance(x, sympy.Basic) else float(x)


def _max(xs: list[Any]) -> Any:
    if any(isinstance(x, sympy.Basic) for x in xs):
        return sympy.Max(*xs)
    return max(xs)


def _min(xs: list[Any]) -> Any:
    if any(isinstance(x, sympy.Basic) for x in xs):
        return sympy.Min(*xs)
    return min(xs)
