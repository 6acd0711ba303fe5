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


def _composed_accounts(sizes: dict) -> dict:
    mesh = Mesh(**sizes)
    x, y = torch.randn(8 * mesh.dp, WIDTH), torch.randn(8 * mesh.dp, WIDTH)
    out = {}
    for stage in (0, 1, 2, 3):
        model = models.mlp((WIDTH,) * (LAYERS + 1), dtype=torch.float32)
        pm = parallelize(model, mesh, loss_fn=models.mse, zero=stage, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                         example_inputs=(x,), example_target=y, microbatches=2)
        for _ in range(3):
            pm.step(x, target=y)
        rank = torch.distributed.get_rank()
        layout = pm.compile((x,), target=y).zero_layouts.get(rank)
        held = ({n: p.numel() for n, p in model.named_parameters() if any(p is q for q in pm.parameters())}
                if stage == 0 else {n: k for g in layout.groups for n, k in zip(g.params, g.numels)})
        largest = max(g.nbytes for g in layout.groups) if stage == 3 else 0
        out[stage] = (held, largest, pm.memory(), dict(pm.plan.memory))
    return out


@pytest.mark.parametrize("sizes", [dict(dp=2, pp=2), dict(dp=2, tp=2)])
def test_with_pp_or_tp_each_rank_follows_the_formulas_for_what_it_holds(launcher, sizes: dict) -> None:
    """Psi is the rank's share: its stage's layers under pp, its column/row shards under tp."""
    total = LAYERS * (WIDTH * WIDTH + WIDTH)
    for rank, accounts in enumerate(launcher(_composed_accounts, Mesh(**sizes).size, sizes)):
        assert accounts[0][0] == accounts[1][0] == accounts[2][0] == accounts[3][0]  # every stage, the same share
        psi = sum(accounts[0][0].values())
        assert psi == pytest.approx(total / 2, rel=0.02), (rank, psi)  # half the model (tp: biases of row layers)
        for stage, (_, largest, measured, estimate) in accounts.items():
            want = _formula(stage, psi, 2, largest, 1)  # zero_prefetch=1: two layers gathered at once
            assert measured["total"] == pytest.approx(want, rel=0.05), (rank, stage, measured, want)
            assert sum(estimate.values()) >= measured["total"] * 0.95  # the plan's worst rank bounds each rank


IDS = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(1))


def _step_peaks() -> dict:
    from autopar.runtime.memory import NewStorages

    out = {}
    for precision in ("fp32", "bf16"):
        for prefetch in (0, 1):
            pm = parallelize(models.gpt2(layers=3, d=64, dtype=torch.float32), Mesh(dp=2), loss_fn=models.lm_loss,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3), zero=3, zero_prefetch=prefetch,
                             precision=precision)
            pm.step(IDS, target=IDS)  # compiles
            peaks = []
            for _ in range(2):
                mode = NewStorages()
                with mode:
                    pm.step(IDS, target=IDS)
                peaks.append(mode.peak)
            layout = pm.compile((IDS,), target=IDS).zero_layouts[torch.distributed.get_rank()]
            layer = max(g.padded for g in layout.groups) * (2 if precision == "bf16" else 4)  # as gathered
            out[precision, prefetch] = (peaks, pm.memory()["gathered"], layer)
    return out


def test_a_layer_of_prefetch_raises_the_steps_peak_by_at_most_that_layer(launcher) -> None:
    """Gathered layers dominate this step (wide layers, 32 tokens per rank; SGD allocates nothing), and its peak
    is in backward. zero_prefetch=1 gathers the next layer early in forward (two layers gathered at once) and, as
    FSDP2 does, starts re-gathering layer L when layer L+1's backward begins, so L is alive while L+1 computes
    (with L+1's copy, its parameter gradients and L+2's gradient still reducing, which FSDP2 also holds then).
    That one layer is all the prefetch adds to the step's peak: no second copy of a gradient (the reduction of
    L+2 completes before L+1's gradient is copied for gloo or converted to fp32), no copy of the shard for the
    gather (it is cast straight into its slice of the gathered buffer), no output buffer for a reduction in
    flight. In fp32 the peak rises by exactly the layer; in bf16 by less (the layer is gathered in bf16, and
    the peak's moment moves). The peak is the same on every step."""
    for rank, results in enumerate(launcher(_step_peaks, 2)):
        for precision in ("fp32", "bf16"):
            (without, gathered, layer), (with_prefetch, gathered_with, _) = (results[precision, p] for p in (0, 1))
            assert gathered_with == gathered + layer, (rank, precision)  # the prefetch happens (one layer ahead)
            assert len(set(without)) == len(set(with_prefetch)) == 1, (rank, precision, without, with_prefetch)
            assert 0 <= with_prefetch[0] - without[0] <= layer, (rank, precision, without, with_prefetch, layer)
