"""Routed experts in every form users write them are captured dropless, with static shapes, and exactly.

Forms: Hugging Face's eager expert loop (Mixtral, Qwen3-MoE, DeepSeek-V3 in float64; it loops over the experts hit and
skips a sentinel, which torch.export alone cannot capture), and a plain PyTorch loop over an
``nn.ModuleList`` of experts with ``torch.where(top_k_index == e)`` and ``index_add`` (softmax or sigmoid
scores, with or without a shared expert). The load-balancing loss is part of the captured loss, so the
router's gradient through it is checked too.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import models
from autopar import CaptureError, Mesh
from autopar.compiler.capture import capture
from autopar.testing import assert_equivalent

IDS = torch.randint(3, 96, (4, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(3, 96, (4, 8), generator=torch.Generator().manual_seed(2))
FORMS = {
    "mixtral_eager": models.factory(models.mixtral_eager, layers=1),
    "qwen3_moe_eager": models.factory(models.qwen3_moe_eager, layers=1),
    "deepseek_v3": models.factory(models.deepseek_v3),  # grouped top-k over a biased sigmoid, shared experts
    "loop_softmax_shared": models.factory(models.loop_moe),
    "loop_sigmoid": models.factory(models.loop_moe, score="sigmoid", shared=False, top_k=1),
}


def _static(gm: torch.fx.GraphModule) -> bool:
    """No selection of data-dependent size is left, and every value has a concrete shape."""
    for node in gm.graph.nodes:
        if node.target in (torch.ops.aten.where.default, torch.ops.aten.nonzero.default):
            return False
        for val in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(val, torch.Tensor) and not all(isinstance(s, int) for s in val.shape):
                return False
    return True


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300)) if b.numel() else 0.0


@pytest.mark.parametrize("name", list(FORMS))
def test_expert_loops_are_captured_static_and_exact(name: str) -> None:
    """Loss and every parameter's gradient (the router's through top-k and the auxiliary loss) of the
    captured graph equal the eager model's within 1e-12 relative, in float64."""
    model = FORMS[name]()
    cap = capture(model, (IDS,), {}, with_loss=True, loss_fn=models.moe_loss, target=IDS)
    assert _static(cap.gm)
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    loss = cap.run(state, pytree.tree_leaves(((IDS,), {}, IDS)))
    loss.backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    want = models.moe_loss(model(IDS), IDS)
    want.backward()
    assert _relative(loss.detach().reshape(1), want.detach().reshape(1)) <= 1e-12
    for k, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, k  # every expert and the router learn
        assert _relative(got[k], p.grad) <= 1e-12, k


@pytest.mark.parametrize("make, control", [
    (models.factory(models.loop_moe, aux=False), False),
    pytest.param(models.factory(models.mixtral_eager, layers=1, aux=False), False, marks=pytest.mark.slow),
    pytest.param(models.factory(models.qwen3_moe_eager, layers=1, aux=False), False, marks=pytest.mark.slow),
    pytest.param(models.factory(models.deepseek_v3), True, marks=pytest.mark.slow),
], ids=["loop", "mixtral_eager", "qwen3_moe_eager", "deepseek_v3"])
def test_expert_loops_train_exactly_on_two_data_parallel_ranks(launcher, make, control: bool) -> None:
    """Float64 within 1e-12 (update, loss, output) of one device. Without the load-balancing loss: it is a
    statistic of the batch, so each data-parallel rank computes its own, as every data-parallel MoE does.
    DeepSeek-V3's router runs in float32 (its weight's gradient is a float32 sum over the batch): within 1e-12
    of one device on the same split of the batch (the control), within 1e-5 of the whole batch."""
    bound = 1e-5 if control else 1e-9
    assert_equivalent(make, Mesh(dp=2), (IDS,), TARGET, models.lm_loss, models.adamw, steps=2, control=control,
                      rtol=bound, atol=bound / 10, launcher=launcher)


class _LinearExperts(torch.nn.Module):
    """A router and four linear experts; subclasses route."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(8, 4, bias=False, dtype=torch.float64)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8, dtype=torch.float64) for _ in range(4))


class _CapacityMoE(_LinearExperts):
    """Experts picked by a threshold on the scores: a token may pick none or all, so no top-k proves it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = F.softmax(self.router(x), dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            (token,) = torch.where(scores[:, e] > 0.25)
            out = out.index_add(0, token, expert(x[token]) * scores[token, e, None])
        return out


def test_a_routing_it_cannot_prove_is_refused_naming_the_module() -> None:
    with pytest.raises(CaptureError, match=r"module <the model> \(_CapacityMoE\) cannot be made "
                       r"dropless and static: rows are selected by aten\.gt\.Scalar on a \(6,\) tensor"):
        capture(_CapacityMoE(), (torch.randn(6, 8, dtype=torch.float64),), {})


class _SortRouted(_LinearExperts):
    """Experts picked from an argsort: the indices are a permutation's head, but not a topk the rewrite knows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = F.softmax(self.router(x), dim=-1)
        chosen = torch.argsort(scores, dim=-1, descending=True)[:, :2]  # (T, 2)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out = out.index_add(0, token, expert(x[token]) * scores[token, e, None])
        return out


def test_a_router_it_does_not_recognise_is_refused() -> None:
    with pytest.raises(CaptureError, match=r"module <the model> \(_SortRouted\) .* the expert indices compared by "
                                           r"eq.* are not the indices of a torch\.topk"):
        capture(_SortRouted(), (torch.randn(6, 8, dtype=torch.float64),), {})


def test_a_second_capture_of_the_same_model_is_remembered_and_static() -> None:
    from autopar.compiler.capture_cache import EXPORTS

    make = models.factory(models.qwen3_moe_eager, layers=1, aux=False)
    capture(make(), (IDS,), {})
    hits = EXPORTS.hits
    assert _static(capture(make(), (IDS,), {}).gm) and EXPORTS.hits == hits + 1
