"""What a plan says to a person: the ranked table, its header, and sentences explaining the best candidate.

``explain`` writes sentences a reader can check against the table (what the
largest layer needs, why other tp and pp sizes lose, what ZeRO, the bubble and
communication cost); ``render_table`` and ``render_plan`` print a
``PlanResult``. Sizes print in the units people quote them in (GB, "175B"
parameters, ms).

Invariant: reads a ``PlanResult`` and never changes it; every number printed is
one of the candidates' estimates or the cost model's.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from autopar.planner.bound import measure
from autopar.planner.cluster import gb
from autopar.planner.cost_model import ZERO_BUBBLE, Config, b_sym, s_sym
from autopar.planner.context_report import context_reasons
from autopar.planner.expert_report import expert_reasons
from autopar.planner.megatron import HELD_OUT_ERROR
from autopar.planner.result import Candidate, PlanResult
from autopar.planner.units import as_bytes, as_count, as_rate, as_seconds

TIME_KEYS = ("compute", "tensor_parallel", "pipeline_p2p", "expert_parallel", "context_parallel", "bubble",
             "shared_cores", "data_parallel", "contention", "optimizer")
AXIS_WORDS = {"dp": "data parallel", "tp": "tensor parallel", "pp": "pipeline",
              "dp_shard": "ZeRO inside a replica", "dp_replicate": "all-reduce across replicas, beside backward"}


# ---------------------------------------------------------------------------
# explanations
# ---------------------------------------------------------------------------

def explain(result: PlanResult) -> list[str]:
    """Sentences a person can check against the table: what is needed, what does not fit, what it costs."""
    cands = result.candidates
    best = cands[0]
    prec, mem = result.precision, result.cluster.memory
    out = [_largest_layer(result)] + _local_batch(result)
    for axis in ("tp", "pp"):
        out += _axis_reasons(result, axis)
    out += [f"note: {note}" for note in result.profile.notes if "not analyzed" in note]
    if not best.fits:
        out.append(f"nothing fits {gb(mem)} per device: the smallest configuration ({best.config.describe()}) needs "
                   f"{gb(best.total_memory)}; add devices, lower the global batch or sequence, or use recomputation")
        return out
    c, e = best.config, best.estimate
    out += _zero_reason(result) + _hybrid_reason(result) + expert_reasons(result) + context_reasons(result)
    b_max = result.max_microbatch_size(c)
    expr = result.memory_expr(c)
    at_one, at_two = float(expr.subs(b_sym, 1)), float(expr.subs(b_sym, 2))
    slope, const = at_two - at_one, 2 * at_one - at_two
    out.append(f"memory per device of the best is {gb(const)} + {gb(slope)} x b for microbatch size b; the largest b "
               f"that fits {gb(mem)} is {b_max}; chosen b={c.microbatch_size} with {c.microbatches} microbatches")
    t = {k: float(v) for k, v in e.time.items()}
    total = best.step_time
    parts = ", ".join(f"{k.replace('_', ' ')} {as_seconds(v)} ({v / total:.0%})" for k, v in t.items() if v > 0)
    out.append(f"step time {as_seconds(total)}: {parts}")
    out += _links(best) + _margin(result)
    if c.pp > 1 and c.schedule in ZERO_BUBBLE:
        share = float(e.time["bubble"]) / float(e.time["compute"])
        out.append(f"pipeline bubble {share:.1%} of the compute time: {c.schedule} splits each backward into input "
                   f"and weight gradients and fills the pipeline's waits with the weight gradients (as simulated; "
                   f"1F1B's (pp-1)/m would be {(c.pp - 1) / c.microbatches:.1%})")
    elif c.pp > 1:
        out.append(f"pipeline bubble (pp-1)/(v*m) = {c.pp - 1}/({c.stages_per_rank}*{c.microbatches}) = "
                   f"{(c.pp - 1) / (c.stages_per_rank * c.microbatches):.1%} of the compute time")
    out += _recompute_reason(result) + _sequence_parallel_reason(result) + _layer_collectives(result) \
        + _split_reduce_scatters(result)
    peak = result.cluster.peak(prec.name)
    out.append(f"throughput {e.tokens_per_s:,.0f} tokens/s; {as_rate(e.flops_per_device)} of model FLOPs per device = "
               f"{e.flops_per_device / peak:.0%} of the {as_rate(peak)} peak")
    runnable = next((x for x in cands if x.fits and x.runnable), None)
    if not best.runnable:
        other = (f"{runnable.config.describe()} at {as_seconds(runnable.step_time)}" if runnable
                 else "none fits" if any(x.runnable for x in cands) else "none of these")
        out.append(f"the best is not run by autopar today ({best.not_runnable}); the best it runs: {other}")
    return out


def _local_batch(result: PlanResult) -> list[str]:
    if not result.local_batch:
        return []
    return [f"planned for a local batch of {result.local_batch} per data-parallel rank (batch='local'): a "
            f"configuration with dp ranks trains dp x {result.local_batch} samples per step, so each is ranked, and "
            f"compared below, by its step time over dp (the time per local batch)"]


def _links(best: Candidate) -> list[str]:
    """Per mesh axis of the best: its link, how busy the step keeps it, and what of it compute hid (simulated)."""
    e = best.estimate
    parts = []
    for axis, x in e.links.items():
        where = "inside a node" if x.link == "intra" else "between nodes"
        said = (f"{axis} ({AXIS_WORDS[axis]}, {where} at {gb(x.bandwidth)}/s): busy {as_seconds(x.busy)}, "
                f"{x.busy / e.step_time:.0%} of the step")
        if x.hidden > 0:
            said += f"; {as_seconds(x.hidden)} hidden behind compute, {as_seconds(x.exposed)} exposed"
            said += f", and compute {as_seconds(x.contention)} slower beside it" if x.contention else ""
        else:
            said += ", all exposed (compute waits for it)"
        parts.append(said)
    if not parts:
        return []
    return ["communication per axis, from the simulated step program (docs/planner.md): " + "; ".join(parts)]


def _margin(result: PlanResult) -> list[str]:
    """Whether the best's lead over the next candidate is within the calibration's held-out error."""
    best, following = result.candidates[0], result.candidates[1:2]
    if not following or not following[0].fits:
        return []
    lead = following[0].pace / best.pace - 1
    if lead >= HELD_OUT_ERROR:
        return []
    return [f"the best leads the next ({following[0].config.describe()}) by {lead:.1%}, within the calibration's "
            f"held-out error of {HELD_OUT_ERROR:.0%} (docs/planner.md): the model does not tell them apart; "
            f"measure both"]


def _largest_layer(result: PlanResult) -> str:
    prec = result.precision
    per_param = prec.param + prec.grad + prec.master + result.cost.states * prec.state
    layers = result.profile.layers
    if not layers:
        return f"{result.profile.total_params:,} parameters, no repeated layers; {per_param} bytes per parameter"
    seg = max(layers, key=lambda s: s.parts[1].param_elements)
    n = seg.parts[1].param_elements
    count = sum(s.count for s in layers)
    return (f"{count} layers; the largest ({seg.name}) has {as_count(n)} parameters and needs {gb(n * per_param)} "
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
            fastest = min(fitting, key=lambda c: c.pace)
            worse = _biggest_difference(fastest, best)
            out.append(f"{axis}={size} fits but its best ({fastest.config.describe()}) takes "
                       f"{as_seconds(fastest.step_time)} per step, {fastest.pace / best.pace:.2f}x the best"
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
    return (f"{key.replace('_', ' ')} {as_seconds(float(other.estimate.time[key]))} vs "
            f"{as_seconds(float(best.estimate.time[key]))}")


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
        twin = result.candidate(dataclasses.replace(c, zero=z, dp_shard=c.dp_shard if z else 0))
        if twin is None:
            continue
        verdict = "does not fit" if not twin.fits else f"{twin.pace / best.pace:.2f}x {measure(best)}"
        if z == 3 and twin.fits and c.schedule in ZERO_BUBBLE and c.pp > 1:
            verdict += f" ({_repeats(result, twin.config)})"
        out.append(f"zero={z} instead of {c.zero}: parameters+gradients+optimizer {gb(state(twin))} vs "
                   f"{gb(state(best))} per device; {verdict}")
    return out[:2]


def _hybrid_reason(result: PlanResult) -> list[str]:
    """Why hybrid sharding wins or loses: the best against the best of the other kind (with or without it)."""
    best = result.candidates[0]
    hybrid = best.config.dp_shard > 0
    other = next((x for x in result.candidates if x.fits and (x.config.dp_shard > 0) != hybrid), None)
    if other is None:
        tried = [x for x in result.every.values() if x.config.dp_shard]
        if hybrid or not tried:
            return []
        least = min(tried, key=lambda x: x.total_memory)
        return [f"hybrid sharding does not fit: its shard group stays inside a node (shard x pp x tp <= "
                f"{result.cluster.devices_per_node}), and its smallest configuration ({least.config.describe()}) "
                f"needs {gb(least.total_memory)} per device > {gb(result.cluster.memory)}"]
    h = best if hybrid else other
    c, link = h.config, h.estimate.links.get("dp_shard")
    where = "inside a node" if link is not None and link.link == "intra" else "between nodes"
    across = h.estimate.links.get("dp_replicate")
    busy, exposed = (across.busy, across.exposed) if across is not None else (0.0, 0.0)
    how = (f"dp=({c.replicas}, {c.dp_shard}) shards ZeRO-{c.zero} over {c.dp_shard} ranks {where} and all-reduces "
           f"each shard's gradients across the {c.replicas} replicas beside backward, {as_seconds(busy)} of them, "
           f"{as_seconds(exposed)} exposed (docs/zero.md)")
    ratio = other.pace / best.pace
    worse = _biggest_difference(other, best)
    if hybrid:
        return [f"hybrid sharding wins: {how}; the best without it ({other.config.describe()}) takes "
                f"{as_seconds(other.step_time)}, {ratio:.2f}x" + (f" ({worse})" if worse else "")]
    return [f"hybrid sharding loses: its best ({c.describe()}) takes {as_seconds(h.step_time)}, {ratio:.2f}x the best"
            + (f" ({worse})" if worse else "") + f"; {how}"]


def _recompute_reason(result: PlanResult) -> list[str]:
    """Why the best mixes recomputation modes: what one mode for every layer would need or take."""
    best = result.candidates[0]
    c = best.config
    if not c.full_layers:
        return []
    layers = result.cost.layers_per_stage(c)
    up_to = "up to " if len(set(layers)) > 1 else ""
    where = "the model's" if len(layers) == 1 else f"each pipeline stage's {up_to}"
    out = f"recomputation: full on {c.full_layers} of {where}{max(layers)} layers, {c.recompute} on the others"
    base = result.candidate(dataclasses.replace(c, full_layers=0))
    full = result.candidate(dataclasses.replace(c, recompute="full", full_layers=0))
    if base is not None:
        out += (f": {gb(best.total_memory)} per device fits {gb(result.cluster.memory)}, where {c.recompute} on "
                f"every layer needs {gb(base.total_memory)}")
    if full is not None:
        out += f"; full on every layer takes {as_seconds(full.step_time)} ({full.pace / best.pace:.2f}x)"
    return [out]


def _sequence_parallel_reason(result: PlanResult) -> list[str]:
    """Why the best shards the values between tensor-parallel regions: the same configuration without."""
    best = result.candidates[0]
    c = best.config
    if not c.sequence_parallel:
        return []
    twin = result.candidate(dataclasses.replace(c, sequence_parallel=False))
    out = (f"sequence parallelism: the values between tensor-parallel regions are sharded over tp={c.tp} too "
           f"(each forward all-reduce a reduce-scatter and an all-gather, the same bytes; backward gathers each "
           f"column-parallel input again, so that only its shard is kept)")
    if twin is not None:
        out += (f"; activations {gb(best.memory['activations'])} per device instead of "
                f"{gb(twin.memory['activations'])}, without which {gb(twin.total_memory)} does not fit "
                f"{gb(result.cluster.memory)}")
    return [out]


def _layer_collectives(result: PlanResult) -> list[str]:
    """The tp collectives of one microbatch of the largest layer under the best, as the profile's lowering runs
    them, with their sizes; and where the all-to-alls come from when there are any."""
    c = result.candidates[0].config
    layers = result.profile.layers
    if c.tp == 1 or not layers:
        return []
    seg = max(layers, key=lambda x: x.parts[1].param_elements)
    part = result.profile.part(seg, c.tp, c.sequence_parallel)
    at = {b_sym: c.microbatch_size, s_sym: result.seq_len}
    calls = Counter((x.direction, x.op, float(x.elements.xreplace(at)) * result.precision.activation,
                     not x.elements.free_symbols) for x in part.collectives)
    order = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")

    def listed(direction: str) -> str:
        found = sorted(((op, nbytes, param), n) for (d, op, nbytes, param), n in calls.items() if d == direction)
        return ", ".join(f"{n} {op.replace('_', '-')}{'s' * (n > 1)} of {as_bytes(nbytes)}"
                         + (" (parameters' gradients)" if param else "")
                         for (op, nbytes, param), n in sorted(found, key=lambda x: order.index(x[0][0]))) or "none"

    sp = " with sequence parallelism" if c.sequence_parallel else ""
    out = (f"tp collectives per microbatch of each {seg.name} layer (tp={c.tp}{sp}): forward {listed('forward')}; "
           f"backward {listed('backward')}")
    if c.sequence_parallel:
        count = Counter((x.direction, x.op) for x in part.collectives)
        again = count["backward", "all_gather"] - count["forward", "reduce_scatter"]
        out += f"; {again} of the backward all-gathers gather kept shards again"
    if any(x.op == "all_to_all" for x in part.collectives):
        out += ("; the all-to-alls (each moves 1/tp of an all-gather's bytes) turn a norm's output from sequence "
                "shards into hidden shards before a column-parallel matmul: the model flattens (batch, sequence) "
                "into one dim there, which a sequence shard does not pass, and the sharding solver counts a "
                "gathered input as kept in shards only where the all-gather feeds the matmul itself "
                "(Megatron-LM's sequence-first layout needs no all-to-all; docs/planner.md)")
    return [out]


def _split_reduce_scatters(result: PlanResult) -> list[str]:
    """What ZeRO-3's gradient reduce-scatters cost the best under a split backward, when it has both."""
    c = result.candidates[0].config
    if c.zero != 3 or c.dp == 1 or c.pp == 1 or c.schedule not in ZERO_BUBBLE:
        return []
    t = float(result.candidates[0].estimate.time["data_parallel"])
    return [f"zero=3 with {c.schedule}: {_repeats(result, c)}; data parallel {as_seconds(t)} per step"]


def _repeats(result: PlanResult, c: Config) -> str:
    """How many reduce-scatters ZeRO-3 runs under ``c``'s split backward, against one per layer and microbatch."""
    split = max(result.cost.zero3_reduce_scatters(c), key=lambda x: x[1])
    whole = max(result.cost.zero3_reduce_scatters(c, split=False), key=lambda x: x[1])
    return (f"each layer's gradients are reduce-scattered after B and again after each of its weight gradients "
            f"in W, {split[0]:,} times per step and {gb(split[1])} on the busiest rank instead of {whole[0]:,} "
            f"times and {gb(whole[1])}")
