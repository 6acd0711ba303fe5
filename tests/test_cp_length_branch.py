"""A model whose Python branches on the sequence's length (``if S > 6: x = x.tanh()``) is captured on a cp rank's
chunks down the local length's branch: each rank ran the other branch than one device and trained silently wrong.
The graph captured on whole sequences runs an op the rank's does not; refused, naming it."""
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
    """GPT-2 whose hidden states are squashed for sequences longer than 6 tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt2 = models.gpt2()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.gpt2.transformer(ids).last_hidden_state  # (B, S, d)
        if ids.shape[1] > 6:
            h = torch.tanh(h)
        return self.gpt2.lm_head(h)


def test_a_branch_on_the_sequence_length_is_refused_under_cp() -> None:
    with pytest.raises(UnsupportedError, match=r"node tanh\w* .*runs it on whole sequences but not on a cp rank's "
                                               r"chunks: its Python branches or loops on the sequence's length"):
        autopar.parallelize(LengthBranch(), Mesh(cp=2), example_inputs=(IDS,), example_target=TARGET,
                            loss_fn=models.lm_loss, optimizer=models.adamw)
