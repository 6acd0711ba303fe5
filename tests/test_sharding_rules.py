"""Ground truth for ``passes.rules``: every strategy of every rule, on real tensors.

For each op in ``RULES`` hypothesis draws shapes (dims that divide by n and
dims that do not, n in {2, 3, 4}) and arguments with the op's case from
``harness.cases``, and ``harness.rules.check_op`` runs every strategy over a
simulated group of n ranks, comparing each rank's result with its part of the
op's result on the full tensors. The pinned tests of the strategies that matter
are in ``test_sharding_rules_nn.py`` (matmul, pointwise and nn ops) and
``test_sharding_rules_shapes.py`` (shape ops).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.cases import CASES
from harness.cases.nn import CONTEXTS
from harness.rules import Draw, check_op
from autopar.passes.rules import RULES

MAX_EXAMPLES = 200 if os.environ.get("AUTOPAR_SLOW") else 12


def test_every_rule_has_a_ground_truth_case() -> None:
    assert set(CASES) == set(RULES), (
        f"rules without a case: {sorted(map(str, set(RULES) - set(CASES)))}; "
        f"cases without a rule: {sorted(map(str, set(CASES) - set(RULES)))}"
    )


@pytest.mark.parametrize("op", sorted(CASES, key=str), ids=str)
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_strategy_is_sound(op: Any, data: st.DataObject) -> None:
    n = data.draw(st.sampled_from([2, 3, 4]), label="n")
    d = Draw(data, n)
    args, kwargs = CASES[op](d, op)
    with CONTEXTS.get(op, contextlib.nullcontext)():
        check_op(op, args, kwargs, n, d.gen)
