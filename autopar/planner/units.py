"""Numbers as a plan prints them, in the units people quote them in ("175B" parameters, MB, ms, TFLOP/s)."""
from __future__ import annotations

from autopar.planner.cluster import gb


def as_count(n: float) -> str:
    """1234567 -> "1.2M"; parameters, in the units people quote them."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f}{unit}" if n < 100 * scale else f"{n / scale:,.0f}{unit}"
    return f"{n:.0f}"


def as_rate(flops: float) -> str:
    return f"{flops / 1e12:.1f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.1f} GFLOP/s"


def as_bytes(n: float) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 1e6 else gb(n)


def as_seconds(t: float) -> str:
    return f"{t:.2f} s" if t >= 1 else f"{t * 1e3:.1f} ms" if t >= 1e-3 else f"{t * 1e6:.0f} us"
