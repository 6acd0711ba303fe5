"""Seconds of collectives and point-to-point messages over a ``Link``: ring algorithms, latency + bytes / bandwidth.

Sizes may be sympy expressions (the planner's symbolic microbatch size).
"""
from __future__ import annotations

from typing import Any


def ring_all_reduce(nbytes: Any, n: int, link: Any, count: int = 1) -> Any:
    """Seconds of ``count`` ring all-reduces moving ``nbytes`` in all over ``n`` ranks: 2(n-1) steps each."""
    return 0 if n <= 1 else 2 * (n - 1) * (count * link.latency + nbytes / n / link.bandwidth)


def ring_steps(nbytes: Any, n: int, link: Any, count: int) -> Any:
    """Seconds of ``count`` rings of n-1 steps over ``nbytes`` whole tensors: an all-gather's or a reduce-scatter's."""
    return 0 if n <= 1 else (n - 1) * (count * link.latency + nbytes / n / link.bandwidth)


def ring_gather(nbytes: Any, n: int, link: Any, count: int = 1) -> Any:
    return link.gather * ring_steps(nbytes, n, link, count)


def ring_scatter(nbytes: Any, n: int, link: Any, count: int = 1) -> Any:
    return link.scatter * ring_steps(nbytes, n, link, count)


def p2p(nbytes: Any, link: Any) -> Any:
    return link.latency + nbytes / link.bandwidth


def collective(op: str, nbytes: Any, n: int, link: Any) -> Any:
    if op in ("all_reduce", "all_reduce_max"):
        return ring_all_reduce(nbytes, n, link)
    if op == "all_to_all":  # n-1 pairwise exchanges of 1/n^2 of the whole tensor each
        return 0 if n <= 1 else (n - 1) * (link.latency + nbytes / n / n / link.bandwidth)
    return ring_scatter(nbytes, n, link) if op == "reduce_scatter" else ring_gather(nbytes, n, link)
