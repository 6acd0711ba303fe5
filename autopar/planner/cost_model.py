"""Memory per device and step time of one configuration, from a model's profile.

``CostModel(profile, cluster, precision, ...)`` turns a ``ModelProfile``
(``autopar/planner/model_profile.py``: the model's costs read from its own graph) into
memory per device and step time for one ``Config`` (mesh, ZeRO stage,
schedule, microbatches, recomputation), as numbers or, with ``symbolic=True``,
as sympy expressions in the microbatch size ``b``. The formulas are in
docs/planner.md; the pipeline bubble is in ``bubble.py``, the data-parallel
collectives in ``dp_comm.py``, memory in ``cost_memory.py``, the cp and ep axes in ``cost_axes.py``.
"""
from __future__ import annotations

import math
from typing import Any

import sympy

from autopar.core.schedules import make_schedule
from autopar.core.zero_bubble import v_placement
from autopar.passes.stage_cuts import balanced_cuts
from autopar.planner.comm_time import collective, p2p, ring_gather
from autopar.planner import recompute_cost
from autopar.planner.bubble import Bubbles
from autopar.planner.pipeline_transfers import Transfers
from autopar.planner.config import V_SHAPED, ZERO_BUBBLE, Config
from autopar.planner.core_sharing import Comm, Phase, makespan, step_programs
from autopar.planner.dp_comm import DataParallel, Exposure, reduce_scatters, shared_all_reduce
from autopar.planner.estimate import AxisLinks, Estimate, axis_links, largest_fitting
from autopar.planner.expr import largest, number
from autopar.planner.memory_formulas import (  # noqa: F401  (the planner's precision names, read from here too)
    OPTIMIZER_STATES, PRECISIONS, Precision, precision_of, state_bytes,
)
from autopar.planner.cost_axes import ContextExpertCosts
from autopar.planner.cost_memory import MemoryAccount
from autopar.planner.model_profile import ModelProfile, Segment, b_sym, s_sym
from autopar.planner.segment_values import SegmentValues, state_elements
from autopar.planner.submodule_fetch import SubmoduleFetch


class CostModel(MemoryAccount, ContextExpertCosts):
    """Evaluates ``Config``s for one profile, cluster, precision, optimizer and sequence length."""

    def __init__(self, profile: ModelProfile, cluster: Any, precision: Precision, *, seq_len: int = 1,
                 optimizer_states: int = 2, bucket_bytes: int = 25 * 2**20, overlap_grad_sync: bool = True,
                 scatter_gather: bool = False, recompute_collectives: bool = False,
                 recompute_gathers: bool = False, zero3_fetch: SubmoduleFetch | None = None,
                 expert_imbalance: float = 1.0) -> None:
        if expert_imbalance < 1:
            raise ValueError(f"expert_imbalance={expert_imbalance} is the busiest rank's routed rows over the mean; "
                             "it is at least 1 (1: balanced routing)")
        self.profile = profile
        self.experts = profile.experts  # routed experts (``expert_cost.py``): their FLOPs, memory and all-to-alls by ep
        self.imbalance = expert_imbalance
        self.cluster = cluster
        self.precision = precision
        self.seq_len = seq_len if profile.has_sequence else 1
        self.states = optimizer_states
        self.bucket_bytes = bucket_bytes
        self.scatter_gather = scatter_gather  # pipeline hops send 1/tp per rank, then all-gather (Megatron-LM)
        self.recompute_collectives = recompute_collectives  # full recomputation re-runs tp all-reduces (Megatron-LM)
        # dp gradient reduction overlaps backward (DDP, autopar) or follows it (Megatron-LM in 2021)
        # full recomputation gathers ZeRO-3's parameters again for backward (DeepSpeed) or keeps them (autopar, FSDP2);
        # ZeRO-3 gathers per layer, prefetching (autopar, FSDP2), or per submodule as DeepSpeed's 2021 coordinator
        self.data_parallel = DataParallel(precision, bucket_bytes, overlap_grad_sync, cluster.contention,
                                          recompute_gathers, zero3_fetch)
        self.bubbles = Bubbles()
        self.transfers = Transfers(self.bubbles)
        self._values: dict[tuple, SegmentValues] = {}
        self._cuts: dict[tuple, list[list[int]]] = {}
        self._comm: dict[int, tuple[Any, Any]] = {}  # id of a SegmentValues -> its tp seconds, forward and backward
        self._sample_flops: float | None = None
        # what many configurations share (the search's ZeRO stages, schedules of one placement, dp sizes): the
        # segments of each pp rank per (tp, pp, stages per rank, V or looped, b, sequence parallel), and numbers
        # per stage or rank of those lists, keyed by the lists' ids (they live in ``_ranks`` as long as this model)
        self._ranks: dict[tuple, list[list[list[SegmentValues]]]] = {}
        self._per_stage: dict[tuple, Any] = {}
        self._per_rank: dict[tuple, Any] = {}

    # per segment ------------------------------------------------------------
    def values(self, seg: Segment, tp: int, b: Any, sequence_parallel: bool = False) -> SegmentValues:
        key = (id(seg), tp, b, sequence_parallel)
        if key not in self._values:
            part = self.profile.part(seg, tp, sequence_parallel)
            at = {b_sym: b, s_sym: self.seq_len}
            act_bytes = self.precision.activation
            attention = part.attention_fused if self.cluster.fused_attention else part.attention
            ev = (lambda e: float(e.xreplace(at))) if not isinstance(b, sympy.Basic) else (lambda e: e.xreplace(at))
            self._values[key] = SegmentValues(
                flops=ev(part.flops + self.cluster.narrow * part.narrow),
                traffic=ev(part.traffic * act_bytes),
                activations=ev((part.saved + attention) * act_bytes + part.saved_other),
                entering=ev((seg.entering if part.entering is None else part.entering) * act_bytes),
                entering_head=ev(seg.entering_head * act_bytes),
                kept_selective=ev(part.kept_selective * act_bytes), communicated=ev(part.communicated * act_bytes),
                collectives=tuple((c.op, c.direction, ev(c.elements * act_bytes)) for c in part.collectives),
                ops=part.ops, params=part.params, trainable=frozenset(part.trainable), kind=seg.kind,
                owner=seg.name.removesuffix(".*") + ".", deferred=part.deferred,
                ring_kv=ev(part.ring_kv * act_bytes), attention_flops=ev(part.attention_flops))
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
        if config.schedule in V_SHAPED:
            return v_placement(config.pp)
        return tuple(s % config.pp for s in range(config.pp * config.stages_per_rank))

    # the estimate ---------------------------------------------------------------
    def estimate(self, config: Config, *, symbolic: bool = False, timed: bool = True) -> Estimate:
        """Memory per device and step time of ``config``; with ``symbolic``, sympy in the microbatch size ``b``;
        without ``timed``, its memory only (``Estimate.time`` is None)."""
        if config.tp not in self.profile.tp_sizes:
            raise ValueError(f"tp={config.tp} was not analyzed for this model (analyzed: "
                             f"{list(self.profile.tp_sizes)}); pass tp_sizes=... to profile_model")
        ranks = self._rank_units(config, b_sym if symbolic else config.microbatch_size)
        alike: dict[tuple, tuple[int, dict[str, Any]]] = {}  # ranks of alike stages holding as many microbatches:
        memories = []  # one memory, and the first such rank
        for r, units in enumerate(ranks):
            key = (id(units), self._in_flight(config, r))
            if key not in alike:
                alike[key] = (r, self._memory(config, units, r))
            memories.append(alike[key][1])
        worst = max(alike.values(), key=lambda x: number(sum(x[1].values())))[0]  # the first of the most
        if self._sample_flops is None:  # the model's forward FLOPs per sample
            self._sample_flops = sum(float(self.profile.part(seg, 1).flops.xreplace({b_sym: 1, s_sym: self.seq_len}))
                                     for seg in self.profile.sequence())
        time, links = self._time(config, ranks) if timed else (None, {})
        return Estimate(config=config, memory=memories[worst], time=time, worst_rank=worst,
                        per_rank=memories, stages=self._stage_names(config),
                        model_flops=3 * self._sample_flops * config.global_batch, seq_len=self.seq_len, links=links)

    def _rank_units(self, config: Config, b: Any) -> list[list[list[SegmentValues]]]:
        """The segments of each stage of each pp rank, in pipeline order, at microbatch size ``b`` (shared: not
        to be changed)."""
        key = (config.tp, config.pp, config.stages_per_rank, config.schedule in V_SHAPED, b, config.sequence_parallel,
               config.ep, config.cp)
        if key not in self._ranks:
            seq, stages, placement = self.profile.sequence(), self.stages(config), self.placement(config)
            units = [self._intern([self._sharded(self._routed(self.values(seq[i], config.tp, b,
                                                                          config.sequence_parallel), config.ep, b),
                                                 config.cp) for i in st])
                     for st in stages]
            self._ranks[key] = [self._intern([units[s] for s in range(len(stages)) if placement[s] == r])
                                for r in range(config.pp)]
        return self._ranks[key]

    def _intern(self, items: list) -> list:
        """One list object for each content (of interned or cached objects): the ranks of a pipeline that hold
        alike stages share their numbers below (``_per_stage``, ``_per_rank``)."""
        return self._per_stage.setdefault(("list", *map(id, items)), items)

    def _stage_names(self, config: Config) -> list[list[str]]:
        """The segment names of each pipeline stage of ``config`` (shared: not to be changed)."""
        key = ("names", config.pp * config.stages_per_rank, config.tp)
        if key not in self._per_stage:
            seq = self.profile.sequence()
            self._per_stage[key] = [[seq[i].name for i in st] for st in self.stages(config)]
        return self._per_stage[key]

    def _state_elements(self, stages: list[list[SegmentValues]]) -> tuple[int, int]:
        """``state_elements`` of a rank's stages (a list from ``_rank_units``)."""
        key = ("state", id(stages))
        if key not in self._per_rank:
            self._per_rank[key] = state_elements([u for st in stages for u in st])
        return self._per_rank[key]

    def fits(self, config: Config, memory: float) -> bool:
        """Whether every rank of ``config`` needs at most ``memory`` bytes (its memory alone, no step time)."""
        return float(self.estimate(config, timed=False).total_memory) <= memory

    def layers_per_stage(self, config: Config) -> list[int]:
        """How many layers (entries of module lists) each pipeline stage of ``config`` holds."""
        seq = self.profile.sequence()
        return [sum(seq[i].kind == "layer" for i in st) for st in self.stages(config)]

    def zero3_reduce_scatters(self, config: Config, *, split: bool | None = None) -> list[tuple[int, float]]:
        """(calls, bytes) of the ZeRO-3 gradient reduce-scatters of one step on a rank of each pp index
        (``dp_comm.reduce_scatters``: a split backward repeats them per weight matmul); ``split`` overrides
        whether the schedule splits backwards."""
        split = config.schedule in ZERO_BUBBLE and config.pp > 1 if split is None else split
        out = []
        for stages in self._rank_units(config, config.microbatch_size):
            calls, elements = reduce_scatters([u for st in stages for u in st], config.zero_ranks, split)
            out.append((config.microbatches * calls, float(config.microbatches * elements * self.precision.grad)))
        return out

    def recompute_choice(self, config: Config) -> str | dict[str, str]:
        """``config``'s recomputation as ``parallelize(recompute=...)`` takes it: its mode, or for a mix the
        layers each stage recomputes fully, by name, and ``"*"`` for the others."""
        if not config.full_layers:
            return config.recompute
        key = ("layer names",)
        if key not in self._per_stage:
            self._per_stage[key] = self.profile.layer_names()
        names = self._per_stage[key]
        full = [names[i] for st in self.stages(config)
                for i in [i for i in st if names[i] is not None][: config.full_layers]]
        return {**dict.fromkeys(full, "full"), "*": config.recompute}

    def step_time_bound(self, config: Config, simulated: bool = True) -> float:
        """A lower bound of ``estimate(config).step_time`` that costs a fraction of it: the step with a lower
        bound of the zero-bubble schedules' simulated bubble (``Bubbles.least_idle``) and none of the pipeline's
        simulated transfers (``_pipeline_p2p``); without ``simulated``, none of the dp collectives' simulated
        exposure either (a looser bound, a fraction of that one's cost); 0 where ranks share cores (there the
        simulated step can be shorter than its parts)."""
        if self.cluster.cores:
            return 0.0
        ranks = self._rank_units(config, config.microbatch_size)
        return float(sum(self._time(config, ranks, bound=True, simulated=simulated)[0].values()))

    def _time(self, c: Config, ranks: list[list[list[SegmentValues]]], bound: bool = False,
              simulated: bool = True) -> tuple[dict[str, Any], dict[str, AxisLinks]]:
        """The step's parts, and each axis's links (numeric only); ``bound``: a simulated bubble's lower bound
        instead, and without ``simulated`` no dp exposure (``step_time_bound``)."""
        cl = self.cluster
        step_bytes = self.precision.step_bytes(self.states) / cl.memory_bandwidth
        trainable = [self._state_elements(stages)[1] for stages in ranks]
        optimizer = [t * step_bytes / (c.zero_ranks if c.zero else 1) for t in trainable]
        # a gradient added into an existing one reads two and writes one: every microbatch after the first
        # (stages 0-1); stage 1's first too, since its gradients are views of the flat buffer it reduces
        adds = c.microbatches - 1 + (c.zero == 1) if c.zero < 2 else 0
        accumulate = [3 * adds * t * self.precision.grad / cl.memory_bandwidth for t in trainable]
        numeric = not isinstance(ranks[0][0][0].flops, sympy.Basic)  # every segment is at one b
        shared = bool(cl.cores) and numeric
        links = [cl.link(c.tp), cl.link(c.tp * c.pp), self._whole_link(c)]
        per_rank = [self._rank_seconds(c, stages, *links[:2]) for stages in ranks]
        compute, tp, p2p_t, forward, backward, redo = max(per_rank, key=lambda t: number(t[0] + t[1] + t[2]))
        m = c.microbatches
        sync = self._pipeline_sync(c, ranks, links[1])
        shard, streams = self._dp_links(c)
        serial, dp = self.data_parallel.time(
            c, ranks, lambda stages: [t for st in stages for t in self._unit_seconds(c, st, links[0])],
            (shard, links[2]), streams, max(trainable), (c.recompute, c.full_layers, id(links[0])), simulated)
        out = {
            "compute": m * compute + max(accumulate),
            "tensor_parallel": m * tp,
            "pipeline_p2p": self._pipeline_p2p(c, compute, tp, p2p_t, forward, backward, redo, bound) + sync,
            "expert_parallel": m * largest([self._all_to_all_seconds(c, stages) for stages in ranks]),
            "context_parallel": m * largest([self._ring_seconds(c, stages) for stages in ranks]),
            "bubble": self._bubble(c, compute, tp, p2p_t, forward, backward, redo, bound),
            "shared_cores": 0,
            "data_parallel": serial + dp.exposed,
            "contention": dp.contention,
            "optimizer": max(optimizer),
        }
        if shared and not bound:
            self._simulate_shared_cores(c, ranks, optimizer, accumulate, sync, out)
        elif cl.cores:  # symbolic in b: the node's total work over its cores bounds the step from below
            nodes = math.ceil(c.devices / cl.devices_per_node)
            work = sum(m * t[0] + a + o for t, a, o in zip(per_rank, accumulate, optimizer)) * c.dp_cp * c.tp / (
                cl.cores * nodes)
            out["shared_cores"] = largest([work - sum(out.values()) + out["data_parallel"], 0])
        axes = axis_links(c, cl, out, serial, dp, m * p2p_t + sync) if numeric else {}
        return out, axes

    def step_program(self, config: Config, rank: int = 0, microbatches: int | None = None) -> list:
        """The events pp rank ``rank`` issues in a step of ``config`` (``step_program.py``), every microbatch of
        it (or ``microbatches``): what ``estimate`` simulates, for reading and tests."""
        return self.data_parallel.program(config, *self._rank_inputs(config, rank), microbatches)

    def dp_exposure(self, config: Config, rank: int = 0) -> Exposure:
        """What ``estimate`` charges pp rank ``rank`` for its dp collectives beyond those that never overlap."""
        stages, units, link, streams = self._rank_inputs(config, rank)
        return self.data_parallel.exposure(config, stages, lambda _: units, link, streams,
                                           (config.recompute, config.full_layers, id(self.cluster.link(config.tp))))

    def _rank_inputs(self, config: Config, rank: int) -> tuple:
        ranks = self._rank_units(config, config.microbatch_size)
        tp_link = self.cluster.link(config.tp)
        units = [t for st in ranks[rank] for t in self._unit_seconds(config, st, tp_link)]
        shard, streams = self._dp_links(config)
        return ranks[rank], units, (shard, self._whole_link(config)), streams

    def _dp_links(self, c: Config) -> tuple[Any, tuple[str, ...]]:
        """The link ZeRO's (or DDP's) collectives run on (a shard group spreads over ``zero_ranks * pp * tp``
        consecutive ranks: inside a node where that fits), and the names of that link, the tp link and the link of
        all of dp (hybrid sharding's all-reduce across replicas)."""
        span = c.zero_ranks * c.pp * c.tp
        return self.cluster.link(span, c.zero_ranks), (self._stream(span), self._stream(c.tp), self._stream(c.devices))

    def _whole_link(self, c: Config) -> Any:
        """The link of all of dp: the loss's all-reduce, and hybrid sharding's across replicas (a group of
        ``replicas`` ranks a shard group apart)."""
        return self.cluster.link(c.devices, c.replicas if c.replicas > 1 else c.dp_cp)

    def _stream(self, span: int) -> str:
        """The link a group of ranks spread over ``span`` consecutive ranks runs on: inside a node, or between."""
        return "intra" if span <= self.cluster.devices_per_node else "inter"

    def _unit_seconds(self, c: Config, st: list[SegmentValues], tp_link: Any) -> list[tuple[Any, ...]]:
        """Each unit of a stage: forward and backward compute (with what recomputation redoes), tp forward and
        backward seconds, and the recomputed seconds, per microbatch (summed: ``_stage``'s)."""
        key = ("units", id(st), c.recompute, c.full_layers, c.tp, c.sequence_parallel, id(tp_link))
        if key not in self._per_stage:
            cl = self.cluster
            modes = c.layer_modes(st)
            out = []
            for mode, u in zip(modes, st):
                matmul = u.flops / (cl.peak(self.precision.name) * cl.efficiency)
                other = u.traffic / cl.memory_bandwidth + u.ops * cl.op_overhead
                forward, backward = self._tp_seconds(u, c.tp, tp_link)
                f = matmul + other
                redo = recompute_cost.redo(mode, u, matmul, other)
                again = self.recompute_collectives and mode == "full"  # Megatron's full recomputation only
                out.append((f, 2 * f + redo, forward, backward + (forward if again else 0), redo))
            self._per_stage[key] = out
        return self._per_stage[key]

    def _bubble(self, c: Config, compute: Any, tp: Any, p2p_t: Any, forward: Any, backward: Any, redo: Any,
                bound: bool = False) -> Any:
        """Idle time of the busiest rank, from its per-microbatch parts (``_stage``, summed over its stages):
        (p - 1) / v microbatches, or a zero-bubble schedule's simulated wait (``bubble.Bubbles``), whose ``W``
        is a forward's compute (and whose ``F``, ``B`` each carry one pipeline hop under Megatron's blocking
        hops, ``scatter_gather``; autopar's are ``_pipeline_p2p``'s); ``bound``: for those, a lower bound
        that needs no simulation (``Bubbles.least_idle``)."""
        hop = p2p_t if self.scatter_gather else 0  # autopar's hops are simulated apart (``_pipeline_p2p``)
        per_microbatch = compute + tp + hop
        if c.schedule not in ZERO_BUBBLE or c.pp == 1:
            return (c.pp - 1) / c.stages_per_rank * per_microbatch
        weight = (compute - redo) / 3
        phases = (forward + hop / 2, backward - weight + hop / 2, weight)
        costs = tuple(number(x, c.microbatch_size) for x in phases)
        idle = self.bubbles.least_idle(c.pp, costs) if bound else self.bubbles.idle(c.schedule, c.pp, c.microbatches,
                                                                                   costs)
        return idle / c.stages_per_rank * per_microbatch

    def _pipeline_p2p(self, c: Config, compute: Any, tp: Any, p2p_t: Any, forward: Any, backward: Any,
                      redo: Any, bound: bool = False) -> Any:
        """What the step shows of the pipeline's transfers (``p2p_t``: the busiest rank's two hops per stage):
        under Megatron's blocking send/recv pairs (``scatter_gather``) every hop of every microbatch; under
        autopar's ``isend`` what the simulated schedule exposes (``Transfers.seconds``); ``bound``: 0, a lower
        bound of that without simulating."""
        if self.scatter_gather or c.pp == 1:
            return c.microbatches * p2p_t
        return 0 if bound else self.transfers.seconds(c, compute, tp, p2p_t, forward, backward, redo)

    def _rank_seconds(self, c: Config, stages: list[list[SegmentValues]], tp_link: Any, pp_link: Any) -> list[Any]:
        """A rank's ``_stage`` seconds summed over its stages."""
        key = ("time", id(stages), c.recompute, c.full_layers, c.pp > 1, c.tp, c.sequence_parallel, id(tp_link),
               id(pp_link))
        if key not in self._per_rank:
            self._per_rank[key] = [sum(x) for x in zip(*(self._stage(c, st, tp_link, pp_link) for st in stages))]
        return self._per_rank[key]

    def _stage(self, c: Config, st: list[SegmentValues], tp_link: Any, pp_link: Any) -> tuple[Any, ...]:
        """One microbatch of one stage: compute, tp, pipeline, forward, backward and recomputed seconds."""
        key = ("time", id(st), c.recompute, c.full_layers, c.pp > 1, c.tp, c.sequence_parallel, id(tp_link),
               id(pp_link))
        if key not in self._per_stage:
            self._per_stage[key] = self._stage_seconds(c, st, tp_link, pp_link)
        return self._per_stage[key]

    def _stage_seconds(self, c: Config, st: list[SegmentValues], tp_link: Any, pp_link: Any) -> tuple[Any, ...]:
        f, b, tp_forward, tp_backward, redo = (sum(x) for x in zip(*self._unit_seconds(c, st, tp_link)))
        hops = 2 * self._hop(c, st, tp_link, pp_link.p2p()) if c.pp > 1 else 0
        return (f + b, tp_forward + tp_backward, hops, f + tp_forward, b + tp_backward, redo)

    def _tp_seconds(self, u: SegmentValues, tp: int, link: Any) -> tuple[Any, Any]:
        """Seconds of segment ``u``'s tp collectives in forward and in backward (``u`` is made for one tp size)."""
        if id(u) not in self._comm:
            self._comm[id(u)] = tuple(sum(collective(op, nbytes, tp, link) for op, d, nbytes in u.collectives
                                          if d == direction) for direction in ("forward", "backward"))
        return self._comm[id(u)]

    def _hop(self, c: Config, st: list[SegmentValues], tp_link: Any, pp_link: Any) -> Any:
        """A stage's input arriving: whole from every tp rank, or Megatron's 1/tp then an all-gather (sequence
        parallel: each tp rank's shard, ``entering`` already)."""
        if not self.scatter_gather or c.sequence_parallel:
            return p2p(st[0].entering, pp_link)
        return p2p(st[0].entering / c.tp, pp_link) + ring_gather(st[0].entering, c.tp, tp_link)

    def _simulate_shared_cores(self, c: Config, ranks: list[list[list[SegmentValues]]], optimizer: list[float],
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
        after = out["data_parallel"] + out["contention"] + sync
        tails = [[Phase(a, Comm(after, after)), Phase(o)] for a, o in zip(accumulate, optimizer)]
        schedule = make_schedule(c.schedule, c.pp, c.microbatches, c.stages_per_rank) if c.pp > 1 else None
        programs = step_programs(schedule, forward, backward, hops, hops[1:] + [Comm()], tails, c.microbatches,
                                 weight)
        nodes = math.ceil(c.devices / cl.devices_per_node)
        alone = makespan(programs, replicas=c.dp_cp * c.tp)
        on_cores = makespan(programs, replicas=c.dp_cp * c.tp, cores=cl.cores * nodes)
        own = out["compute"] + out["tensor_parallel"] + out["data_parallel"] + out["contention"] + out["optimizer"] \
            + sync
        out["pipeline_p2p"] = min(out["pipeline_p2p"] - sync, max(alone - own, 0.0)) + sync
        out["bubble"] = max(alone - own - out["pipeline_p2p"] + sync, 0.0)  # rounding can leave -1e-18
        out["shared_cores"] = on_cores - alone

    def _pipeline_sync(self, c: Config, ranks: list[list[list[SegmentValues]]], link: Any) -> Any:
        """Seconds of a pipeline's once-per-step collectives.

        The loss broadcast from the last stage's rank, and the all-reduce of
        the gradient of each parameter that stages on several ranks use (tied
        embeddings) among its holders.
        """
        if c.pp == 1:
            return 0
        key = ("sync", id(ranks), id(link))
        if key not in self._per_rank:
            self._per_rank[key] = shared_all_reduce(ranks, link, self.precision.grad)
        return (c.pp - 1) * link.p2p().latency + self._per_rank[key]

    def max_microbatch_size(self, config: Config, memory: float) -> int:
        """The largest microbatch size whose estimate fits ``memory`` bytes per device (0 when none does)."""
        return largest_fitting(self.estimate(config, symbolic=True).total_memory, memory)


def _balanced(weights: list[float], starts: list[int], n: int) -> list[list[int]]:
    """The indices of each of ``n`` stages, cut at positions in ``starts`` balancing ``weights`` (FLOPs):
    ``passes.stage_cuts``'s policy, on segments."""
    bounds = [0, *balanced_cuts(weights, starts, n), len(weights)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(n)]
