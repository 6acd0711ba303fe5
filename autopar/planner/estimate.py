"""What the cost model says of one configuration: memory per device, the step's parts, each axis's links.

Invariant: ``Estimate.step_time`` is the sum of ``Estimate.time``'s parts.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import sympy

from autopar.planner.config import Config
from autopar.planner.expr import number
from autopar.planner.model_profile import b_sym


@dataclass(frozen=True)
class AxisLinks:
    """One mesh axis's communication in a step: its link, seconds the link was busy, seconds of it that showed
    (compute waited for it), and the seconds compute lost running beside it."""

    link: str  # "intra" (inside a node) or "inter"
    bandwidth: float
    busy: float
    exposed: float
    contention: float = 0.0

    @property
    def hidden(self) -> float:
        return max(self.busy - self.exposed, 0.0)


@dataclass
class Estimate:
    """Memory per device (worst rank, bytes) and step time (seconds) of a ``Config``; sympy when symbolic."""

    config: Config
    memory: dict[str, Any]  # parameters, gradients, optimizer, activations, buffers
    time: dict[str, Any] | None  # compute, tensor_parallel, pipeline_p2p, bubble, shared_cores, data_parallel,
    # contention, optimizer; None when estimated without (``CostModel.estimate(timed=False)``)
    worst_rank: int  # the pp index whose memory is largest
    per_rank: list[dict[str, Any]]  # memory of every pp index (dp and tp ranks of one pp index are alike)
    stages: list[list[str]]  # segment names of each pipeline stage
    model_flops: float  # FLOPs of one step of the model itself (3 x forward), not counting recomputation
    seq_len: int
    links: dict[str, AxisLinks] = dataclasses.field(default_factory=dict)  # per mesh axis, when timed

    @property
    def total_memory(self) -> Any:
        return sum(self.memory.values())

    @property
    def step_time(self) -> Any:
        return sum(self.time.values())

    @property
    def tokens_per_s(self) -> float:
        return self.config.global_batch * self.seq_len / self.step_time

    @property
    def flops_per_device(self) -> float:
        """Model FLOP/s per device (what MFU compares with the peak)."""
        return self.model_flops / self.step_time / self.config.devices


def axis_links(c: Config, cluster: Any, time: dict[str, Any], serial: Any, dp: Any,
               pp_busy: Any = None) -> dict[str, AxisLinks]:
    """Each mesh axis's ``AxisLinks`` in a step of ``c`` whose parts are ``time``: ``serial`` seconds of dp
    collectives that never overlap and the simulated ``dp_comm.Exposure`` ``dp`` of the others; ``pp_busy``
    the seconds the pipeline's transfers keep its link busy (default: what the step shows of them). Under hybrid
    sharding dp is two axes: ``dp_shard`` (ZeRO's collectives) and ``dp_replicate`` (the all-reduces across
    replicas, beside the rest of backward; exposed what the step runs on after everything else). A group of ranks spread over ``span`` consecutive ranks runs
    inside a node where ``span`` fits one."""
    tp, tp_pp = c.tp, c.tp * c.pp
    rows = [("dp_shard" if c.dp_shard else "dp", c.zero_ranks, c.zero_ranks * tp_pp, serial + dp.busy - dp.replicate,
             time["data_parallel"] - dp.replicate_exposed, dp.contention)]
    if c.dp_shard:
        rows.append(("dp_replicate", c.replicas, c.devices, dp.replicate, dp.replicate_exposed, 0.0))
    rows += [("tp", c.tp, tp, time["tensor_parallel"], time["tensor_parallel"], 0.0),
             ("pp", c.pp, tp_pp, time["pipeline_p2p"] if pp_busy is None else pp_busy, time["pipeline_p2p"], 0.0)]
    return {axis: AxisLinks("intra" if span <= cluster.devices_per_node else "inter", cluster.link(span).bandwidth,
                            float(busy), float(exposed), float(extra))
            for axis, size, span, busy, exposed, extra in rows if size > 1}


def largest_fitting(total: Any, memory: float) -> int:
    """The largest microbatch size ``b`` at which the memory expression ``total`` fits ``memory`` (0 when none).

    Memory is linear in ``b`` unless a term saturates (a bucket, a max over layers): then it is solved
    exactly, else searched on the expression.
    """
    try:
        poly = sympy.Poly(total, b_sym)
    except sympy.PolynomialError:
        poly = None
    if poly is not None and poly.degree() == 1:
        slope, const = (float(x) for x in poly.all_coeffs())
        return max(0, math.floor((memory - const) / slope)) if slope > 0 else 0
    lo, hi = 0, 1
    while number(total.xreplace({b_sym: hi})) <= memory and hi < 2**20:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if number(total.xreplace({b_sym: mid})) <= memory else (lo, mid)
    return lo
