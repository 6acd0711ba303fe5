"""A parameter nothing reads (unused in forward) belongs to pipeline stage 0 and keeps its value.

The stage cut left it in no stage, so every pp rank released it and ``pm.state_dict()`` read it from pp rank 0's
empty tensor: uninitialised memory, silently (with the compiler's checks on, its invariant "every parameter in a
stage" failed instead). ``passes/stage_cuts.split_stages`` gives it to stage 0.
"""
from __future__ import annotations

import models
from autopar import Mesh
from autopar.testing import assert_equivalent
from test_zero_unused_parameters import X, Y, ExtraParameter


def test_a_parameter_no_stage_reads_keeps_its_value_with_zero(launcher) -> None:
    assert_equivalent(ExtraParameter, Mesh(dp=2, pp=2), (X,), Y, models.mse, models.adamw, steps=3, rtol=1e-9,
                      atol=1e-10, launcher=launcher, zero=1, microbatches=2)
