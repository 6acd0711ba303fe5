"""The planner's search: every configuration of a device count, evaluated by the cost model and ranked.

``plan`` profiles the model (or takes a profile), walks ``search_space`` (dp x
pp x tp meshes, ZeRO stages, schedules, microbatch sizes, recomputation),
estimates each configuration with ``CostModel`` and sorts the candidates:
fitting ones first, then by step time. ``PlanResult`` holds them with the cost
model, so a configuration's memory and time can be asked again as sympy
expressions in the microbatch size.

Invariant: every candidate's numbers come from ``CostModel.estimate`` (its
memory when evaluated, its step time when first asked); nothing here
recomputes memory or time.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Iterator

import torch

from autopar.planner.bound import rank_key, timed_candidates
from autopar.planner.cluster import Cluster
from autopar.core.dualpipe import min_microbatches
from autopar.planner.config import MIXED_WITH, SCHEDULE_NAMES
from autopar.planner.context_cost import LONG_SEQUENCE, context_sizes
from autopar.planner.cost_model import OPTIMIZER_STATES, PRECISIONS, Config, CostModel, Precision
from autopar.planner.model_profile import ModelProfile, profile_model
from autopar.planner.report import explain
from autopar.planner.result import Candidate, PlanResult
from autopar.planner.runnable import not_runnable


def plan(
    model: torch.nn.Module,
    devices: int,
    *,
    cluster: Cluster | str = "dgx-a100",
    global_batch: int | None = None,
    seq_len: int | None = None,
    precision: str | Precision = "mixed",
    optimizer: str = "adam",
    example_inputs: tuple | None = None,
    example_kwargs: dict | None = None,
    zero: tuple[int, ...] = (0, 1, 2, 3),
    schedules: tuple[str, ...] = SCHEDULE_NAMES,
    recompute: tuple[str | bool, ...] = ("none", "selective", "full"),
    tp: tuple[int, ...] | None = None,
    pp: tuple[int, ...] | None = None,
    max_microbatch: int = 16,
    runnable_only: bool = False,
    overlap_grad_sync: bool = True,
    scatter_gather: bool = False,
    recompute_collectives: bool = False,
    hybrid: bool = True,
    expert_imbalance: float = 1.0,
    cp: tuple[int, ...] | None = None,
    profile: ModelProfile | None = None,
    top: int | None = 20,
    local_batch: int | None = None,
    compile: bool = False,
) -> PlanResult:
    """Ranked configurations for training ``model`` on ``devices`` devices of ``cluster``.

    ``model`` may live on the meta device. ``seq_len``: tokens per sequence
    (``None`` for a model whose inputs have no sequence dim). ``precision``:
    ``"fp32"``, ``"mixed"`` (what ``parallelize(precision="mixed")`` runs:
    bf16 weights, gradients and activations, gradients reduced in bf16; fp32
    master weights and optimizer state: the ZeRO paper's 2 + 2 + 12 bytes) or
    ``"bf16"`` (what ``parallelize(precision="bf16")`` runs: fp32 parameters as
    the masters and fp32 gradients, bf16 activations and ZeRO-3 gathers). ``optimizer``: ``"adam"`` (2 state
    elements per parameter), ``"sgd-momentum"`` (1) or ``"sgd"`` (0).
    ``tp`` / ``pp``: restrict the sizes searched. ``overlap_grad_sync``: the
    dp gradient reduction overlaps backward (DDP, autopar) rather than
    following it (Megatron-LM in 2021). ``scatter_gather``: a pipeline hop
    between tp groups sends ``1/tp`` of the activation from each rank and
    all-gathers it inside the node (Megatron-LM) rather than the whole
    activation from every tp rank (autopar). ``recompute``: the activation
    recomputation modes searched ("none", "selective", "full"; True is
    "full"). ``recompute_collectives``: full recomputation runs the tp
    all-reduces again and keeps only layer inputs (Megatron-LM) rather than
    keeping the collectives' outputs (autopar). ``hybrid``: also hybrid
    sharding at ZeRO 1-3: ZeRO over shard groups inside a node (each shard size that divides dp and keeps a
    group's ``shard * pp * tp`` ranks in one node), an all-reduce across the replicas.
    ``expert_imbalance``: for a model with routed experts, the busiest rank's routed rows over the mean
    under expert parallelism (1: balanced routing; it scales that rank's expert FLOPs and all-to-all bytes);
    every ep degree that divides dp and the expert count is searched (``autopar/planner/expert_cost.py``).
    ``cp``: the context-parallel degrees searched (``autopar/planner/context_cost.py``); None: each divisor
    of ``devices`` whose ``2 cp`` chunks divide ``seq_len``, searched when the sequence is long
    (``LONG_SEQUENCE`` tokens or more) or when no configuration without cp fits; ``()``: none.
    ``profile``: reuse a ``profile_model`` result (planning several clusters or batch sizes).
    ``top``: rank exactly the best ``top`` configurations, the best of each
    tp and each pp size and the best autopar runs; the step time of a
    configuration whose lower bound shows it can be none of those is not
    estimated (``autopar/planner/bound.py``). None: estimate and rank every one.
    ``local_batch`` (instead of ``global_batch``): plan for each data-parallel rank passing this many samples
    (``parallelize(batch="local")``), so that each configuration's global batch is ``local_batch`` x its dp;
    cp is not searched (the runtime's cp takes a global batch).
    ``compile``: plan steps compiled by inductor (``parallelize(compile=True)``, which each candidate's
    ``parallelism`` then asks for): the cluster's ``compiled()`` efficiency.
    """
    start = time.perf_counter()
    cluster = Cluster.preset(cluster) if isinstance(cluster, str) else cluster
    if compile:
        cluster = cluster.compiled()
    prec = PRECISIONS[precision] if isinstance(precision, str) else precision
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATES)}")
    if (global_batch is None) == (local_batch is None):
        raise ValueError(f"plan needs exactly one of global_batch= and local_batch=, got global_batch={global_batch} "
                         f"and local_batch={local_batch}")
    batch, local = (local_batch, True) if local_batch is not None else (global_batch, False)
    _check_positive(devices=devices, **{"local_batch" if local else "global_batch": batch},
                    max_microbatch=max_microbatch)
    if profile is None:
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"plan needs an nn.Module (on the meta device is fine) or profile=..., "
                             f"got {type(model).__name__}")
        tp_sizes = tuple(t for t in _powers_of_two(min(devices, cluster.devices_per_node)) if devices % t == 0)
        profile = profile_model(model, example_inputs=example_inputs, example_kwargs=example_kwargs,
                                sequence=seq_len is not None, tp_sizes=tuple(tp or tp_sizes))
    cost = CostModel(profile, cluster, prec, seq_len=seq_len or 1, optimizer_states=OPTIMIZER_STATES[optimizer],
                     overlap_grad_sync=overlap_grad_sync, scatter_gather=scatter_gather,
                     recompute_collectives=recompute_collectives, expert_imbalance=expert_imbalance)
    node = cluster.devices_per_node if hybrid else 0
    evaluated = [c for config in search_space(profile, devices, batch, zero=zero, schedules=schedules,
                                              recompute=recompute, tp=tp, pp=pp, max_microbatch=max_microbatch,
                                              node=node, local=local)
                 if (c := evaluate(cost, config, cluster, prec, profile)) is not None]
    if seq_len and profile.has_sequence and not local and (cp or (cp is None and (
            seq_len >= LONG_SEQUENCE or (evaluated and not any(c.fits for c in evaluated))))):
        for n in context_sizes(devices, seq_len, cp):
            evaluated += [c for config in search_space(profile, devices, global_batch, zero=zero, schedules=schedules,
                                                       recompute=recompute, tp=tp, pp=pp,
                                                       max_microbatch=max_microbatch, cp=n)
                          if (c := evaluate(cost, config, cluster, prec, profile)) is not None]
    evaluated += mixed_recompute(cost, evaluated, cluster, prec, profile)
    evaluated += sequence_parallel(cost, evaluated, cluster, prec, profile)
    for c in evaluated:
        c.per_sample, c.compiled = local, compile
    if not evaluated:
        layers = sum(seg.count for seg in profile.layers)
        whole = f"local batch {batch} must divide by microbatches" if local else \
            f"global batch {batch} must divide by dp x microbatches"
        raise ValueError(f"no configuration of {devices} devices applies: {whole}, and pp x stages per rank must "
                         f"not exceed the {layers} layers; change the batch or the device count")
    candidates = [c for c in evaluated if c.runnable or not runnable_only]
    if not candidates:
        raise ValueError(f"none of the {len(evaluated)} configurations is one autopar runs today (e.g. "
                         f"{evaluated[0].config.describe()}: {evaluated[0].not_runnable}); plan with "
                         "runnable_only=False to see them all")
    fitting = [c for c in candidates if c.fits]
    ranked = timed_candidates(fitting, top) + [c for c in candidates if not c.fits]
    ranked.sort(key=rank_key)
    result = PlanResult(model=profile.name, devices=devices, cluster=cluster, precision=prec,
                        global_batch=0 if local else batch, seq_len=seq_len or 1, candidates=ranked, explanation=[],
                        considered=len(evaluated), seconds=0.0, profile=profile, cost=cost, top=top,
                        fitting=len(fitting), every={c.config: c for c in candidates},
                        local_batch=batch if local else 0, compiled=compile)
    result.explanation = explain(result)
    result.seconds = time.perf_counter() - start
    return result


def search_space(profile: ModelProfile, devices: int, global_batch: int, *, zero: tuple[int, ...] = (0, 1, 2, 3),
                 schedules: tuple[str, ...] = SCHEDULE_NAMES,
                 recompute: tuple[str | bool, ...] = ("none", "selective", "full"), tp: tuple[int, ...] | None = None,
                 pp: tuple[int, ...] | None = None, max_microbatch: int = 16, node: int = 0,
                 cp: int = 1, local: bool = False) -> Iterator[Config]:
    """Every configuration of ``devices`` devices that splits ``global_batch`` evenly (with ``local``, that
    splits it as each data-parallel rank's batch, whatever dp is); with ``node`` (devices per
    node), at ZeRO 1-3 also hybrid sharding over each shard size whose group of ``shard * pp * tp`` consecutive
    ranks stays inside a node (``Config.dp_shard``); for a model with routed experts, without hybrid sharding,
    also each expert-parallel degree (``Config.ep``: a divisor of dp that divides every layer's expert count).
    With ``cp`` > 1: the configurations of ``devices / cp`` ranks per cp rank (``Config.cp``), without hybrid
    sharding or ep, ZeRO sharding over dp x cp; at tp = 1 each with the ring, where cp divides the attentions'
    heads with the all-to-all, and with usp for each split of cp into a ring of all-to-all groups whose size
    divides the heads (``Config.cp_attention``, ``Config.cp_a2a``)."""
    layers = sum(seg.count for seg in profile.layers)
    if devices % cp:
        return
    devices //= cp
    node = node if cp == 1 else 0
    heads = profile.attention_heads
    attentions = cp_attentions(cp, heads)
    for t in sorted(profile.tp_sizes):
        if devices % t or (tp is not None and t not in tp):
            continue
        for p in _divisors(devices // t):
            if p > max(layers, 1) or (pp is not None and p not in pp):
                continue
            dp = devices // (t * p)
            if not local and global_batch % dp:
                continue
            rows = global_batch if local else global_batch // dp
            eps = [1] + (profile.experts.ep_sizes(dp) if profile.experts is not None and cp == 1 else [])
            for b in [d for d in _divisors(rows) if d <= max_microbatch]:
                m = rows // b
                for sched, v in _schedules(schedules, p, m, layers):
                    for z in [z for z in zero if dp * cp > 1 or z == 0]:
                        for shard in [0] + [s for s in _divisors(dp)[1:-1] if s * p * t <= node] * (z > 0):
                            for rc in recompute:
                                for e in eps if not shard else [1]:
                                    for how, a2a in attentions if t == 1 else [("ring", 0)]:
                                        yield Config(dp=dp, pp=p, tp=t, zero=z, schedule=sched, stages_per_rank=v,
                                                     microbatches=m, microbatch_size=b, recompute=rc,
                                                     dp_shard=shard, ep=e, cp=cp, cp_attention=how, cp_a2a=a2a)


def cp_attentions(cp: int, heads: int) -> list[tuple[str, int]]:
    """(cp_attention, cp_a2a) forms of attention over ``cp`` ranks for attentions of ``heads`` heads (0: unknown):
    the ring; the all-to-all where cp divides the heads; usp for each all-to-all size between 1 and cp that
    divides both (heads < cp included, where the all-to-all alone cannot split them)."""
    if cp == 1:
        return [("ring", 0)]
    usp = [("usp", a) for a in range(2, cp) if cp % a == 0 and heads and heads % a == 0]
    return [("ring", 0)] + [("all_to_all", 0)] * bool(heads and heads % cp == 0) + usp


def _schedules(names: tuple[str, ...], pp: int, m: int, layers: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [(n, 1) for n in names if n in ("gpipe", "1f1b")]
    if "interleaved-1f1b" in names:
        out += [("interleaved-1f1b", v) for v in (2, 4) if m % pp == 0 and pp * v <= layers]
    out += [("zb-h1", 1)] * ("zb-h1" in names) + [("zbv", 2)] * ("zbv" in names and 2 * pp <= layers)
    out += [("dualpipev", 2)] * ("dualpipev" in names and 2 * pp <= layers and m >= min_microbatches(pp))
    return out


def evaluate(cost: CostModel, config: Config, cluster: Cluster, prec: Precision,
             profile: ModelProfile) -> Candidate | None:
    """``config`` as a ``Candidate`` (its memory, whether it fits and runs; the step time when first asked);
    None when the cost model rejects it."""
    try:
        est = cost.estimate(config, timed=False)
    except ValueError:
        return None
    reason = not_runnable(config, prec, profile)
    return Candidate(config=config, known=est, cost=cost, fits=float(est.total_memory) <= cluster.memory,
                     runnable=not reason, not_runnable=reason, precision=prec.name,
                     recompute=cost.recompute_choice(config))


def mixed_recompute(cost: CostModel, candidates: list[Candidate], cluster: Cluster, prec: Precision,
                    profile: ModelProfile) -> list[Candidate]:
    """Megatron-LM's mix where it fits better than one mode for every layer: for each configuration whose
    ``"none"`` or ``"selective"`` does not fit the device and whose ``"full"`` does, the same with only as many
    layers of each stage recomputed fully as it takes to fit (``Config.full_layers``), the others unchanged."""
    by_mode: dict[Config, dict[str, Candidate]] = {}
    for c in candidates:
        by_mode.setdefault(dataclasses.replace(c.config, recompute="none"), {})[c.config.recompute] = c
    out = []
    for modes in by_mode.values():
        full = modes.get("full")
        if full is None or not full.fits:
            continue
        layers = max(cost.layers_per_stage(full.config))
        for base in [m for m in MIXED_WITH if m in modes and not modes[m].fits]:
            config = dataclasses.replace(full.config, recompute=base)
            lo, hi = 0, layers  # base alone does not fit, all layers full does: the fewest full layers that fit
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if cost.fits(dataclasses.replace(config, full_layers=mid), cluster.memory) \
                    else (mid, hi)
            if hi < layers and (c := evaluate(cost, dataclasses.replace(config, full_layers=hi), cluster, prec,
                                              profile)) is not None:
                out.append(c)
    return out


def sequence_parallel(cost: CostModel, candidates: list[Candidate], cluster: Cluster, prec: Precision,
                      profile: ModelProfile) -> list[Candidate]:
    """Each tensor-parallel configuration that does not fit the device, again with sequence parallelism (it
    shards activations for the same bytes communicated but twice the collective calls, so it pays only where
    memory is short)."""
    if not all(t in seg.sequence_parallel for seg in profile.segments for t in profile.tp_sizes if t > 1):
        return []
    return [c for x in candidates if x.config.tp > 1 and not x.fits
            and (c := evaluate(cost, dataclasses.replace(x.config, sequence_parallel=True), cluster, prec,
                               profile)) is not None]


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
