"""Pinned tests of the view and getitem strategies. The shape ops' ground-truth cases are
in ``harness/cases/shape.py``; ``test_sharding_rules.py`` runs them.
"""

from __future__ import annotations

import operator

import torch
from torch.distributed.tensor import Shard

from harness.rules import F64, R, aten, check_op, has, seeded


# ---------------------------------------------------------------------------
# The strategies that matter, pinned down.


def test_view_keeps_heads_sharded() -> None:
    x = torch.randn(2, 5, 4 * 3, dtype=F64)  # (B, S, H*D) with H=4, D=3
    found = check_op(aten.view.default, (x, [2, 5, 4, 3]), {}, 2, seeded())
    has(found, (Shard(2),), Shard(2))
    x = torch.randn(2, 5, 3 * 4, dtype=F64)  # H=3 does not divide by 2 although H*D does
    found = check_op(aten.view.default, (x, [2, 5, 3, 4]), {}, 2, seeded())
    assert not [s for s in found if s.inputs == (Shard(2),)]
    found = check_op(aten.view.default, (torch.randn(2, 5, 4, 3, dtype=F64), [2, 5, -1]), {}, 2, seeded())
    has(found, (Shard(2),), Shard(2))


def test_getitem_reads_only_its_element() -> None:
    parts = torch.split(torch.randn(6, 4, dtype=F64), [2, 4])
    found = check_op(operator.getitem, (parts, 1), {}, 2, seeded())
    has(found, (None, Shard(0)), Shard(0))
    assert found[0].inputs == (None, R)
