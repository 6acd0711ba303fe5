"""The float64 exactness check of the test zoo (``tests/test_exactness.py``, ``benchmarks/exactness.py``)."""
from __future__ import annotations

import torch

import models
from autopar import Mesh
from autopar.testing import Report, assert_equivalent

IDS = torch.randint(3, 96, (8, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(3, 96, (8, 8), generator=torch.Generator().manual_seed(2))
ENCODER_DECODERS = {"t5", "bart"}

# Models whose own float32 sums run over the batch, so that a split batch rounds differently on one
# device too; their bound against the whole-batch run is that float32 rounding, amplified by AdamW.
FLOAT32_OVER_BATCH = {
    "gemma2": "its norms multiply by (1 + weight.float()): the weight gradients are float32 sums over the batch",
    "mamba": "the scan's A, D and dt bias are used as float32, and the logits are cast to float32 for the loss",
}
MODEL_BOUND = 1e-5  # relative, for those models against the whole batch (measured up to 4e-7, docs/capabilities.md)

MESHES = {
    "dp2": (Mesh(dp=2), {}),
    "tp2": (Mesh(tp=2), {}),
    "pp2": (Mesh(pp=2), {"microbatches": 2, "schedule": "1f1b"}),
    "dp2-zero3": (Mesh(dp=2), {"zero": 3}),
}


def check(name: str, mesh_name: str, launcher, optimizer=models.adamw, **model_options: object) -> Report:
    """Trains ``name`` of the zoo (built with ``model_options``) two steps on ``mesh_name`` and one device;
    asserts float64 exactness (1e-12), against the control where the model rounds in float32 over the batch
    (see FLOAT32_OVER_BATCH)."""
    mesh, options = MESHES[mesh_name]
    splits = mesh.dp * options.get("microbatches", 1) > 1
    control = splits and name in FLOAT32_OVER_BATCH
    kwargs = {"decoder_input_ids": IDS} if name in ENCODER_DECODERS else None
    report: list[Report] = []
    rtol, atol = (MODEL_BOUND, MODEL_BOUND) if control else (1e-9, 1e-10)
    assert_equivalent(models.factory(getattr(models, name), **model_options), mesh, (IDS,), TARGET, models.lm_loss, optimizer,
                      steps=2, rtol=rtol, atol=atol, kwargs=kwargs, control=control, report=report,
                      launcher=launcher, **options)
    assert all(r.update_error <= 1e-12 for r in report), report
    return report[0]
