"""The explanation's sentence about context parallelism: whether cp wins, and why (memory, the ring's exposure).

Where cp was searched (``search.plan``: a long sequence, or nothing fits without it), the best configuration
with cp and the best without it are compared: the one that does not fit loses on memory (activations per
device, divided by cp on a cp rank); when both fit, on step time, with the ring's bytes per step, its seconds
on the link and what of them the block computations leave exposed (``autopar/planner/context_cost.py``).
The sentence names the form of attention of the configuration with cp (the ring, the all-to-all or usp on its
split) and the exposed seconds of each other form searched for the same configuration.
"""
from __future__ import annotations

import dataclasses

from autopar.planner.cluster import gb
from autopar.planner.context_cost import LONG_SEQUENCE
from autopar.planner.config import Config
from autopar.planner.result import Candidate, PlanResult
from autopar.planner.units import as_seconds


def context_reasons(result: PlanResult) -> list[str]:
    """One sentence when cp was searched; none otherwise."""
    searched = [c for c in result.every.values() if c.config.cp > 1]
    if not searched:
        return []
    best = result.candidates[0]
    why = f"{result.seq_len:,} tokens per sequence" if result.seq_len >= LONG_SEQUENCE else \
        "nothing fits without it"
    ranked = [c for c in result.candidates if c.fits]
    with_cp = next((c for c in ranked if c.config.cp > 1), None)
    without = next((c for c in ranked if c.config.cp == 1), None)
    head = f"context parallelism searched ({why}): "
    if with_cp is None:
        least = min(searched, key=lambda c: c.total_memory)
        return [head + f"no configuration with cp fits; the smallest ({least.config.describe()}) needs "
                f"{gb(least.total_memory)}"]
    ring = _ring(result, with_cp)
    if without is None:
        least = min((c for c in result.every.values() if c.config.cp == 1), key=lambda c: c.total_memory,
                    default=None)
        need = f"; the smallest without cp needs {gb(least.total_memory)}" if least is not None else ""
        return [head + f"cp wins on memory: nothing without cp fits {gb(result.cluster.memory)}{need}, "
                f"while cp={with_cp.config.cp} holds 1/{with_cp.config.cp} of each sequence per rank "
                f"(activations {gb(with_cp.memory['activations'])} per device); {ring}"]
    if best.config.cp > 1:
        return [head + f"cp={best.config.cp} wins: {_versus(best, without)}; {ring}"]
    return [head + f"cp does not win: its best ({with_cp.config.describe()}) {_versus(with_cp, best)}; {ring}"]


def _versus(a: Candidate, b: Candidate) -> str:
    """How ``a`` compares with ``b``: step times, the part that differs most, and activations per device."""
    slower, faster = (a, b) if a.step_time > b.step_time else (b, a)
    part = lambda k: float(slower.estimate.time[k]) - float(faster.estimate.time[k])  # noqa: E731
    key = max(slower.estimate.time, key=part)
    worse = (f", the slower's largest extra: {key.replace('_', ' ')} {as_seconds(float(slower.estimate.time[key]))} "
             f"vs {as_seconds(float(faster.estimate.time[key]))}") if part(key) > 0 else ""
    return (f"{as_seconds(a.step_time)} per step vs {as_seconds(b.step_time)} for the best "
            f"{'without' if a.config.cp > 1 else 'with'} cp ({b.config.describe()}){worse}; activations "
            f"{gb(a.memory['activations'])} vs {gb(b.memory['activations'])} per device")


def _ring(result: PlanResult, c: Candidate) -> str:
    """The ring of ``c``: bytes a rank sends per step, and its exposed seconds on its link."""
    cfg = c.config
    attentions, exchanges, nbytes = result.cost.ring_exchanges(cfg)
    span = cfg.cp * cfg.pp * cfg.tp
    where = "inside a node" if span <= result.cluster.devices_per_node else "between nodes"
    exposed = float(c.estimate.time["context_parallel"])
    others = _forms(result, c)
    if cfg.cp_split:
        ring, a2a = cfg.cp_split
        return (f"its attentions run usp on cp={cfg.cp_split}: heads exchanged for sequence inside groups of {a2a} "
                f"ranks, then a ring of {ring} groups; {exchanges} all-to-alls and ring exchanges over {attentions} "
                f"attentions send {gb(float(nbytes))} per rank and step ({where}), {as_seconds(exposed)} exposed "
                f"({exposed / c.step_time:.1%} of the step){others}")
    if cfg.cp_attention == "all_to_all":
        return (f"its attentions exchange heads for sequence: {exchanges} all-to-alls over {attentions} attentions "
                f"send {gb(float(nbytes))} per rank and step ({where}), {as_seconds(exposed)} "
                f"({exposed / c.step_time:.1%} of the step), none of it overlapped{others}")
    return (f"its ring sends {gb(float(nbytes))} of K/V blocks and their gradients per rank and step "
            f"({exchanges} exchanges over {attentions} attentions, {where}), {as_seconds(exposed)} of it exposed "
            f"beyond the block computations ({exposed / c.step_time:.1%} of the step){others}")


def _forms(result: PlanResult, c: Candidate) -> str:
    """The other forms of attention searched for ``c``'s configuration and their exposed seconds ("" if none)."""
    same = [o for o in result.every.values() if o.config != c.config
            and dataclasses.replace(o.config, cp_attention=c.config.cp_attention, cp_a2a=c.config.cp_a2a) == c.config]
    if not same:
        return ""
    return "; chosen over " + ", ".join(f"{_form(o.config)} ({as_seconds(float(o.estimate.time['context_parallel']))} "
                                        f"exposed)" for o in same)


def _form(cfg: Config) -> str:
    return f"usp on cp={cfg.cp_split}" if cfg.cp_split else {"all_to_all": "the all-to-all"}.get(
        cfg.cp_attention, "the ring")
