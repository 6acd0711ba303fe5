"""Measured bytes per rank follow the ZeRO paper's formulas (fp32 AdamW, Psi parameters, N dp ranks).

stage 0: 16 Psi; stage 1: 8 Psi + 8 Psi / N; stage 2: 4 Psi + 12 Psi / N; stage 3: 16 Psi / N plus the
gathered layers alive at once (one layer without prefetch, two with one layer of prefetch). Each must be
within 5% of the account ``pm.memory()`` measures from the live tensors, and the plan's estimate too.
"""
from __future__ import annotations

import pytest
import torch

import models
from autopar import Mesh, parallelize

WIDTH, LAYERS = 64, 8


def _formula(stage: int, psi: int, n: int, layer: int, prefetch: int) -> float:
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n,
            3: 16 * psi / n + (1 + prefetch) * layer}[stage]


def _accounts(dp: int) -> list:
    x, y = torch.randn(8 * dp, WIDTH), torch.randn(8 * dp, WIDTH)
    out = []
    for stage, prefetch in [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1)]:
        model = models.mlp((WIDTH,) * (LAYERS + 1), dtype=torch.float32)
        pm = parallelize(model, Mesh(dp=dp), loss_fn=models.mse, zero=stage, zero_prefetch=prefetch,
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), example_inputs=(x,), example_target=y)
        for _ in range(3):
            pm.step(x, target=y)
        out.append((stage, prefetch, pm.memory(), dict(pm.plan.memory)))
    return out


@pytest.mark.parametrize("dp", [2, 4])
def test_measured_bytes_per_rank_match_the_zero_formulas(launcher, dp: int) -> None:
    psi = LAYERS * (WIDTH * WIDTH + WIDTH)
    layer = 4 * (WIDTH * WIDTH + WIDTH)
    for stage, prefetch, measured, estimate in launcher(_accounts, dp, dp)[0]:
        want = _formula(stage, psi, dp, layer, prefetch)
        parts = {k: v for k, v in measured.items() if k != "total"}
        assert measured["total"] == sum(parts.values())
        assert measured["total"] == pytest.approx(want, rel=0.05), (stage, prefetch, measured, want)
        assert sum(estimate.values()) == pytest.approx(measured["total"], rel=0.05), (stage, estimate, measured)
        if stage == 3:
            assert measured["gathered"] == (1 + prefetch) * layer  # measured peak of gathered layers
        if stage >= 2:
            assert measured["gradients"] == pytest.approx(4 * psi / dp, rel=0.01)  # no full gradient is kept
