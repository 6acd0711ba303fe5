"""Dropout under context parallelism drops what one device drops: each cp rank keeps its rows of the whole
sequence's mask (``autopar/core/cp_dropout.py``), the cp ranks seeded as the group's first rank is."""
from __future__ import annotations

import os

import pytest
import torch

import models
from autopar import Mesh, parallelize
from autopar.core.errors import UnsupportedError
from autopar.testing import Run, relative_errors

IDS = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
SEED, STEPS = 1234, 3


def dropping_gpt2() -> torch.nn.Module:
    """GPT-2 with embedding and residual dropout 0.1 (attention dropout 0: the ring has none)."""
    model = models.gpt2(dropout=0.1)
    model.config.attn_pdrop = 0.0
    for m in model.modules():
        if hasattr(m, "attn_dropout"):
            m.attn_dropout.p = 0.0
    return model


def _parallel(mesh: Mesh, options: dict) -> tuple[list[float], dict]:
    model = dropping_gpt2()  # (which seeds its initialization)
    # each rank its own seed: the runtime gives every tp and cp rank the seed of its group's first (rank 0's)
    torch.manual_seed(SEED + 1000 * int(os.environ["RANK"]))
    pm = parallelize(model, mesh, loss_fn=models.lm_loss, optimizer=models.adamw, **options)
    losses = [pm.step(IDS, target=IDS) for _ in range(STEPS)]
    return losses, {k: v.detach().clone() for k, v in pm.state_dict().items()}


def _one_device() -> Run:
    """One device drawing as the runtime seeds a call: the initial seed plus the calls so far."""
    model = dropping_gpt2()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    opt = models.adamw(list(model.parameters()))
    losses, grad_max = [], {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for step in range(STEPS):
        torch.manual_seed(SEED + step + 1)
        loss = models.lm_loss(model(IDS), IDS)
        loss.backward()
        for n, p in model.named_parameters():
            grad_max[n] = torch.maximum(grad_max[n], p.grad.abs())
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return Run(losses, [], model.state_dict(), initial, grad_max)


@pytest.mark.parametrize("mesh, options", [
    (Mesh(cp=2), {}), pytest.param(Mesh(tp=2, cp=2), {}, marks=pytest.mark.slow),
    pytest.param(Mesh(cp=4), {}, marks=pytest.mark.slow),
    pytest.param(Mesh(cp=2), {"recompute": "full"}, marks=pytest.mark.slow),
    pytest.param(Mesh(cp=2), {"cp_attention": "all_to_all"}, marks=pytest.mark.slow)])
def test_dropout_on_the_chunks_is_one_devices(launcher, mesh: Mesh, options: dict) -> None:
    """Losses and updates within 1e-12 of one device seeded alike; recomputation draws the same rows again."""
    want = _one_device()
    without = models.loss_without_dropout(dropping_gpt2, IDS, IDS)
    assert want.losses[0] != pytest.approx(without, rel=1e-6)  # it drops
    for losses, state in launcher(_parallel, mesh.size, mesh, options):
        worst, what = relative_errors(want, Run(losses, [], state))
        assert worst <= 1e-12, (worst, what)


def test_dropout_without_a_sequence_dim_is_refused() -> None:
    """A dropping dropout on a value without a sequence dim (a parameter's) has no rows to take. (A vector pooled
    over the tokens is refused before: a reduction over the sequence, test_zoo_more.py.)"""

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(96, 16, dtype=torch.float64)
            self.scale = torch.nn.Parameter(torch.ones(16, dtype=torch.float64))
            self.head = torch.nn.Linear(16, 1, dtype=torch.float64)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(ids) * torch.nn.functional.dropout(self.scale, 0.1, self.training))

    pm = parallelize(Scaled().train(), Mesh(cp=2), loss_fn=models.mse, optimizer=models.adamw)
    with pytest.raises(UnsupportedError, match=r"drops \(p=0.1\) a value of shape \[16\] with no sequence dim"):
        pm.compile((IDS,), target=torch.zeros(2, 8, 1, dtype=torch.float64))
