"""The explanation's sentences about expert parallelism: why the best's ep degree wins over the others.

For a model with routed experts, each other ep degree of the best configuration (same mesh, ZeRO, schedule,
microbatches) is compared with it on what ep changes (``autopar/planner/expert_cost.py``): the experts' compute
(dense dispatch at ep=1 for experts written as a loop, ``E / k`` times the routed FLOPs; routed top-k times
the imbalance under ep), the all-to-alls and the link the ep group lands on, and the expert state per device.
"""
from __future__ import annotations

import dataclasses

from autopar.planner.bound import measure
from autopar.planner.cluster import gb
from autopar.planner.config import Config
from autopar.planner.result import Candidate, PlanResult
from autopar.planner.units import as_seconds


def expert_reasons(result: PlanResult) -> list[str]:
    """One sentence per other ep degree of the best configuration; none for a model without routed experts."""
    experts = result.profile.experts
    if experts is None:
        return []
    best = result.candidates[0]
    c = best.config
    out = [_experts_line(result)]
    for ep in [1, *experts.ep_sizes(c.dp)]:
        twin = result.candidate(dataclasses.replace(c, ep=ep))
        if ep != c.ep and twin is not None:
            out.append(_compare(result, twin, best))
    return out


def _experts_line(result: PlanResult) -> str:
    experts = result.profile.experts
    kinds = sorted({(x.experts, x.top_k, x.form) for x in experts.layers})
    loop = "a loop (dense dispatch at ep=1: E/k = {:g}x the routed FLOPs)"
    grouped = "one grouped matmul (routed FLOPs)"
    forms = "; ".join(f"{e} experts, top-{k}, " + (loop.format(e / k) if f == "eager" else grouped)
                      for e, k, f in kinds)
    share = sum(x.params for x in experts.layers) / result.profile.total_params
    return (f"routed experts: {len(experts.layers)} layers ({forms}); experts hold {share:.0%} of the parameters; "
            f"ep searched over the divisors of dp that divide the expert count; routing imbalance "
            f"{result.cost.imbalance:g} (the busiest rank's rows over the mean)")


def _compare(result: PlanResult, other: Candidate, best: Candidate) -> str:
    """``ep=<other>`` against the best: step time, expert compute, all-to-all, expert state, runnable."""
    o, b = other.config, best.config
    verdict = "does not fit" if not other.fits else f"{other.pace / best.pace:.2f}x {measure(best)}"
    calls, nbytes = result.cost.expert_all_to_all(o if o.ep > 1 else b)
    ep = o if o.ep > 1 else b
    span = ep.ep * ep.pp * ep.tp
    link = result.cluster.link(span)
    where = "inside a node" if span <= result.cluster.devices_per_node else "across nodes"
    state = [x.memory["parameters"] + x.memory["gradients"] + x.memory["optimizer"] for x in (other, best)]
    line = (f"ep={o.ep} instead of {b.ep}: {verdict}; experts' compute {as_seconds(expert_seconds(result, o))} vs "
            f"{as_seconds(expert_seconds(result, b))} per step, all-to-all "
            f"{as_seconds(float(other.estimate.time['expert_parallel']))} vs "
            f"{as_seconds(float(best.estimate.time['expert_parallel']))} (at ep={ep.ep}: {calls} calls, "
            f"{gb(float(nbytes))} sent per rank per step, {where} at {gb(link.bandwidth)}/s), parameters+gradients+"
            f"optimizer {gb(state[0])} vs {gb(state[1])} per device")
    if not other.runnable:
        line += f"; not run by autopar today: {other.not_runnable}"
    return line


def expert_seconds(result: PlanResult, c: Config) -> float:
    """Seconds of the experts' forward and backward (3x the forward FLOPs) in one step on the busiest rank:
    every expert layer's FLOPs per token (``ExpertLayerProfile.flops_per_token``) over the rank's tokens, the
    layers divided over pp, at the cluster's peak times its efficiency."""
    experts, cost, cl = result.profile.experts, result.cost, result.cluster
    tokens = c.global_batch // c.dp * cost.seq_len
    flops = sum(x.flops_per_token(c.ep, cost.imbalance) for x in experts.layers) * tokens * 3 / c.pp
    return flops / (cl.peak(result.precision.name) * cl.efficiency)
