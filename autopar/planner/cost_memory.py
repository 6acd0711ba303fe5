"""Memory per device of one configuration: the part of ``CostModel`` (``cost_model.py``) that adds up its
training state (ZeRO's formulas, experts' state over the ranks holding them), the activations a rank keeps
(per stage and recomputation mode, times the microbatches in flight of its schedule) and its buffers (the
gathered ZeRO-3 layers, the gradient bucket, the received pipeline activations).
"""
from __future__ import annotations

from typing import Any

from autopar.planner import recompute_cost
from autopar.planner.config import ZERO_BUBBLE, Config
from autopar.planner.expr import largest, smallest
from autopar.planner.memory_formulas import state_bytes
from autopar.planner.segment_values import SegmentValues


class MemoryAccount:
    """``CostModel``'s memory methods; they read its ``precision``, ``states``, ``bucket_bytes``,
    ``recompute_collectives`` and caches (``_per_rank``, ``_per_stage``) and its ``_state_elements`` /
    ``_expert_elements``."""

    def _memory(self, c: Config, stages: list[list[SegmentValues]], rank: int) -> dict[str, Any]:
        total, trainable = self._state_elements(stages)
        state = state_bytes(total, trainable, self.precision, self.states, zero=c.zero, dp=c.zero_ranks)
        if c.ep > 1 and c.zero:  # ZeRO shards an expert's state over the dp / ep ranks that hold that expert
            ex_total, ex_trainable = self._expert_elements(stages)
            over_dp = state_bytes(ex_total, ex_trainable, self.precision, self.states, zero=c.zero, dp=c.zero_ranks)
            over_holders = state_bytes(ex_total, ex_trainable, self.precision, self.states, zero=c.zero,
                                       dp=c.zero_ranks // c.ep)
            state = {k: v - over_dp[k] + over_holders[k] for k, v in state.items()}
        return {**state, "activations": self._activations(c, stages, rank),
                "buffers": self._buffers(c, stages, trainable)}

    def _activations(self, c: Config, stages: list[list[SegmentValues]], rank: int) -> Any:
        """Activation bytes on pp rank ``rank``: kept per stage (``recompute_cost``) x microbatches in flight."""
        kept, first, most, rebuilt = self._kept(c, stages)
        if c.pp == 1:
            held = first  # microbatches run one after another (gradient accumulation)
        elif c.schedule == "gpipe":
            held = kept * c.microbatches
        elif c.schedule in ZERO_BUBBLE:  # every rank holds up to p microbatches (a W keeps its activations)
            held = kept * min(c.pp, c.microbatches)
            if c.schedule == "dualpipev":  # and one more microbatch-stage (2p + 1 of its 2p stages' halves)
                held += most
        elif c.stages_per_rank == 1:
            held = first * self._in_flight(c, rank)
        else:  # interleaved: chunks, each a 1/v share of the rank's layers
            held = kept / c.stages_per_rank * self._in_flight(c, rank)
        return held + rebuilt

    @staticmethod
    def _in_flight(c: Config, rank: int) -> int:
        """Where it depends on the pp rank: how many microbatches (1F1B) or chunks (interleaved: the warm-up
        forwards) pp rank ``rank`` holds the activations of at once; 0 where every rank holds as many."""
        if c.pp == 1 or c.schedule == "gpipe" or c.schedule in ZERO_BUBBLE:
            return 0
        if c.stages_per_rank == 1:
            return min(c.pp - rank, c.microbatches)
        v = c.stages_per_rank
        return min((c.pp - rank - 1) * 2 + (v - 1) * c.pp + 1, c.microbatches * v)

    def _kept(self, c: Config, stages: list[list[SegmentValues]]) -> tuple[Any, Any, Any, Any]:
        """Bytes a rank's stages keep per microbatch (``recompute_cost.kept``, with the bf16 weight copies
        autograd saves of the layers not recomputed; ZeRO-3 gathers its own): summed, the first stage's, the
        most of one stage; and what one recomputed layer rebuilds (``recompute_cost.rebuilt``)."""
        key = ("kept", id(stages), c.recompute, c.full_layers, c.zero == 3)
        if key not in self._per_rank:
            per_stage = [self._kept_stage(c, st) for st in stages]
            rebuilt = recompute_cost.rebuilt([m for st in stages for m in c.layer_modes(st)],
                                             [u for st in stages for u in st],
                                             recompute_collectives=self.recompute_collectives)
            self._per_rank[key] = (sum(per_stage), per_stage[0], largest(per_stage), rebuilt)
        return self._per_rank[key]

    def _kept_stage(self, c: Config, st: list[SegmentValues]) -> Any:
        key = ("kept", id(st), c.recompute, c.full_layers, c.zero == 3)
        if key not in self._per_stage:
            modes = c.layer_modes(st)
            copies = 0 if c.zero == 3 or not self.precision.copy else self.precision.copy * sum(
                sum(u.params.values()) for u, m in zip(st, modes) if m == "none")
            self._per_stage[key] = recompute_cost.kept(modes, st, recompute_collectives=self.recompute_collectives) \
                + copies
        return self._per_stage[key]

    def _buffers(self, c: Config, stages: list[list[SegmentValues]], trainable: int) -> Any:
        p = self.precision
        key = ("buffers", id(stages), c.zero_prefetch)
        if key not in self._per_rank:
            sizes = sorted((sum(u.params.values()) for st in stages for u in st), reverse=True)
            self._per_rank[key] = (
                sum(sizes[: 1 + c.zero_prefetch]) * (p.gather or p.param),  # ZeRO-3: the layer in use, prefetched
                smallest([self.bucket_bytes, trainable * p.grad]),  # below: the gradient bucket being reduced
                sum(2 * st[0].entering for st in stages))  # pipelines: a received activation and gradient per stage
        gathered, bucket, received = self._per_rank[key]
        out: Any = 0
        if c.dp_cp > 1:
            out += gathered if c.zero == 3 else bucket
        if c.pp > 1:
            out += received
        return out
