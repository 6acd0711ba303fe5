"""Context parallelism (``Mesh(cp=...)``): ring attention over balanced sequence chunks equals one device."""
from __future__ import annotations

import pytest
import torch

import models
from autopar import Mesh
from autopar.testing import assert_equivalent

IDS = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_cp2_equals_one_device(launcher, name: str) -> None:
    """Causal attention rewritten to a ring over two ranks; positions (learned, RoPE) global; AdamW."""
    assert_equivalent(models.factory(getattr(models, name)), Mesh(cp=2), (IDS,), TARGET, models.lm_loss,
                      models.adamw, steps=2, rtol=1e-9, atol=1e-10, launcher=launcher)
