"""Seconds of collectives and point-to-point messages over a planner ``Link``, by ``autopar.core.comm``'s model.

Sizes may be sympy expressions (the planner's symbolic microbatch size).
"""
from __future__ import annotations

from typing import Any

from autopar.core.comm import collective_time, p2p_time
from autopar.planner.cluster import Link


def ring_all_reduce(nbytes: Any, n: int, link: Link, count: int = 1) -> Any:
    """Seconds of ``count`` ring all-reduces moving ``nbytes`` in all over ``n`` ranks: 2(n-1) steps each."""
    return collective_time("all_reduce", nbytes, n, link.cost(), count)


def ring_gather(nbytes: Any, n: int, link: Link, count: int = 1) -> Any:
    """Seconds of ``count`` all-gathers of ``nbytes`` whole tensors in all: n-1 ring steps each."""
    return collective_time("all_gather", nbytes, n, link.cost(), count)


def ring_scatter(nbytes: Any, n: int, link: Link, count: int = 1) -> Any:
    """Seconds of ``count`` reduce-scatters of ``nbytes`` whole tensors in all: n-1 ring steps each."""
    return collective_time("reduce_scatter", nbytes, n, link.cost(), count)


def p2p(nbytes: Any, link: Link) -> Any:
    return p2p_time(nbytes, link.cost())


def collective(op: str, nbytes: Any, n: int, link: Link) -> Any:
    return collective_time(op, nbytes, n, link.cost())
