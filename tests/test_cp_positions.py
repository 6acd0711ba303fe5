"""Positions under cp: an ``arange`` of the sequence's length from 0 by 1 becomes each rank's global positions; one
from another start or by another step (OPT-style ``arange(2, S + 2)``, positions counted from the end
``arange(S - 1, -1, -1)``) was kept as captured on the rank's chunks, so every cp rank read the first chunk's
positions and trained silently wrong. Refused, naming the node and the form that runs (``arange(S) + offset``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
import models
from autopar import Mesh
from autopar.core.errors import UnsupportedError
from autopar.testing import assert_equivalent

IDS = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(2))


class PositionsLM(nn.Module):
    """Learned absolute positions read at ``positions(S)``, one causal attention layer."""

    def __init__(self, form: str, vocab: int = 96, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.form, self.heads = form, heads
        self.embed, self.positions = nn.Embedding(vocab, d), nn.Embedding(32, d)
        self.qkv, self.head = nn.Linear(d, 3 * d), nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.embed(ids) + self.positions(self._positions(s))  # (B, S, d)
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # 3 x (B, heads, S, d / heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + y.transpose(1, 2).reshape(b, s, -1))

    def _positions(self, s: int) -> torch.Tensor:
        if self.form == "offset":
            return torch.arange(2, s + 2)
        if self.form == "reversed":
            return torch.arange(s - 1, -1, -1)
        return torch.arange(s) + 2


def positions_lm(form: str) -> nn.Module:
    return PositionsLM(form).to(torch.float64)


@pytest.mark.parametrize("form, args", [("offset", r"\(2, 6\)"), ("reversed", r"\(3, -1, -1\)")])
def test_an_arange_from_another_start_or_step_is_refused_under_cp(form: str, args: str) -> None:
    with pytest.raises(UnsupportedError, match=rf"node arange .*an arange of the local length 4 that does not count "
                                               rf"from 0 by 1 {args}.*torch.arange\(S\) \* step \+ offset"):
        autopar.parallelize(positions_lm(form), Mesh(cp=2), example_inputs=(IDS,), example_target=TARGET,
                            loss_fn=models.lm_loss, optimizer=models.adamw)


def test_an_offset_added_to_the_positions_trains_exactly_under_cp(launcher) -> None:
    assert_equivalent(models.factory(positions_lm, form="added"), Mesh(cp=2), (IDS,), TARGET, models.lm_loss,
                      models.adamw, steps=2, rtol=1e-9, atol=1e-10, launcher=launcher)
