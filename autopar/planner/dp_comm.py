"""Data-parallel communication of one step: what DDP's and ZeRO's collectives move on a rank, and what shows.

Gradients travel in buckets (DDP and ZeRO stages 1-2: ``autopar.core.buckets``,
a small first bucket, then ``bucket_bytes`` each) or per flat group (stage 3),
each collective paying its latency. What of it shows is simulated: the rank's
step program (``step_program.py``: the runtime's order of gathers,
reduce-scatters and buckets among each unit's compute) runs on a compute
stream and the links (``step_sim.py``); a collective hides only behind the
compute the program issues it ahead of, and that compute runs slower
meanwhile (``Cluster.contention``). Nothing is hidden by a free fraction.

ZeRO-3 keeps a rank's trainable parameters in flat groups, one per layer and
one per other module (``autopar.core.zero_layout.layer_of``), each padded to
a multiple of dp (``zero3_groups``). A group's gradient is reduce-scattered
whole each time autograd reaches its all-gather: once per microbatch when
backward runs whole; under a split backward (``zb-h1``, ``zbv``) once when
``B`` finishes, if anything else than those matmuls reads a parameter of the
group (a norm, a bias, a lookup: the matmuls' weights are not in B's graph),
and once more when ``W`` lands the weight gradients of the group's matmuls
(``autopar.core.weight_grad`` sends them through autograd in one call), for a
group with any (``reduce_scatters``). With ``zero3_fetch`` ZeRO-3 gathers and reduce-scatters
per weight instead, as DeepSpeed's 2021 coordinator does (``submodule_fetch.py``).

Invariant: ``reduce_scatters`` counts the calls and bytes ``pm.communication()``
counts as ``zero_reduce_scatter@dp`` (tests/test_zero_bubble.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import sympy

from autopar.core.buckets import first_cap
from autopar.core.zero_layout import layer_of
from autopar.planner.cluster import Link
from autopar.planner.comm_time import ring_all_reduce, ring_gather, ring_scatter
from autopar.planner.config import ZERO_BUBBLE
from autopar.planner.memory_formulas import Precision
from autopar.planner.segment_values import SegmentValues
from autopar.planner.step_program import Buckets, DataParallelPlan, Unit, step_program
from autopar.planner.submodule_fetch import Submodule, SubmoduleFetch
from autopar.planner.step_sim import Kind, simulate

DP_KINDS = (Kind.GATHER, Kind.REGATHER, Kind.REDUCE_SCATTER, Kind.BUCKET, Kind.REPLICATE)


@dataclass(frozen=True)
class FlatGroup:
    """One ZeRO-3 flat group of a rank as the planner sees it."""

    elements: int  # padded to a multiple of dp
    deferred: int  # weight matmuls of its parameters whose gradient W computes (under a split backward)
    immediate: bool = True  # a parameter of it is read otherwise than by those matmuls (a norm, a bias, a lookup)

    def reduce_scatters(self, split: bool) -> int:
        """Its reduce-scatters per microbatch: once, or under a split backward once as ``B`` ends (if anything
        but the deferred matmuls reads it) and once as ``W`` lands (if it has any)."""
        if not split:
            return 1
        return (1 if self.immediate or not self.deferred else 0) + (1 if self.deferred else 0)


def _own_group(u: SegmentValues) -> tuple[int, int, bool]:
    """(elements, deferred matmuls, read otherwise) of the flat group of ``u``'s own trainable parameters."""
    own = [k for k in u.params if k not in u.common and k in u.trainable]
    return u.own_trainable, sum(u.deferred.get(k, 0) for k in own), any(not u.deferred.get(k, 0) for k in own)


def zero3_groups(units: list[SegmentValues], dp: int) -> list[FlatGroup]:
    """The flat groups ZeRO-3 makes of the trainable parameters of a rank holding ``units``: each layer
    instance's own, then one per module of the others (each stored once per rank)."""
    groups: list[tuple[int, int, bool]] = []
    common: dict[str, tuple[int, int, bool]] = {}  # parameter -> (elements, deferred matmuls, read otherwise)
    for u in units:
        if u.own_trainable:
            groups.append(_own_group(u))
        for name, e in u.common.items():
            if name in u.trainable:
                _, n, other = common.get(name, (0, 0, False))
                common[name] = (e, n + u.deferred.get(name, 0), other or not u.deferred.get(name, 0))
    modules: dict[str, tuple[int, int, bool]] = {}
    for name, (e, deferred, other) in common.items():
        total, n, any_other = modules.get(layer_of(name), (0, 0, False))
        modules[layer_of(name)] = (total + e, n + deferred, any_other or other)
    return [FlatGroup(-(-e // dp) * dp, n, other) for e, n, other in groups + list(modules.values())]


def reduce_scatters(units: list[SegmentValues], dp: int, split: bool) -> tuple[int, int]:
    """(calls, elements) of one microbatch's ZeRO-3 gradient reduce-scatters on a rank holding ``units``;
    ``split``: the schedule splits backwards into B and W (see the module doc)."""
    groups = zero3_groups(units, dp)
    times = [g.reduce_scatters(split) for g in groups]
    return sum(times), sum(t * g.elements for t, g in zip(times, groups))


@dataclass(frozen=True)
class Exposure:
    """What the dp collectives of a step cost the slowest rank: seconds compute waited for them (or the step
    waited after compute ended), seconds compute lost running beside them, and seconds the dp link was busy."""

    exposed: Any = 0.0
    contention: Any = 0.0
    busy: Any = 0.0
    replicate: Any = 0.0  # hybrid sharding: seconds the all-reduces across replicas keep their link busy (in busy)
    replicate_exposed: Any = 0.0  # ... and the seconds the step runs on after everything else (in exposed)


@dataclass(frozen=True)
class DataParallel:
    """How a cost model's dp collectives run: element sizes, bucket size, whether buckets overlap backward, and
    the share of compute a collective beside it takes."""

    precision: Precision
    bucket_bytes: int
    overlap: bool  # buckets issued as backward produces them (DDP, autopar), or after backward (Megatron-LM 2021)
    contention: float
    recompute_gathers: bool = False  # full recomputation gathers ZeRO-3 groups for its forward and again for backward
    zero3_fetch: SubmoduleFetch | None = None  # ZeRO-3 gathers per submodule (DeepSpeed's 2021 coordinator)
    # per rank layout (its stage lists are the cost model's, kept as long as it lives): groups, simulations
    cache: dict[tuple, Any] = field(default_factory=dict, repr=False, compare=False)

    def time(self, c: Any, ranks: list[list[list[SegmentValues]]], seconds: Callable[[Any], list[tuple]],
             links: tuple[Link, Link], streams: tuple[str, ...], trainable: int,
             same: tuple = (), simulated: bool = True) -> tuple[Any, Exposure]:
        """(seconds of the dp collectives that never overlap compute, the simulated ``Exposure`` of the others)
        of config ``c``: the slowest rank's. ``seconds(stages)``: each unit's (forward, backward, tp forward,
        tp backward, ...) seconds per microbatch of a rank's stages, alike for every configuration of the same
        ``same`` (a key); ``links``: ZeRO's (the shard group's under hybrid sharding) and all of dp's;
        ``streams``: the names of ZeRO's, the tp and all of dp's link (one name: one link);
        ``trainable``: the most trainable elements a rank holds. With the microbatch size symbolic nothing is
        simulated: the exposure is 0 (a lower bound), as it is without ``simulated``."""
        if c.dp_cp == 1:
            return 0, Exposure()
        link, whole = links
        loss = ring_all_reduce(8, c.dp_cp, whole.p2p())  # the step's loss averaged over dp x cp: one element, no payload
        serial = loss
        if c.zero in (1, 2):  # the updated shards gathered after the optimizer step
            serial += ring_gather(trainable * self.precision.param, c.zero_ranks, link,
                                  self._buckets(trainable * self.precision.grad).count)
        if not simulated or isinstance(ranks[0][0][0].flops, sympy.Basic):  # (every unit is at one b)
            return serial, Exposure()
        worst = max((self.exposure(c, stages, seconds, links, streams, same) for stages in ranks),
                    key=lambda e: e.exposed + e.contention)
        return serial, worst

    def exposure(self, c: Any, stages: list[list[SegmentValues]], seconds: Callable[[Any], list[tuple]],
                 links: tuple[Link, Link], streams: tuple[str, ...], same: tuple) -> Exposure:
        """One rank's simulated ``Exposure`` (see ``time``): up to two microbatches simulated whole; more, as one
        and two, the second's difference repeated (each microbatch after the first enters as the second did: one
        reduction in flight); below ZeRO-2, one microbatch (the one that reduces; ``tests/test_planner_sim.py``
        compares both with the whole program); ZeRO-3 per submodule (``zero3_fetch``), all of them."""
        split = c.schedule in ZERO_BUBBLE and c.pp > 1
        key = ("sim", id(stages), same, c.dp_cp, c.dp_shard, c.zero, split, c.zero_prefetch, c.recompute,
               *map(id, links), streams)
        if key not in self.cache:
            self.cache[key] = ({}, self._units(c, stages, seconds(stages), links, streams, split))
        sims, (units, plan) = self.cache[key]

        def run(m: int) -> tuple[float, ...]:
            """(exposed, contention, busy, replicas' busy, replicas' exposed) of the first ``m`` microbatches; a
            simulation of two gives one too, where nothing runs across replicas (their all-reduces follow a
            step's last microbatch: a prefix holds none)."""
            if m not in sims:
                marks: list[int] = []
                program = step_program(units, plan, m, tp_link=streams[1], marks=marks)
                timeline = simulate(program, self.contention)
                base = busy = across = 0.0
                others = 0.0  # when the last event not across replicas ends
                ends = {k: n + 1 for n, k in enumerate(marks[:-1])}  # microbatch n + 1 ends after event k - 1
                for k, e in enumerate(program):
                    if e.kind is Kind.COMPUTE or e.kind is Kind.TP:
                        base += e.seconds
                    elif e.kind in DP_KINDS:
                        busy += e.seconds
                    if e.kind is Kind.REPLICATE:
                        across += e.seconds
                    elif e.kind is not Kind.WAIT:
                        others = max(others, timeline.end[k])
                    if k + 1 in ends and not hybrid:  # a shorter program's numbers, from this one's prefix
                        span, lost = timeline.upto(k + 1)
                        sims.setdefault(ends[k + 1], (span - base - lost, lost, busy, 0.0, 0.0))
                sims[m] = (timeline.makespan - base - timeline.stretch, timeline.stretch, busy, across,
                           timeline.makespan - others)
            return sims[m]

        hybrid = bool(plan.replicate or plan.replicate_buckets)
        m = c.microbatches
        if c.zero < 2:  # reduced in the last microbatch only: the ones before add nothing to wait for
            return Exposure(*run(1))
        if m <= 2 or plan.fetch is not None:  # (per submodule, the trace spans the step: each microbatch keeps
            return Exposure(*run(m))  # what the next one uses first, the last does not)
        two, one = run(2), run(1)  # each microbatch after the first repeats the second (the replicas' all-reduces
        return Exposure(*(max(a + (m - 1) * (b - a), 0.0) for a, b in zip(one[:3], two[:3])), *two[3:])  # once)

    def _buckets(self, total: float, seconds: Any = None) -> Buckets:
        """The buckets ``total`` bytes of gradients make (``autopar.core.buckets.bucket_sizes``)."""
        return Buckets(total, min(first_cap(self.bucket_bytes), total), self.bucket_bytes, seconds)

    def program(self, c: Any, stages: list[list[SegmentValues]], times: list[tuple], links: tuple[Link, Link],
                streams: tuple[str, ...], microbatches: int | None = None) -> list:
        """The events of a rank's step (``step_program``), all ``microbatches`` of them (default: the config's)."""
        split = c.schedule in ZERO_BUBBLE and c.pp > 1
        units, plan = self._units(c, stages, times, links, streams, split)
        return step_program(units, plan if c.dp_cp > 1 else None, microbatches or c.microbatches, tp_link=streams[1])

    def _units(self, c: Any, stages: list[list[SegmentValues]], times: list[tuple], links: tuple[Link, Link],
               streams: tuple[str, ...], split: bool) -> tuple[list[Unit], DataParallelPlan]:
        """The rank's units with their ZeRO-3 groups or gradient bytes, and what its dp axis runs."""
        flat = [u for st in stages for u in st]
        p, n, (link, whole), stream = self.precision, c.zero_ranks, links, streams[0]
        groups: dict[Any, list] = {}  # key -> [elements, deferred matmuls, read otherwise (FlatGroup.immediate)]
        uses: list[list[Any]] = []
        grads: list[float] = [0.0] * len(flat)
        first: dict[str, int] = {}
        for i, u in enumerate(flat):
            mine = []
            if u.own_trainable:
                groups[("own", i)] = list(_own_group(u))
                mine.append(("own", i))
            grads[i] += u.own_trainable * p.grad
            for name, e in u.common.items():
                if name not in u.trainable:
                    continue
                module = ("module", layer_of(name))
                g = groups.setdefault(module, [0, 0, False])
                if name not in first:
                    first[name] = i
                    g[0] += e
                    grads[i] += e * p.grad
                g[1] += u.deferred.get(name, 0)
                g[2] = g[2] or not u.deferred.get(name, 0)
                if module not in mine:
                    mine.append(module)
            uses.append(mine)
        index = {key: j for j, key in enumerate(groups)}
        names = tuple(f"unit {key[1]}" if key[0] == "own" else key[1] for key in groups)
        units = [Unit(*t[:4], groups=tuple(index[g] for g in mine), gradients=grad)
                 for t, mine, grad in zip(times, uses, grads)]
        padded = [-(-e // n) * n for e, *_ in groups.values()]
        across: dict = {}
        if c.replicas > 1:  # hybrid sharding: each flat group's shard gradient all-reduced over the replicas
            across = dict(replicate_link=streams[2])
            if c.zero == 3:  # a group's, as its last reduce-scatter lands
                across["replicate"] = tuple(ring_all_reduce(e // n * p.grad, c.replicas, whole) for e in padded)
            else:  # a bucket's (a flat group of the runtime's)
                across["replicate_buckets"] = lambda nbytes, count: ring_all_reduce(nbytes / n, c.replicas, whole,
                                                                                    count)
        if c.zero == 3 and self.zero3_fetch is not None:
            if split:
                raise ValueError(f"zero3_fetch (ZeRO-3 gathered per submodule, DeepSpeed's coordinator) is not "
                                 f"modelled with a split backward ({c.schedule} at pp={c.pp}); use a schedule "
                                 "that runs backward whole or drop zero3_fetch")
            return self._submodules(c, flat, times, link, stream, across)
        if c.zero == 3:
            again = [FlatGroup(e, d, o).reduce_scatters(split) for e, d, o in groups.values()]
            plan = DataParallelPlan(
                zero=3, link=stream, prefetch=c.zero_prefetch, names=names,
                gather=tuple(ring_gather(e * (p.gather or p.param), n, link) for e in padded),
                reduce=tuple(t * ring_scatter(e * p.grad, n, link) for e, t in zip(padded, again)),
                regathers=2 if self.recompute_gathers and c.recompute == "full" else 1, **across)
            return units, plan
        op = ring_all_reduce if c.zero == 0 else ring_scatter
        buckets = self._buckets(sum(grads), lambda nbytes, count: op(nbytes, n, link, count))
        return units, DataParallelPlan(zero=c.zero, link=stream, buckets=buckets, overlap=self.overlap,
                                       names=names, **across)

    def _submodules(self, c: Any, flat: list[SegmentValues], times: list[tuple], link: Link, stream: str,
                    across: dict) -> tuple[list[Unit], DataParallelPlan]:
        """The rank's units with their submodules, each gathering its own parameters of at least the persistence
        threshold (``SubmoduleFetch``), and the per-parameter collectives."""
        p, n, fetch = self.precision, c.zero_ranks, self.zero3_fetch
        index: dict[str, int] = {}  # a parameter's (a layer instance's own: "3:name") -> its index
        elements: list[int] = []
        units = []
        for i, u in enumerate(flat):
            modules: dict[str, list[int]] = {}
            for name, e in u.params.items():
                if name in u.trainable and e >= fetch.persistence:
                    key = name if name in u.common else f"{i}:{name}"  # layer instances share names
                    if key not in index:
                        index[key] = len(index)
                        elements.append(e)
                    modules.setdefault(key.rpartition(".")[0], []).append(index[key])
            total = sum(elements[j] for ps in modules.values() for j in ps)
            subs = tuple(Submodule(key, tuple(ps), sum(elements[j] for j in ps) / total) for key, ps in modules.items())
            units.append(Unit(*times[i][:4], submodules=subs, recomputed=u.kind == "layer" and c.recompute == "full"))
        names = tuple(index)
        padded = [-(-e // n) * n for e in elements]
        plan = DataParallelPlan(
            zero=3, link=stream, names=names, fetch=fetch, elements=tuple(elements),
            gather=tuple(ring_gather(e * (p.gather or p.param), n, link) for e in padded),
            reduce=tuple(ring_scatter(e * p.grad, n, link) for e in padded),
            regathers=2 if self.recompute_gathers and c.recompute == "full" else 1, **across)
        return units, plan


def shared_all_reduce(ranks: list[list[list[SegmentValues]]], link: Link, grad_bytes: int) -> Any:
    """Seconds of the all-reduces of the parameters that stages on several ranks use (tied embeddings), among
    their holders."""
    holders: dict[str, set[int]] = {}
    sizes: dict[str, int] = {}
    for r, stages in enumerate(ranks):
        for u in (u for st in stages for u in st):
            for name, numel in u.shared().items():
                if name in u.trainable:
                    holders.setdefault(name, set()).add(r)
                    sizes[name] = numel
    return sum(ring_all_reduce(sizes[k] * grad_bytes, len(h), link) for k, h in holders.items() if len(h) > 1)
