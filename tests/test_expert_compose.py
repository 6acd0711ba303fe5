"""Expert parallelism composed with ZeRO (and the data-parallel traffic it leaves): float64, exact.

Each run trains the loop MoE (one ``nn.ModuleList`` expert per tensor) or Mixtral's eager experts (stacked
``(E, ...)`` weights) with AdamW for several steps and compares loss, output and every parameter with one
device within 1e-12 relative (``assert_equivalent``). Under ZeRO the routed experts' parameters, gradients and
optimizer state are sharded over the ranks holding the same experts (``ep_replicate``), the others over dp.
"""
from __future__ import annotations

import pytest
import torch

import models
from autopar import Mesh, parallelize
from autopar.testing import assert_equivalent

IDS8 = torch.randint(3, 96, (8, 8), generator=torch.Generator().manual_seed(3))
TARGET8 = torch.randint(3, 96, (8, 8), generator=torch.Generator().manual_seed(4))
LOOP = models.factory(models.loop_moe, aux=False)
MIXTRAL = models.factory(models.mixtral_eager, layers=1, aux=False)


def _exact(make, mesh: Mesh, launcher, **options) -> None:
    assert_equivalent(make, mesh, (IDS8,), TARGET8, models.lm_loss, models.adamw, steps=2, rtol=1e-9, atol=1e-10,
                      launcher=launcher, **options)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_shards_expert_state_over_the_ranks_holding_each_expert(launcher, zero: int) -> None:
    """dp=4, ep=2: every expert has two replicas, whose gradients and AdamW state are split between them."""
    _exact(LOOP, Mesh(dp=4, ep=2), launcher, zero=zero)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_with_stacked_experts(launcher, zero: int) -> None:
    _exact(MIXTRAL, Mesh(dp=4, ep=2), launcher, zero=zero)



def _formula(dense: int, experts: int, mesh: Mesh, zero: int) -> dict[str, int]:
    """ZeRO's bytes per rank with the routed experts split over ep first: dense state over dp, this rank's
    experts (``experts / ep``) over their ``dp / ep`` replicas; AdamW keeps two elements per parameter."""
    held, replicas = experts // mesh.ep, mesh.dp // mesh.ep
    sharded = dense // mesh.dp + held // replicas
    return {"parameters": dense + held if zero < 3 else sharded, "gradients": dense + held if zero == 1 else sharded,
            "optimizer": 2 * sharded}


def _memory(make, mesh: Mesh, zero: int) -> tuple[dict, dict, dict]:
    model = make()
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() * p.element_size() for p in model.parameters()) - experts
    pm = parallelize(model, mesh, loss_fn=models.lm_loss, optimizer=models.adamw, zero=zero,
                     example_inputs=(IDS8,), example_target=TARGET8)
    pm.step(IDS8, target=TARGET8)
    return pm.memory(), dict(pm.plan.memory), _formula(dense, experts, mesh, zero)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_memory_per_rank_divides_expert_state_by_ep_then_by_its_replicas(launcher, zero: int) -> None:
    """Measured on every rank after a step, within 5% of the formula and of the plan (the flat groups' padding);
    every expert on every rank would hold 49% more parameter bytes (148,992 against 99,840)."""
    mesh = Mesh(dp=4, ep=2)
    for measured, planned, formula in launcher(_memory, mesh.size, LOOP, mesh, zero):
        for key, want in formula.items():
            assert measured[key] == pytest.approx(want, rel=0.05), (key, measured, formula)
            assert planned[key] == pytest.approx(want, rel=0.05), (key, planned, formula)
