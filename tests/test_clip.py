"""Gradient clipping by the global norm equals ``clip_grad_norm_`` on one device, on every kind of mesh."""
from __future__ import annotations

import pytest
import torch

import models
from autopar import Mesh, parallelize
from autopar.testing import assert_equivalent

IDS = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(2))
MAX_NORM = 0.05  # well below GPT-2's gradient norm here (about 3): every step is clipped


@pytest.mark.parametrize("sizes,zero", [
    (dict(dp=2), 0), (dict(dp=2), 2), (dict(pp=2), 0), (dict(tp=2), 0),
    (dict(dp=2, pp=2), 1), (dict(dp=2, tp=2), 3), pytest.param(dict(dp=2, pp=2, tp=2), 3, marks=pytest.mark.slow),
])
def test_clipped_training_equals_single_device(launcher, sizes: dict, zero: int) -> None:
    """GPT-2's tied embeddings sit on both pipeline ends, and its q|k|v and vocab are tp-sharded."""
    mesh = Mesh(**sizes)
    assert_equivalent(models.factory(models.gpt2, layers=4), mesh, (IDS,), TARGET, models.lm_loss, models.sgd,
                      steps=3, rtol=1e-9, atol=1e-10, launcher=launcher, zero=zero, bucket_mb=1e-3,
                      max_grad_norm=MAX_NORM, microbatches=2 if mesh.pp > 1 else 1)


def _norms(sizes: dict, zero: int) -> float:
    pm = parallelize(models.gpt2(layers=4), Mesh(**sizes), loss_fn=models.lm_loss, optimizer=models.sgd, zero=zero,
                     max_grad_norm=1e9)
    pm.step(IDS, target=TARGET)
    return pm.grad_norm


def test_the_global_norm_is_the_single_device_norm(launcher) -> None:
    model = models.gpt2(layers=4)
    models.lm_loss(model(IDS), TARGET).backward()
    want = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    assert want > 20 * MAX_NORM
    for sizes, zero in [(dict(dp=2, pp=2), 0), (dict(tp=2, pp=2), 0), (dict(dp=2, tp=2), 1), (dict(dp=4), 3)]:
        for norm in launcher(_norms, Mesh(**sizes).size, sizes, zero):
            assert norm == pytest.approx(want, rel=1e-12), (sizes, zero)


def test_a_norm_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="max_grad_norm=0 must be > 0"):
        parallelize(models.mlp((4, 2)), Mesh(dp=1), max_grad_norm=0)
