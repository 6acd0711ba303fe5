"""Positions under cp: an ``arange`` of the sequence's length from 0 by 1 becomes each rank's global positions; one
from another start or by another step (OPT-style ``arange(2, S + 2)``, positions counted from the end
``arange(S - 1, -1, -1)``) was kept as captured on the rank's chunks, so every cp rank read the first chunk's
positions and trained silently wrong. Refused, naming the node and the form that runs (``arange(S) + offset``).
A slice ``[:S]`` of a view of a position table (``ids.unsqueeze(0)[:, :S]`` of a position-id buffer) and a table
``narrow``ed to the length were kept too, where a slice of the table itself became the rank's positions; both are
the rank's positions now, and a window of a table from another start is refused, as are positions built in Python
from the length (a constant) or counted by a running sum over a tensor of ones."""
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
        self.register_buffer("position_ids", torch.arange(32), persistent=False)
        self.table = nn.Parameter(torch.randn(1, 32, d) * 0.1)  # (1, positions, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.embed(ids) + self._table(s)  # (B, S, d)
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # 3 x (B, heads, S, d / heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + y.transpose(1, 2).reshape(b, s, -1))

    def _table(self, s: int) -> torch.Tensor:
        if self.form == "narrowed":
            return self.table.narrow(1, 0, s)
        if self.form == "shifted":
            return self.table[:, 1:s + 1]
        return self.positions(self._positions(s))

    def _positions(self, s: int) -> torch.Tensor:
        if self.form == "offset":
            return torch.arange(2, s + 2)
        if self.form == "reversed":
            return torch.arange(s - 1, -1, -1)
        if self.form == "listed":
            return torch.tensor(list(range(s)))
        if self.form == "counted":
            return torch.ones(s, dtype=torch.long).cumsum(0) - 1
        if self.form == "buffer_view":
            return self.position_ids.unsqueeze(0)[:, :s]  # (1, S)
        return torch.arange(s) + 2


def positions_lm(form: str) -> nn.Module:
    return PositionsLM(form).to(torch.float64)


@pytest.mark.parametrize("form, what", [
    ("offset", r"arange .*an arange of the local length 4 that does not count from 0 by 1 \(2, 6\).*"
               r"torch.arange\(S\) \* step \+ offset"),
    ("reversed", r"arange .*an arange of the local length 4 that does not count from 0 by 1 \(3, -1, -1\)"),
    ("shifted", r"slice.* a window of the local length 4 of the model's state that does not start at 0 \(1, 1, 5\)"),
    ("listed", r"c_\w*lifted_tensor_0 .*a constant tensor of shape \(4,\) here is \(8,\) on whole sequences.*"
               r"torch.arange\(S\)"),
    ("counted", r"cumsum .*accumulates along dim 0 of a tensor \(4,\) made from the local sequence length 4 alone.*"
                r"torch.arange\(S\)"),
])
def test_positions_from_another_start_or_step_are_refused_under_cp(form: str, what: str) -> None:
    """``table[:, 1:S + 1]``, ``torch.tensor(list(range(S)))`` and ``torch.ones(S).cumsum(0) - 1`` were kept as
    captured too: every rank read the first chunk's positions."""
    with pytest.raises(UnsupportedError, match=rf"node {what}"):
        autopar.parallelize(positions_lm(form), Mesh(cp=2), example_inputs=(IDS,), example_target=TARGET,
                            loss_fn=models.lm_loss, optimizer=models.adamw)


@pytest.mark.parametrize("form", ["added", "buffer_view", "narrowed"])
def test_positions_added_to_or_read_from_a_view_train_exactly_under_cp(launcher, form: str) -> None:
    """``arange(S) + 2``, the form the refusal points to; a position-id buffer's view sliced to the length and a
    table narrowed to it (every rank read positions 0..3 before)."""
    assert_equivalent(models.factory(positions_lm, form=form), Mesh(cp=2), (IDS,), TARGET, models.lm_loss,
                      models.adamw, steps=2, rtol=1e-9, atol=1e-10, launcher=launcher)
