"""One way to run a training step, as the planner names it: mesh, ZeRO stage, schedule, microbatches, recomputation.

Hybrid sharding (``dp_shard``): ZeRO shards over ``dp_shard`` of the dp ranks
(one replica) and the ``dp // dp_shard`` replicas all-reduce their shards'
gradients once per step, as ``Mesh(dp=(replicate, shard))`` runs it (docs/zero.md).

Recomputation is one mode for every layer (``recompute``), or Megatron-LM's
mix: the first ``full_layers`` layers of every pipeline stage recompute fully
and the others use ``recompute`` ("none" or "selective"), so that only as
many layers as needed pay for a whole forward again.

Invariant: a ``Config`` is valid when constructed; ``layer_modes`` gives each
segment of a stage the mode the runtime runs it with (``autopar.core.recompute_modes``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from autopar.options import FIXED_STAGES_PER_RANK, SCHEDULES

SCHEDULE_NAMES = SCHEDULES  # autopar.options: the schedules autopar runs
ZERO_BUBBLE = ("zb-h1", "zbv", "dualpipev")  # backwards split into B and W (bubble: simulated, `bubble.Bubbles`)
V_SHAPED = tuple(FIXED_STAGES_PER_RANK)  # two stages per rank in a V (autopar.core.zero_bubble.v_placement)
RECOMPUTE = ("none", "selective", "full")  # autopar.core.recompute_modes.MODES
MIXED_WITH = ("none", "selective")  # the modes the layers a mix does not recompute fully run with


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
    full_layers: int = 0  # with recompute "none" or "selective": the first this many layers of each stage "full"
    sequence_parallel: bool = False  # tp > 1: the values between tensor-parallel regions sharded too
    dp_shard: int = 0  # hybrid sharding: ZeRO over this many dp ranks, dp // dp_shard replicas; 0: over all of dp
    ep: int = 1  # expert parallelism folded onto dp: routed experts spread over groups of ep consecutive dp ranks
    cp: int = 1  # context parallelism: its own axis (Mesh(dp=, cp=)); each cp rank holds 1/cp of every sequence
    cp_attention: str = "ring"  # cp > 1: "ring", "all_to_all" (heads for sequence; tp = 1) or "usp" (both; tp = 1)
    cp_a2a: int = 0  # cp_attention="usp": the all-to-all groups' size, a divisor of cp (ring = cp // cp_a2a)

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "stages_per_rank", "microbatches", "microbatch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero={self.zero} must be 0, 1, 2 or 3")
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(f"unknown schedule {self.schedule!r}; the schedules are {', '.join(SCHEDULE_NAMES)}")
        if self.schedule in V_SHAPED and self.stages_per_rank != 2:
            raise ValueError(f"schedule={self.schedule!r} holds 2 stages per rank, got stages_per_rank="
                             f"{self.stages_per_rank}")
        if self.stages_per_rank > 1 and self.schedule not in ("interleaved-1f1b", *V_SHAPED):
            raise ValueError(f"stages_per_rank={self.stages_per_rank} needs schedule='interleaved-1f1b'")
        object.__setattr__(self, "recompute", {True: "full", False: "none"}.get(self.recompute, self.recompute))
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r} must be one of {', '.join(RECOMPUTE)}")
        if not isinstance(self.full_layers, int) or self.full_layers < 0:
            raise ValueError(f"full_layers={self.full_layers!r} must be an integer >= 0")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel=True shards values over the tp axis; it needs tp > 1")
        if self.dp_shard and (self.zero == 0 or not 1 < self.dp_shard < self.dp or self.dp % self.dp_shard):
            raise ValueError(f"dp_shard={self.dp_shard} (hybrid sharding) needs zero >= 1 (got {self.zero}) and a "
                             f"shard size between 2 and dp={self.dp} that divides it; use dp_shard=0 for ZeRO over "
                             "all of dp")
        if self.ep < 1 or self.dp % self.ep:
            raise ValueError(f"ep={self.ep} folds onto dp={self.dp}: it must be a divisor of dp")
        if self.cp < 1 or (self.cp > 1 and (self.dp_shard or self.ep > 1)):
            raise ValueError(f"cp={self.cp} must be >= 1; with cp > 1 the planner models neither hybrid sharding "
                             f"(dp_shard={self.dp_shard}) nor expert parallelism (ep={self.ep})")
        if self.cp_attention not in ("ring", "all_to_all", "usp") or (self.cp_attention != "ring" and (
                self.cp == 1 or self.tp > 1)):
            raise ValueError(f"cp_attention={self.cp_attention!r} must be 'ring', 'all_to_all' or 'usp' (the last "
                             f"two with cp > 1 and tp = 1; got cp={self.cp}, tp={self.tp})")
        usp = self.cp_attention == "usp"
        if usp != bool(self.cp_a2a) or (usp and not (1 < self.cp_a2a < self.cp and self.cp % self.cp_a2a == 0)):
            fits = [a for a in range(2, self.cp) if self.cp % a == 0]
            raise ValueError(f"cp_a2a={self.cp_a2a} with cp_attention={self.cp_attention!r} and cp={self.cp}: usp "
                             f"splits cp into a ring of all-to-all groups, ring x cp_a2a = cp with both above 1 "
                             f"(cp_a2a in {fits}); other forms take cp_a2a=0")
        if self.full_layers and self.recompute not in MIXED_WITH:
            raise ValueError(f"full_layers={self.full_layers} mixes full recomputation with recompute='none' or "
                             f"'selective' for the other layers, not {self.recompute!r}; use full_layers=0")

    @property
    def devices(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    @property
    def cp_split(self) -> tuple[int, int] | None:
        """``cp_attention="usp"``: (ring, a2a) sizes of cp, as ``Mesh(cp=(ring, a2a))`` spells them; else None."""
        return (self.cp // self.cp_a2a, self.cp_a2a) if self.cp_a2a else None

    @property
    def dp_cp(self) -> int:
        """The ranks that average gradients and the loss: dp x cp (cp ranks hold parts of the same sequences)."""
        return self.dp * self.cp

    @property
    def zero_ranks(self) -> int:
        """The ranks ZeRO divides by: the shard size under hybrid sharding, else all of dp x cp (with context
        parallelism ZeRO shards over dp x cp, as torchtitan's FSDP over ``dp_shard_cp``)."""
        return self.dp_shard or self.dp_cp

    @property
    def replicas(self) -> int:
        """Replicas of the ZeRO shards whose gradients are all-reduced once per step (1 without hybrid sharding)."""
        return self.dp_cp // self.zero_ranks

    def dp_label(self) -> str:
        """``"8"``, or under hybrid sharding the mesh's spelling ``"(2, 4)"``: replicas, shards."""
        return f"({self.replicas}, {self.dp_shard})" if self.dp_shard else str(self.dp)

    @property
    def global_batch(self) -> int:
        return self.dp * self.microbatches * self.microbatch_size

    @property
    def recomputes(self) -> bool:
        """Whether any layer is recomputed."""
        return self.recompute != "none" or self.full_layers > 0

    @property
    def recompute_order(self) -> tuple[int, int]:
        """Orders configurations by how much they recompute: none, mixes of it, selective, its mixes, full."""
        return RECOMPUTE.index(self.recompute), self.full_layers

    def recompute_label(self) -> str:
        """``"selective"``, or a mix: ``"full on 3 layers per stage, selective on the rest"``."""
        if not self.full_layers:
            return self.recompute
        n = self.full_layers
        return f"full on {n} layer{'s' * (n > 1)} per stage, {self.recompute} on the rest"

    def layer_modes(self, units: Sequence[Any]) -> list[str]:
        """The mode of each of one stage's segments, in order (each has a ``kind``): the first ``full_layers``
        layers ``"full"``, every other segment ``recompute``."""
        out, layers = [], 0
        for u in units:
            out.append("full" if u.kind == "layer" and layers < self.full_layers else self.recompute)
            layers += u.kind == "layer"
        return out

    def describe(self) -> str:
        sp = " sequence-parallel" if self.sequence_parallel else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        form = {"all_to_all": "/a2a", "usp": "/usp"}.get(self.cp_attention, "")
        cp = f" cp={self.cp_split or self.cp}{form}" if self.cp > 1 else ""
        mesh = f"dp={self.dp_label()}{ep}{cp} pp={self.pp} tp={self.tp}{sp}"
        v = f"/v={self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        sched = "" if self.pp == 1 else f" {self.schedule}{v}"
        return (f"{mesh} zero={self.zero}{sched} m={self.microbatches}x{self.microbatch_size}"
                + (f" recompute={self.recompute_label()}" if self.recomputes else ""))
