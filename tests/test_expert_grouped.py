"""Hugging Face's grouped-matmul experts (its default ``_experts_implementation``) under expert parallelism.

The grouped matmul has no float64 kernel on CPU (``torch.nn.functional.grouped_mm`` takes float32, bf16 and fp16),
so the single-device run that the parallel one is compared with cannot be float64: float32 against one device,
bounded by 1e-3 on the relative update error (``test_exactness.FLOAT32_BOUND``), beside a dense float32 control
(LLaMA at dp=2, the same bound) that shows the rounding float32 alone gives. SGD, whose update is the gradient, so
that an expert gradient off by a constant factor fails too; a wrong routing or expert row moves updates by their
own size (relative error ~1).
"""
from __future__ import annotations

import pytest
import torch

import models
from autopar import Mesh, parallelize
from autopar.testing import Report, assert_equivalent

IDS = torch.randint(3, 96, (4, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(3, 96, (4, 8), generator=torch.Generator().manual_seed(2))
BOUND = 1e-3


def _update_error(make, mesh: Mesh, launcher, **options) -> float:
    report: list[Report] = []
    assert_equivalent(make, mesh, (IDS,), TARGET, models.lm_loss, models.sgd, steps=2, rtol=1e-3, atol=1e-4,
                      update_rtol=BOUND, report=report, launcher=launcher, **options)
    return max(r.update_error for r in report)


def test_grouped_experts_split_over_ep_in_float32(launcher) -> None:
    """Mixtral's grouped experts at Mesh(dp=2, ep=2): each rank runs one grouped matmul over the rows it received
    for its two experts; within float32's bound, as the dense control is."""
    ep = _update_error(models.factory(models.mixtral, layers=1), Mesh(dp=2, ep=2), launcher)
    dense = _update_error(models.factory(models.llama, layers=1, dtype=torch.float32), Mesh(dp=2), launcher)
    assert 0 < ep < BOUND and 0 < dense < BOUND  # float32 rounding shows in both: the comparisons are live
    print(f"relative update error: grouped experts over ep {ep:.2e}, dense control {dense:.2e}")


def _deepseek_grouped() -> torch.nn.Module:
    model = models.deepseek_v3(dtype=torch.float32)
    model.config._experts_implementation = "grouped_mm"  # (models.deepseek_v3 asks for the eager loop)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("make, mesh, options", [
    (models.factory(models.qwen3_moe, layers=1), Mesh(dp=4, ep=4), {}),
    (models.factory(models.mixtral, layers=2), Mesh(dp=2, pp=2, ep=2), {"microbatches": 2}),
    (models.factory(models.mixtral, layers=1), Mesh(dp=4, ep=2), {"zero": 3}),
    (models.factory(models.mixtral, layers=1), Mesh(dp=2, tp=2, ep=2), {}),
    (_deepseek_grouped, Mesh(dp=2, ep=2), {}),
], ids=["qwen3-ep4", "mixtral-pp", "mixtral-zero3", "mixtral-tp", "deepseek"])
def test_grouped_experts_over_ep_compose(launcher, make, mesh: Mesh, options: dict) -> None:
    assert 0 < _update_error(make, mesh, launcher, **options) < BOUND


def test_the_plan_holds_each_ranks_rows_of_the_grouped_weights() -> None:
    pm = parallelize(models.mixtral(layers=1), Mesh(dp=2, ep=2), example_inputs=(IDS,), example_target=TARGET,
                     loss_fn=models.lm_loss)
    text = str(pm.plan)
    assert "ranks [0]: experts 0-1; ranks [1]: experts 2-3" in text
    assert "experts of model.layers.0.mlp.experts (MixtralExperts): Shard(0) over ep (E/ep=2 rows per ep index)" in text
    code = pm.graph(0).code
    assert "expert_parallel_0" in code and "sort" not in code and "grouped_mm" not in code
