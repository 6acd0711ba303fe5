"""The figures a cluster description holds, what each means, and the range it must lie in.

``Cluster`` and ``Link`` (``autopar/planner/cluster.py``) check their figures
against these tables when constructed (``check_figures``), so a description
with an impossible figure (zero bandwidth, zero peak FLOP/s, zero memory, a
node of no devices, a number that is not finite) fails where it is made, with
an error that names the field, its value, what it means and the range it
needs. The command line's ``--cluster FILE.json`` and ``--set FIELD=VALUE``
build through the same constructors.

Invariant: every numeric field of ``Cluster`` and ``Link`` has a row here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Figure:
    """One field's range: above ``low`` (or at least, with ``closed``), at most ``high``; what it means."""

    meaning: str
    low: float = 0.0
    closed: bool = False  # low itself allowed
    high: float | None = None
    integer: bool = False
    optional: bool = False  # None allowed

    def rule(self) -> str:
        kind = "an integer" if self.integer else "a number"
        low = f"{'>=' if self.closed else '>'} {self.low:g}"
        return f"{kind} {low}" + (f" and <= {self.high:g}" if self.high is not None else "")

    def allows(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.integer and value != int(value):
            return False
        return (value >= self.low if self.closed else value > self.low) and (self.high is None or value <= self.high)


LINK_FIGURES = {
    "bandwidth": Figure("bytes per second one device sends in one direction"),
    "latency": Figure("seconds of one message step", closed=True),
    "gather": Figure("an all-gather's time over the ring's"),
    "scatter": Figure("a reduce-scatter's time over the ring's"),
    "p2p_latency": Figure("seconds of a point-to-point message whose receiver has a core free (None: latency)",
                          closed=True, optional=True),
}

CLUSTER_FIGURES = {
    "devices_per_node": Figure("devices in one node", low=1, closed=True, integer=True),
    "memory": Figure("bytes of memory a device offers to training"),
    "peak_flops": Figure("dense FLOP/s of a device's mixed-precision (bf16) matmul units"),
    "peak_flops_fp32": Figure("dense FLOP/s of a device in fp32"),
    "efficiency": Figure("the fraction of peak that large matmuls reach", high=1.0),
    "compiled_efficiency": Figure("efficiency of inductor-compiled steps (0: not fitted, efficiency x the H100 "
                                  "fits' ratio)", high=1.0, closed=True),
    "narrow": Figure("the weight width at which a matmul reaches half of efficiency * peak", closed=True),
    "contention": Figure("the share of compute throughput a collective takes while it runs beside compute",
                         closed=True, high=1.0),
    "op_overhead": Figure("seconds each operator costs beyond its FLOPs", closed=True),
    "memory_bandwidth": Figure("bytes per second a device's memory streams"),
    "cores": Figure("CPU cores a node's ranks share (0: every device computes on its own)", closed=True,
                    integer=True),
}


def check_figures(owner: str, obj: Any, figures: dict[str, Figure]) -> None:
    """Raises a ``ValueError`` naming the first field of ``obj`` outside its range, its value, what it means and
    the range it needs."""
    for name, figure in figures.items():
        value = getattr(obj, name)
        if not figure.allows(value):
            raise ValueError(f"{owner}: {name}={value!r} must be {figure.rule()} ({figure.meaning}); give the "
                             f"device's real figure")
