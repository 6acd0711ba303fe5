"""Data-parallel communication of one step: what DDP's and ZeRO's collectives move on a rank, and what shows.

Gradients travel in buckets (DDP and ZeRO stages 1-2: ``autopar.core.buckets``,
a small first bucket, then ``bucket_bytes`` each) or per flat group (stage 3),
each collective paying its latency. Up to ``cluster.overlap`` of it hides
behind backward (stage 3's forward gathers behind forward); the last bucket,
launched when backward ends, never hides.

ZeRO-3 keeps a rank's trainable parameters in flat groups, one per layer and
one per other module (``autopar.core.zero_layout.layer_of``), each padded to
a multiple of dp (``zero3_groups``). A group's gradient is reduce-scattered
whole each time autograd reaches its all-gather: once per microbatch when
backward runs whole; under a split backward (``zb-h1``, ``zbv``) once when
``B`` finishes and once more when ``W`` lands the weight gradients of the
group's matmuls (``autopar.core.weight_grad`` sends them through autograd in
one call), for a group with any (``reduce_scatters``).

Invariant: ``reduce_scatters`` counts the calls and bytes ``pm.communication()``
counts as ``zero_reduce_scatter@dp`` (tests/test_zero_bubble.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autopar.core.buckets import bucket_sizes
from autopar.core.zero_layout import layer_of
from autopar.planner.cluster import Link
from autopar.planner.comm_time import ring_all_reduce, ring_gather, ring_scatter
from autopar.planner.config import ZERO_BUBBLE
from autopar.planner.expr import largest
from autopar.planner.memory_formulas import Precision
from autopar.planner.segment_values import SegmentValues, state_elements


@dataclass(frozen=True)
class FlatGroup:
    """One ZeRO-3 flat group of a rank as the planner sees it."""

    elements: int  # padded to a multiple of dp
    deferred: int  # weight matmuls of its parameters whose gradient W computes (under a split backward)


def zero3_groups(units: list[SegmentValues], dp: int) -> list[FlatGroup]:
    """The flat groups ZeRO-3 makes of the trainable parameters of a rank holding ``units``: each layer
    instance's own, then one per module of the others (each stored once per rank)."""
    groups: list[tuple[int, int]] = []
    common: dict[str, tuple[int, int]] = {}  # parameter -> (elements, deferred matmuls over the rank's units)
    for u in units:
        if u.own_trainable:
            groups.append((u.own_trainable, sum(n for k, n in u.deferred.items() if k not in u.common)))
        for name, e in u.common.items():
            if name in u.trainable:
                common[name] = (e, common.get(name, (0, 0))[1] + u.deferred.get(name, 0))
    modules: dict[str, tuple[int, int]] = {}
    for name, (e, deferred) in common.items():
        total, n = modules.get(layer_of(name), (0, 0))
        modules[layer_of(name)] = (total + e, n + deferred)
    return [FlatGroup(-(-e // dp) * dp, n) for e, n in groups + list(modules.values())]


def reduce_scatters(units: list[SegmentValues], dp: int, split: bool) -> tuple[int, int]:
    """(calls, elements) of one microbatch's ZeRO-3 gradient reduce-scatters on a rank holding ``units``;
    ``split``: the schedule splits backwards into B and W (see the module doc)."""
    groups = zero3_groups(units, dp)
    times = [1 + (1 if split and g.deferred else 0) for g in groups]
    return sum(times), sum(t * g.elements for t, g in zip(times, groups))


@dataclass(frozen=True)
class DataParallel:
    """How a cost model's dp collectives run: element sizes, bucket size, whether they overlap backward."""

    precision: Precision
    bucket_bytes: int
    hide: float  # the share of a collective that computation can hide (0: gradients reduced after backward)
    # a rank's ZeRO-3 groups and reduce-scatters by (id of its stages, dp, split backward): the stage lists are the
    # cost model's, kept as long as it lives
    groups: dict[tuple, Any] = field(default_factory=dict, repr=False, compare=False)

    def time(self, c: Any, ranks: list[list[list[SegmentValues]]], forward: Any, backward: Any,
             link: Link, trainable: int | None = None) -> Any:
        """Exposed seconds of the dp collectives of config ``c`` per step (the module doc), the slowest rank's;
        ``trainable``: the most trainable elements a rank holds, when the caller knows it."""
        if c.dp == 1:
            return 0
        loss = ring_all_reduce(8, c.dp, link.p2p())  # the step's loss averaged over dp: one element, no payload
        if c.zero == 3:
            return loss + largest([self._stage3(c, stages, forward, backward, link) for stages in ranks])
        held = [[u for st in stages for u in st] for stages in ranks] if trainable is None else []
        p = self.precision
        elements = max(state_elements(units)[1] for units in held) if trainable is None else trainable
        grads, params = elements * p.grad, elements * p.param
        sizes = bucket_sizes(grads, self.bucket_bytes)  # a small first bucket, as the runtime cuts them
        buckets, last, n = len(sizes), sizes[-1], c.dp
        if c.zero == 0:
            return loss + self._exposed(ring_all_reduce(grads, n, link, buckets), backward,
                                        ring_all_reduce(last, n, link))
        reduce = self._exposed(ring_scatter(grads, n, link, buckets), backward, ring_scatter(last, n, link))
        gather_params = ring_gather(params, n, link, buckets)  # updated shards after the optimizer step
        return loss + (1 if c.zero == 1 else c.microbatches) * reduce + gather_params

    def _stage3(self, c: Any, stages: list[list[SegmentValues]], forward: Any, backward: Any, link: Link) -> Any:
        """Per microbatch: each group gathered for forward and again for backward, its gradient reduce-scattered
        (``reduce_scatters``); the first group's gather has nothing to hide behind."""
        split = c.schedule in ZERO_BUBBLE and c.pp > 1
        key = (id(stages), c.dp, split)  # a rank's stages as the cost model keeps them (one list per layout)
        if key not in self.groups:  # (groups, their elements, reduce-scatter calls and elements)
            units = [u for st in stages for u in st]
            groups = zero3_groups(units, c.dp)
            self.groups[key] = (len(groups), sum(g.elements for g in groups), *reduce_scatters(units, c.dp, split))
        groups, gathered, calls, elements = self.groups[key]
        if not groups:
            return 0
        p, n = self.precision, c.dp
        gathered *= p.gather or p.param
        gather = ring_gather(gathered, n, link, groups)
        scatter = ring_scatter(elements * p.grad, n, link, calls)
        first = ring_gather(gathered / groups, n, link)
        return c.microbatches * (self._exposed(gather, forward, first) + self._exposed(gather + scatter, backward,
                                                                                       first))

    def _exposed(self, t: Any, window: Any, tail: Any) -> Any:
        """What of ``t`` seconds of communication shows beside ``window`` seconds of compute; ``tail`` never hides."""
        return largest([t - self.hide * window, tail, (1 - self.hide) * t])
