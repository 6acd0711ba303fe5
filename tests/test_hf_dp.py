"""Hugging Face GPT-2, LLaMA and BERT (small configs, random weights) with dp=2 equal single-device."""
from __future__ import annotations

import pytest
import torch

import models
from autopar import Mesh
from autopar.testing import Report, assert_equivalent

IDS = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_hf_model_dp2(launcher, name: str) -> None:
    make = models.factory(getattr(models, name))
    assert_equivalent(make, Mesh(dp=2), (IDS,), TARGET, models.lm_loss, models.adamw, steps=2, rtol=1e-9, atol=1e-10,
                      launcher=launcher)


def test_model_computes_its_own_loss_from_labels(launcher) -> None:
    """No loss_fn: the model's ``loss`` output (labels passed as a keyword) is the loss.

    Hugging Face computes that loss in float32 even for a float64 model: over a batch split in two it
    rounds differently on one device too. So the run is exact against that split (the control) and
    within float32's tolerance of the whole-batch run.
    """
    report: list[Report] = []
    assert_equivalent(models.factory(models.llama), Mesh(dp=2), (IDS,), None, None, models.sgd, steps=2,
                      rtol=1e-6, atol=1e-7, kwargs={"labels": TARGET}, launcher=launcher, control=True,
                      report=report)
    assert report[0].update_error <= 1e-12 < report[0].control_error, report


def test_bert_with_attention_mask_and_token_types(launcher) -> None:
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[:, 6:] = 0
    types = torch.zeros(4, 8, dtype=torch.long)
    types[:, 4:] = 1
    assert_equivalent(models.factory(models.bert), Mesh(dp=2), (IDS,), TARGET, models.lm_loss, models.adamw,
                      steps=2, rtol=1e-9, atol=1e-10, kwargs={"attention_mask": mask, "token_type_ids": types},
                      launcher=launcher)
