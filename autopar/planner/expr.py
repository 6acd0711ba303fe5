"""The planner's quantities are floats, or sympy expressions in the microbatch size ``b`` (``symbolic=True``).

These helpers take either: the largest and smallest of a list (``sympy.Max``
and ``Min`` when any is symbolic) and a float for ordering.
"""
from __future__ import annotations

from typing import Any

import sympy

from autopar.planner.profile_formulas import b_sym


def number(x: Any, b: int = 1) -> float:
    """A float for ordering; a sympy expression is evaluated at microbatch size ``b`` (default 1)."""
    return float(x.xreplace({b_sym: b})) if isinstance(x, sympy.Basic) else float(x)


def largest(xs: list[Any]) -> Any:
    """The largest of ``xs`` (0 for none)."""
    if any(isinstance(x, sympy.Basic) for x in xs):
        return sympy.Max(*xs)
    return max(xs, default=0)


def smallest(xs: list[Any]) -> Any:
    if any(isinstance(x, sympy.Basic) for x in xs):
        return sympy.Min(*xs)
    return min(xs)
