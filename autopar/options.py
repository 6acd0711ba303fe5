"""The parallelization options, validated once."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from autopar.core.mesh import Mesh
from autopar.core.recompute_modes import Choice, check_choice
from autopar.core.schedules import SCHEDULES as GENERATORS
from autopar.core.schedules import STAGES_PER_RANK, stages_per_rank
from autopar.precision import Policy, policy

SCHEDULES = tuple(GENERATORS)  # the schedule names (autopar.core.schedules)
FIXED_STAGES_PER_RANK = STAGES_PER_RANK  # (the V holds two stages on every rank)
CP_ATTENTIONS = ("ring", "all_to_all", "usp")  # how context parallelism computes attention (passes/context_parallel.py)


@dataclass(frozen=True)
class Options:
    loss_fn: Callable[[Any, Any], Any] | None = None
    optimizer: Callable[[list], Any] | None = None
    zero: int = 0
    zero_prefetch: int = 1  # zero=3: layers gathered ahead of use (0: gather each layer only when it is used)
    schedule: str = "1f1b"
    microbatches: int = 1
    bucket_mb: float = 25.0  # data-parallel gradient bucket size, MiB, after a 1 MiB first bucket (as DDP)
    split_points: tuple[str, ...] | None = None  # module names to cut pipeline stages before (None: automatic)
    stages_per_rank: int | None = None  # pipeline stages per pp rank (default 2 for interleaved-1f1b, else 1)
    max_grad_norm: float | None = None  # clip gradients to this global 2-norm before each optimizer step
    precision: str = "fp32"  # "fp32": the model's own dtype; "bf16": fp32 masters, bf16 compute; "mixed": bf16
    # parameters and gradients, fp32 masters in the optimizer (autopar/precision.py)
    reduce_dtype: Any = None  # dtype of gradient reductions over dp (None: "fp32" under "bf16", "bf16" under "mixed")
    recompute: Choice = "none"  # "none" | "selective" | "full", {layer or pattern: mode}, or layer -> mode
    sequence_parallel: bool = False  # tp: shard the values between tensor-parallel regions (least activations)
    batch: str = "global"  # "global": every rank passes the global batch; "local": each its dp shard
    cp_attention: str = "ring"  # cp > 1: "ring" (K/V blocks around the ranks), "all_to_all" (heads for sequence)
    # or "usp" (both, on the sub-axes of Mesh(cp=(ring, a2a)))
    compile: bool = False  # each rank's graphs through inductor (passes/inductor_regions.py), the optimizer fused

    def __post_init__(self) -> None:
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero={self.zero!r} must be 0, 1, 2 or 3")
        if not isinstance(self.zero_prefetch, int) or self.zero_prefetch < 0:
            raise ValueError(f"zero_prefetch={self.zero_prefetch!r} must be an integer >= 0 (layers gathered ahead)")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; the schedules are {', '.join(SCHEDULES)}")
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches={self.microbatches!r} must be an integer >= 1")
        stages_per_rank(self.schedule, self.stages_per_rank)  # raises for a number the schedule cannot place
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm!r} must be > 0 (or None: no clipping)")
        if self.batch not in ("global", "local"):
            raise ValueError(f"batch={self.batch!r} must be 'global' (every rank passes the global batch) or 'local' "
                             f"(each data-parallel rank passes its shard)")
        if self.cp_attention not in CP_ATTENTIONS:
            raise ValueError(f"cp_attention={self.cp_attention!r} must be one of {', '.join(CP_ATTENTIONS)}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile={self.compile!r} must be True (each rank's graphs through inductor) or False")
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb={self.bucket_mb} must be > 0")
        object.__setattr__(self, "recompute", check_choice(self.recompute))  # a mapping is kept as (key, mode) pairs
        policy(self.precision, self.reduce_dtype)  # raises on an unknown or unsupported precision

    @property
    def policy(self) -> Policy | None:
        """The mixed-precision policy (None: the model's own dtype)."""
        return policy(self.precision, self.reduce_dtype)

    @property
    def virtual_stages(self) -> int:
        """Stages per pipeline rank."""
        return stages_per_rank(self.schedule, self.stages_per_rank)

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)


@dataclass(frozen=True)
class Parallelism:
    """One parallel configuration, as the planner chooses it (``Candidate.parallelism``): ``parallelize(model,
    parallelism)`` runs it, its fields replacing the keyword arguments of the same names (``recompute`` and
    ``sequence_parallel`` only where those are not given)."""

    mesh: Mesh
    zero: int = 0
    schedule: str = "1f1b"
    microbatches: int = 1
    stages_per_rank: int | None = None  # None: the schedule's default
    precision: str = "fp32"
    recompute: Choice = "none"
    sequence_parallel: bool = False
    cp_attention: str = "ring"
    compile: bool = False  # each rank's graphs through inductor (planned with the cluster's compiled efficiency)
