"""The ground-truth cases of every sharding rule: one table per family of ops, as in
``passes.rules``, merged here once (an op with two cases is an error)."""

from __future__ import annotations

from typing import Any

from harness.cases import nn, ops, shape
from harness.rules import Case


def _merge(*tables: dict[Any, Case]) -> dict[Any, Case]:
    merged: dict[Any, Case] = {}
    for table in tables:
        twice = merged.keys() & table.keys()
        assert not twice, f"ops with two cases: {sorted(map(str, twice))}"
        merged.update(table)
    return merged


CASES: dict[Any, Case] = _merge(ops.CASES, shape.CASES, nn.CASES)
