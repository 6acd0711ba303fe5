"""A model whose Python branches on the sequence's length (``if S > 6: x = x.tanh()``) is captured on a cp rank's
chunks down the local length's branch: each rank ran the other branch than one device and trained silently wrong.
One of the graphs captured on whole sequences and on the rank's chunks runs an op the other does not; refused,
naming it."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
import models
from autopar import Mesh
from autopar.core.errors import UnsupportedError

IDS = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(2))


class LengthBranch(nn.Module):
    """GPT-2 whose hidden states are squashed for sequences longer (or shorter) than 6 tokens."""

    def __init__(self, longer: bool) -> None:
        super().__init__()
        self.gpt2, self.longer = models.gpt2(), longer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.gpt2.transformer(ids).last_hidden_state  # (B, S, d)
        if (ids.shape[1] > 6) == self.longer:
            h = torch.tanh(h)
        return self.gpt2.lm_head(h)


@pytest.mark.parametrize("longer, where", [(True, "on whole sequences but not on a cp rank's chunks"),
                                           (False, "on a cp rank's chunks but not on whole sequences")])
def test_a_branch_on_the_sequence_length_is_refused_under_cp(longer: bool, where: str) -> None:
    with pytest.raises(UnsupportedError, match=rf"node tanh\w* .*runs it {where}: its Python branches or loops on "
                                               rf"the sequence's length"):
        autopar.parallelize(LengthBranch(longer), Mesh(cp=2), example_inputs=(IDS,), example_target=TARGET,
                            loss_fn=models.lm_loss, optimizer=models.adamw)
