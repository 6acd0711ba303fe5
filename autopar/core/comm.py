"""What a collective costs and which collectives a placement change performs: one model for solver and planner.

``LinkCost`` is the cost of communicating over one mesh axis: seconds =
``launch`` once per collective + per ring step (``latency`` + the step's bytes
/ ``bandwidth``), an all-gather's and a reduce-scatter's times scaled by
``gather`` and ``scatter``. The planner's ``Link`` produces one
(``Link.cost()``); the tensor-parallel solver takes one as ``cost=``.

The semantics of the named ops of ``autopar/core/collectives.py`` live here as
data, written once: ``OPS`` (per op, the collective it performs forward and
backward, the placement change it makes, the dims it takes, its name in the
plan) and ``conversion`` (the ops that turn one placement into another, read
off ``OPS``). The solver's costs, the lowering's inserted nodes, the plan's
collective counts and the planner's profile all read them.

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


@dataclass(frozen=True)
class CollectiveOp:
    """What one op of autopar/core/collectives.py does: its collectives, its arguments, its placement change."""

    forward: str | None  # the collective it performs forward (one of KINDS); None: none
    backward: str | None  # the collective its backward performs on the gradient; None: none
    before: str  # the placement kind it converts from ("partial", "replicate", "shard"); "": not a conversion
    after: str  # its output's placement kind; "same": its input's placement; a "shard" is on its last dim
    dims: tuple[str, ...] = ()  # the tensor dims it takes after (x, axis): the "src" or "dst" placement's dim
    role: str = ""  # how the plan's layer layout names it; "": not shown

    @property
    def sharded_output(self) -> bool:
        """Its output is this rank's piece of a tensor ``n`` times larger along one dim."""
        return self.after == "shard"

    def dim_args(self, src: Any, dst: Any) -> tuple[int, ...]:
        """The dims it takes after ``(x, axis)`` as a step of the conversion from ``src`` to ``dst``."""
        return tuple({"src": src, "dst": dst}[which].dim for which in self.dims)

    def placement_after(self, before: Any, dims: tuple[int, ...]) -> Any:
        """The placement of its output, given its input's placement and the dims it was called with."""
        if self.after == "shard":
            return Shard(dims[-1])
        return {"replicate": Replicate(), "partial": Partial(), "same": before}[self.after]


OPS: dict[str, CollectiveOp] = {
    "all_reduce": CollectiveOp("all_reduce", None, "partial", "replicate",  # identity backward
                               role="all-reduce forward (partial sums -> replicated)"),
    "grad_all_reduce": CollectiveOp(None, "all_reduce", "", "same",  # a Replicate input of sharded compute
                                    role="identity forward, all-reduce backward"),
    "all_gather": CollectiveOp("all_gather", None, "shard", "replicate", ("src",),  # local chunk backward
                               role="all-gather forward"),
    "chunk": CollectiveOp(None, "all_gather", "replicate", "shard", ("dst",),
                          role="keep local chunk, all-gather backward"),
    "reduce_scatter": CollectiveOp("reduce_scatter", "all_gather", "partial", "shard", ("dst",),
                                   role="reduce-scatter forward, all-gather backward"),
    # all_gather then grad_all_reduce as one op (sharded compute consumes the gathered value): the partial
    # gradient is reduce-scattered straight back to the shards
    "all_gather_rs": CollectiveOp("all_gather", "reduce_scatter", "", "replicate", ("src",),
                                  role="all-gather forward, reduce-scatter backward"),
    "to_partial": CollectiveOp(None, None, "replicate", "partial"),  # a bias added once: x on index 0, zeros elsewhere
    "all_reduce_max": CollectiveOp("all_reduce_max", None, "", "replicate"),  # in local replacements; no gradient
    "all_to_all": CollectiveOp("all_to_all", "all_to_all", "shard", "shard", ("src", "dst"),
                               role="all-to-all forward and backward (one sharded dim for another)"),
}


def _kind(placement: Any) -> str | None:
    for cls, kind in ((Partial, "partial"), (Replicate, "replicate"), (Shard, "shard")):
        if isinstance(placement, cls):
            return kind
    return None


def conversion(src: Any, dst: Any, grad: bool = False) -> tuple[str, ...] | None:
    """The ops (in order) that turn placement ``src`` into ``dst``; () when equal; None when none can.

    One op of ``OPS`` where one converts between the two kinds; otherwise two, through Replicate.
    ``grad``: the consumer computes sharded from a Replicate value, so its gradient arrives Partial and
    is summed over the axis on the way back (``grad_all_reduce``; after an all-gather, one op that
    reduce-scatters it straight to the shards: Megatron's sequence-parallel pair).
    """
    ops = _conversion(src, dst)
    if not grad or ops is None:
        return ops
    if ops[-1:] == ("all_gather",):
        return ops[:-1] + ("all_gather_rs",)
    return ops + ("grad_all_reduce",)


def _conversion(src: Any, dst: Any) -> tuple[str, ...] | None:
    if dst is None or src == dst:
        return ()
    kinds = (_kind(src), _kind(dst))
    for name, op in OPS.items():
        if op.before and (op.before, op.after) == kinds:
            return (name,)
    if None in kinds or "replicate" in kinds or kinds[0] == kinds[1]:
        return None
    return _conversion(src, Replicate()) + _conversion(Replicate(), dst)  # Shard -> Partial


def conversion_time(src: Any, dst: Any, nbytes: Any, n: int, cost: LinkCost, grad: bool = False) -> float:
    """Forward plus backward seconds to turn placement ``src`` into ``dst`` (``nbytes``: the whole tensor;
    ``grad``: as ``conversion``)."""
    ops = conversion(src, dst, grad)
    return float("inf") if ops is None else ops_time(ops, nbytes, n, cost)


def ops_time(ops: tuple[str, ...], nbytes: Any, n: int, cost: LinkCost) -> float:
    """Forward plus backward seconds of the ops of ``OPS`` named in ``ops`` (``nbytes``: the whole tensor)."""
    kinds = [kind for op in ops for kind in (OPS[op].forward, OPS[op].backward) if kind is not None]
    return sum((collective_time(kind, nbytes, n, cost) for kind in kinds), 0.0)
