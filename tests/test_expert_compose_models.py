"""Expert parallelism composed with dp, tp, pp and ZeRO-3 on Qwen3-MoE and a DeepSeek-V3-like model: float64, exact.

Each run trains Hugging Face's model with its eager experts (stacked ``(E, ...)`` weights) with AdamW for two steps
and compares loss, output and every parameter with one device within 1e-12 relative (``assert_equivalent``), at
ep=2 and ep=4. The DeepSeek-V3 model is Hugging Face's (shared expert, sigmoid router with a correction bias,
grouped top-k, a dense first layer) with its router computing in the model's dtype (``models.deepseek_v3_exact``):
Hugging Face's casts to float32, which turns any float64 rounding in front of it into float32's
(``test_expert_parallel.py`` checks that router against one device on the same split, to float32's bounds).
"""
from __future__ import annotations

import pytest
import torch

import models
from autopar import Mesh
from autopar.testing import assert_equivalent

IDS8 = torch.randint(3, 96, (8, 8), generator=torch.Generator().manual_seed(3))
TARGET8 = torch.randint(3, 96, (8, 8), generator=torch.Generator().manual_seed(4))
QWEN = models.factory(models.qwen3_moe_eager, layers=1, aux=False)
QWEN2 = models.factory(models.qwen3_moe_eager, layers=2, aux=False)  # one MoE layer per pipeline stage
DEEPSEEK = models.factory(models.deepseek_v3_exact)  # a dense layer, then a MoE layer of 8 experts
DEEPSEEK3 = models.factory(models.deepseek_v3_exact, layers=3)  # dense + MoE | MoE over two stages


def _exact(make, mesh: Mesh, launcher, **options) -> None:
    assert_equivalent(make, mesh, (IDS8,), TARGET8, models.lm_loss, models.adamw, steps=2, rtol=1e-9, atol=1e-10,
                      launcher=launcher, **options)


def test_qwen3_moe_zero3_with_experts_over_ep(launcher) -> None:
    """Mesh(dp=4, ep=2), ZeRO-3: each expert's rows sharded over its two replicas, gathered per layer."""
    _exact(QWEN, Mesh(dp=4, ep=2), launcher, zero=3)


def test_deepseek_v3_experts_over_ep(launcher) -> None:
    """Mesh(dp=2, ep=2): four of the eight routed experts per rank; the shared expert and the router replicated."""
    _exact(DEEPSEEK, Mesh(dp=2, ep=2), launcher)


GRID = [
    ("qwen3-tp-ep2", QWEN, Mesh(dp=2, tp=2, ep=2), {}),
    ("qwen3-pp-ep2", QWEN2, Mesh(dp=2, pp=2, ep=2), {"microbatches": 2}),
    ("qwen3-zero3-ep4", QWEN, Mesh(dp=4, ep=4), {"zero": 3}),
    ("qwen3-tp-ep4", QWEN, Mesh(dp=4, tp=2, ep=4), {}),
    ("qwen3-pp-ep4", QWEN2, Mesh(dp=4, pp=2, ep=4), {"microbatches": 2}),
    ("deepseek-ep4", DEEPSEEK, Mesh(dp=4, ep=4), {}),
    ("deepseek-tp-ep2", DEEPSEEK, Mesh(dp=2, tp=2, ep=2), {}),
    ("deepseek-pp-ep2", DEEPSEEK3, Mesh(dp=2, pp=2, ep=2), {"microbatches": 2}),
    ("deepseek-zero3-ep2", DEEPSEEK, Mesh(dp=4, ep=2), {"zero": 3}),
    ("deepseek-zero3-ep4", DEEPSEEK, Mesh(dp=4, ep=4), {"zero": 3}),
    ("deepseek-tp-ep4", DEEPSEEK, Mesh(dp=4, tp=2, ep=4), {}),
    ("deepseek-pp-ep4", DEEPSEEK3, Mesh(dp=4, pp=2, ep=4), {"microbatches": 2}),
]


@pytest.mark.slow
@pytest.mark.parametrize("make, mesh, options", [g[1:] for g in GRID], ids=[g[0] for g in GRID])
def test_experts_over_ep_compose(launcher, make, mesh: Mesh, options: dict) -> None:
    """ep=2 and ep=4 with dp, tp (experts whole on every tp rank of an ep index), pp (each stage's MoE layers over
    the stage's ep ranks) and ZeRO-3 (expert state over the ranks holding the same experts)."""
    _exact(make, mesh, launcher, **options)


def test_the_deepseek_router_in_the_models_dtype_routes_as_hugging_faces() -> None:
    """In float32 (where Hugging Face's cast changes nothing) both routers pick the same experts with the same
    weights, on tokens where the correction bias and the group limit each move the choice."""
    hf, ours = models.deepseek_v3(dtype=torch.float32), models.deepseek_v3_exact(dtype=torch.float32)
    h = torch.randn(4, 64, 32, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(8, generator=torch.Generator().manual_seed(6)) * 0.1
    a, b = hf.model.layers[1].mlp.gate, ours.model.layers[1].mlp.gate
    assert type(b).__name__ == "DeepSeekRouter"
    a.e_score_correction_bias.copy_(bias)
    b.e_score_correction_bias.copy_(bias)
    (la, wa, ia), (lb, wb, ib) = a(h), b(h)
    unbiased = torch.topk(la.sigmoid(), 2, dim=-1).indices.sort(-1).values
    ungrouped = torch.topk(la.sigmoid() + bias, 2, dim=-1).indices.sort(-1).values
    assert (ia.sort(-1).values != unbiased).any() and (ia.sort(-1).values != ungrouped).any()  # both move it
    assert torch.equal(ia, ib) and torch.equal(wa, wb) and torch.equal(la, lb)
