"""What a collective costs and which collectives a placement change performs: one model for solver and planner.

``LinkCost`` is the cost of communicating over one mesh axis: seconds =
``launch`` once per collective + per ring step (``latency`` + the step's bytes
/ ``bandwidth``), an all-gather's and a reduce-scatter's times scaled by
``gather`` and ``scatter``. The planner's ``Link`` produces one
(``Link.cost()``); the tensor-parallel solver takes one as ``cost=``.

The semantics of the named ops of ``autopar/core/collectives.py`` live here as
data: ``OPS`` (the collective each op performs forward and backward) and
``conversion`` (the ops that turn one placement into another). Both the
solver's costs and the lowering's inserted nodes read them.

Sizes may be sympy expressions (the planner's symbolic microbatch size).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard

KINDS = ("all_reduce", "all_reduce_max", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class LinkCost:
    """Seconds of collectives on one axis: ``launch`` per call, ``latency`` per ring step, ``bandwidth`` bytes/s.

    ``gather`` and ``scatter``: how many times the ring's time an all-gather
    and a reduce-scatter take (1 for NCCL's rings; 2 charges a reduce-scatter
    as an all-reduce).
    """

    bandwidth: float
    latency: float = 0.0
    launch: float = 0.0
    gather: float = 1.0
    scatter: float = 1.0

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency < 0 or self.launch < 0 or self.gather <= 0 or self.scatter <= 0:
            raise ValueError(f"a link cost needs bandwidth > 0, latency and launch >= 0 and gather, scatter > 0; got "
                             f"{self.bandwidth} B/s, {self.latency} s, {self.launch} s, {self.gather}, {self.scatter}")


def collective_time(kind: str, nbytes: Any, n: int, cost: LinkCost, count: int = 1) -> Any:
    """Seconds of ``count`` collectives of ``kind`` moving ``nbytes`` (the whole tensor, all calls) over ``n`` ranks.

    Rings: an all-reduce takes 2(n-1) steps of 1/n of the bytes, an all-gather
    or reduce-scatter n-1; an all-to-all n-1 pairwise exchanges of 1/n^2.
    """
    if n <= 1:
        return 0
    if kind in ("all_reduce", "all_reduce_max"):
        t = 2 * (n - 1) * (count * cost.latency + nbytes / n / cost.bandwidth)
    elif kind == "all_gather":
        t = cost.gather * ((n - 1) * (count * cost.latency + nbytes / n / cost.bandwidth))
    elif kind == "reduce_scatter":
        t = cost.scatter * ((n - 1) * (count * cost.latency + nbytes / n / cost.bandwidth))
    elif kind == "all_to_all":
        t = (n - 1) * (count * cost.latency + nbytes / n / n / cost.bandwidth)
    else:
        raise ValueError(f"unknown collective {kind!r}; the kinds are {', '.join(KINDS)}")
    return count * cost.launch + t if cost.launch else t


def p2p_time(nbytes: Any, cost: LinkCost) -> Any:
    """Seconds of one point-to-point message."""
    return cost.launch + cost.latency + nbytes / cost.bandwidth


# op of autopar/core/collectives.py -> (collective forward, collective backward); None: no communication
OPS: dict[str, tuple[str | None, str | None]] = {
    "all_reduce": ("all_reduce", None),  # Partial -> Replicate; identity backward
    "grad_all_reduce": (None, "all_reduce"),  # identity forward; sums the partial gradient
    "all_gather": ("all_gather", None),  # Shard(d) -> Replicate; local chunk backward
    "chunk": (None, "all_gather"),  # Replicate -> Shard(d)
    "reduce_scatter": ("reduce_scatter", "all_gather"),  # Partial -> Shard(d)
    "to_partial": (None, None),  # Replicate -> Partial: x on index 0, zeros elsewhere
    "all_reduce_max": ("all_reduce_max", None),  # a max over ranks (no gradient flows through it)
    "all_to_all": ("all_to_all", "all_to_all"),  # Shard(a) -> Shard(b)
}
FORWARD = {op: fwd for op, (fwd, _) in OPS.items()}
BACKWARD = {op: bwd for op, (_, bwd) in OPS.items()}


def conversion(src: Any, dst: Any) -> tuple[str, ...] | None:
    """The ops (in order) that turn placement ``src`` into ``dst``; () when equal; None when none can."""
    if dst is None or src == dst:
        return ()
    if isinstance(src, Partial) and isinstance(dst, Replicate):
        return ("all_reduce",)
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return ("all_gather",)
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return ("chunk",)
    if isinstance(src, Partial) and isinstance(dst, Shard):
        return ("reduce_scatter",)
    if isinstance(src, Replicate) and isinstance(dst, Partial):
        return ("to_partial",)
    if isinstance(src, Shard) and isinstance(dst, Shard):
        return ("all_to_all",)
    if isinstance(src, Shard) and isinstance(dst, Partial):
        return ("all_gather", "to_partial")  # through Replicate
    return None


def conversion_time(src: Any, dst: Any, nbytes: Any, n: int, cost: LinkCost) -> float:
    """Forward plus backward seconds to turn placement ``src`` into ``dst`` (``nbytes``: the whole tensor)."""
    ops = conversion(src, dst)
    if ops is None:
        return float("inf")
    kinds = [kind for op in ops for kind in OPS[op] if kind is not None]
    return sum((collective_time(kind, nbytes, n, cost) for kind in kinds), 0.0)
