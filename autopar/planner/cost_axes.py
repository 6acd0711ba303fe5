"""The context- and expert-parallel part of ``CostModel`` (``cost_model.py``): a segment's values on one cp rank
and with its routed experts at ``ep``, and the seconds and bytes of the cp ring (or its all-to-alls) and of the
ep all-to-alls on the links their groups span. The formulas are ``context_cost.py``'s and ``expert_cost.py``'s.
"""
from __future__ import annotations

from typing import Any

from autopar.planner.config import Config
from autopar.planner.context_cost import (heads_exchange_seconds, heads_exchange_step, ring_seconds, ring_step,
                                          sharded, usp_seconds, usp_step)
from autopar.planner.expert_cost import all_to_all_seconds, all_to_all_step, expert_elements, routed
from autopar.planner.segment_values import SegmentValues


class ContextExpertCosts:
    """``CostModel``'s cp and ep methods; they read its ``experts``, ``imbalance``, ``cluster``, ``precision``,
    ``seq_len``, caches (``_per_stage``, ``_per_rank``) and ``_rank_units``."""

    def _routed(self, values: SegmentValues, ep: int, b: Any) -> SegmentValues:
        """A segment's values with its routed experts as they run at ``ep`` (``experts.routed``; one object per
        segment values and ep, so that alike stages stay alike)."""
        if self.experts is None:
            return values
        key = ("routed", id(values), ep)
        if key not in self._per_stage:
            self._per_stage[key] = routed(values, self.experts, ep, self.imbalance, b * self.seq_len)
        return self._per_stage[key]

    def _sharded(self, values: SegmentValues, cp: int) -> SegmentValues:
        """A segment's values on one cp rank (``context_cost.sharded``; one object per segment values and cp)."""
        key = ("cp", id(values), cp)
        if key not in self._per_stage:
            self._per_stage[key] = sharded(values, cp)
        return self._per_stage[key]

    def ring_exchanges(self, config: Config, rank: int = 0) -> tuple[int, int, Any]:
        """(attentions, exchanges, bytes) of the cp ring (or all-to-alls) pp rank ``rank`` sends in one step
        (``context_cost.ring_step``, ``heads_exchange_step``, ``usp_step``); zeros without cp."""
        units = [u for st in self._rank_units(config, config.microbatch_size)[rank] for u in st]
        if config.cp_split:
            return usp_step(units, config.cp_split, config.microbatches)
        step = heads_exchange_step if config.cp_attention == "all_to_all" else ring_step
        return step(units, config.cp, config.microbatches)

    def _ring_seconds(self, c: Config, stages: list[list[SegmentValues]]) -> Any:
        """Exposed seconds of one microbatch's cp ring on a rank holding ``stages``, on the link its cp group
        spans (``cp`` ranks ``pp * tp`` apart: ``cp * pp * tp`` consecutive ranks)."""
        if c.cp == 1:
            return 0
        units, link = [u for st in stages for u in st], self.cluster.link(c.cp * c.pp * c.tp)
        if c.cp_attention == "all_to_all":
            return heads_exchange_seconds(units, c.cp, link)
        flops_per_s = self.cluster.peak(self.precision.name) * self.cluster.efficiency
        if c.cp_split:  # the all-to-all groups: cp_a2a consecutive cp ranks, pp * tp apart
            return usp_seconds(units, c.cp_split, (link, self.cluster.link(c.cp_a2a * c.pp * c.tp)), flops_per_s)
        return ring_seconds(units, c.cp, link.p2p(), flops_per_s)

    def expert_all_to_all(self, config: Config, rank: int = 0) -> tuple[int, Any]:
        """(calls, bytes) of the ep all-to-alls pp rank ``rank`` sends in one step, its own rows included
        (``expert_cost.all_to_all_step``); (0, 0) without ep."""
        if self.experts is None or config.ep == 1:
            return 0, 0
        units = [u for st in self._rank_units(config, config.microbatch_size)[rank] for u in st]
        return all_to_all_step(units, self.experts, config, self.seq_len, self.precision.activation)

    def _all_to_all_seconds(self, c: Config, stages: list[list[SegmentValues]]) -> Any:
        """Seconds of one microbatch's ep all-to-alls on a rank holding ``stages``, on the link its ep group
        spans (``ep`` consecutive dp ranks: ``ep * pp * tp`` ranks; ``expert_cost.all_to_all_seconds``)."""
        if self.experts is None or c.ep == 1:
            return 0
        return all_to_all_seconds([u for st in stages for u in st], self.experts, c, self.seq_len,
                                  self.precision.activation, self.cluster.link(c.ep * c.pp * c.tp), self.imbalance)

    def _expert_elements(self, stages: list[list[SegmentValues]]) -> tuple[int, int]:
        """``expert_cost.expert_elements`` of a rank's stages."""
        key = ("expert state", id(stages))
        if key not in self._per_rank:
            self._per_rank[key] = expert_elements([u for st in stages for u in st], self.experts)
        return self._per_rank[key]
