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


def test_cp2_counts_ignored_labels_over_the_whole_sequence(launcher) -> None:
    """Labels ignored (-100) on one rank's chunk only: the loss divides by the global count, not each rank's."""
    target = TARGET.clone()
    target[:, 6:] = -100  # chunk 3 of 4: cp rank 0's tail
    target[0, 1] = -100
    assert_equivalent(models.factory(models.gpt2), Mesh(cp=2), (IDS,), target, models.lm_loss, models.adamw,
                      steps=2, rtol=1e-9, atol=1e-10, launcher=launcher)


def test_bert_bidirectional_cp2(launcher) -> None:
    """No causal mask: every block is computed; BERT's position-id buffer is indexed at global positions."""
    assert_equivalent(models.factory(models.bert), Mesh(cp=2), (IDS,), TARGET, models.lm_loss, models.adamw,
                      steps=2, rtol=1e-9, atol=1e-10, launcher=launcher)


IDS16 = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
TARGET16 = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("mesh", [Mesh(cp=4), Mesh(dp=2, cp=2)], ids=["cp4", "dp2cp2"])
def test_wider_meshes_equal_one_device(launcher, name: str, mesh: Mesh) -> None:
    assert_equivalent(models.factory(getattr(models, name)), mesh, (IDS16,), TARGET16, models.lm_loss,
                      models.adamw, steps=2, rtol=1e-9, atol=1e-10, launcher=launcher)
