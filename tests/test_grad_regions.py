"""A ``torch.no_grad()`` block inside forward: torch.export keeps it as a call into a submodule
(``wrap_with_set_grad_enabled``), which tp failed on ("does not belong to this Graph") and pp with a KeyError.
Capture inlines it, its results detached (``autopar/core/grad_regions.py``): float64 exact on tp=2, pp=2 with two
microbatches and ZeRO-3."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import models
from autopar import Mesh
from autopar.compiler.capture import capture
from autopar.testing import assert_equivalent
from harness.exactness import IDS, TARGET


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Guided(nn.Module):
    """Layers, then a term computed under ``torch.no_grad()`` (a target from the first layer) added back."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(96, d)
        self.layers = nn.ModuleList([Block(d) for _ in range(2)])
        self.head = nn.Linear(d, 96)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        with torch.no_grad():
            t = self.layers[0](x)
        return self.head(x + (t - x).tanh() + 0.1 * self.layers[0].fc1.weight.detach().sum())


def guided() -> nn.Module:
    torch.manual_seed(0)
    return Guided().double()


def test_the_block_is_inlined_and_detached() -> None:
    gm = capture(guided(), (IDS,)).gm
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.higher_order.wrap_with_set_grad_enabled not in targets
    assert torch.ops.aten.detach.default in targets


@pytest.mark.parametrize("mesh, options", [(Mesh(tp=2), {}), (Mesh(pp=2), {"microbatches": 2}),
                                           (Mesh(dp=2), {"zero": 3})], ids=["tp2", "pp2", "zero3"])
def test_a_no_grad_block_trains_as_one_device(launcher, mesh: Mesh, options: dict) -> None:
    assert_equivalent(guided, mesh, (IDS,), TARGET, models.lm_loss, models.adamw, steps=2, rtol=1e-9, atol=1e-10,
                      launcher=launcher, **options)
