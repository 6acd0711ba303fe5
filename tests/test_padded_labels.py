"""Padded or masked labels: the loss is a mean over the counted items of the WHOLE batch.

The first half of the batch has most labels set to ``ignore_index`` (padding, or a prompt left out of
supervised fine-tuning), so the parts of the batch count different numbers of tokens. Averaging each
part's mean with equal weight (what a mean of means does) is 6e-3 off on the first loss here; autopar
divides each part's sum by the whole batch's count (``passes/global_count.py``), so loss, output and every
parameter equal single-device training in float64.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import models
from autopar import Mesh, parallelize
from autopar.runtime.batch import split_batch
from autopar.testing import Report, assert_equivalent, part_weights

IDS = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))
PADDED = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(2))
PADDED[:4, :6] = -100  # the first half counts 6 tokens (below), the second half 32
PADDED[0, 6:] = -100  # ... and the first row none at all


def masked_mean(out: object, target: torch.Tensor) -> torch.Tensor:
    """A loss written by hand: token losses times a mask, over the mask's sum."""
    logits = out.logits.flatten(0, 1)  # (B*S, V)
    mask = (target != -100).flatten()
    losses = F.cross_entropy(logits, target.flatten().clamp(min=0), reduction="none")
    return (losses * mask).sum() / mask.sum()


def _token_losses(out: object, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's cross-entropy (B*S,) and the float mask of the counted tokens (B*S,)."""
    logits = out.logits.flatten(0, 1)  # (B*S, V)
    mask = (target != -100).flatten().to(logits.dtype)
    return F.cross_entropy(logits, target.flatten().clamp(min=0), reduction="none"), mask


def clamped_mean(out: object, target: torch.Tensor) -> torch.Tensor:
    """The masked mean kept finite on a batch without counted tokens."""
    losses, mask = _token_losses(out, target)
    return (losses * mask).sum() / mask.sum().clamp(min=1)


def at_least_one_mean(out: object, target: torch.Tensor) -> torch.Tensor:
    losses, mask = _token_losses(out, target)
    return (losses * mask).sum() / torch.maximum(mask.sum(), torch.tensor(1.0, dtype=mask.dtype))


def shifted_mean(out: object, target: torch.Tensor) -> torch.Tensor:
    """A count with a constant added: one for the whole batch, not one per part."""
    losses, mask = _token_losses(out, target)
    return (losses * mask).sum() / (mask.sum() + 1)


def mean_over_mean(out: object, target: torch.Tensor) -> torch.Tensor:
    """The masked mean as a ratio of means (the numbers of elements cancel)."""
    losses, mask = _token_losses(out, target)
    return (losses * mask).mean() / mask.mean()


def selected_mean(out: object, target: torch.Tensor) -> torch.Tensor:
    """The mean of the token losses a boolean mask selects."""
    losses, mask = _token_losses(out, target)
    return losses[mask.bool()].mean()


def square_mean(out: object, target: torch.Tensor) -> torch.Tensor:
    """A mean over a fixed number of elements: every part weighs the same."""
    return out.logits.pow(2).mean()


def gpt2() -> torch.nn.Module:
    return models.gpt2(layers=2, d=32, heads=4)


CASES = {
    "dp2-adamw": (Mesh(dp=2), models.lm_loss, models.adamw, {}),
    "dp2-masked-mean-zero1": (Mesh(dp=2), masked_mean, models.sgd, {"zero": 1}),
    "pp2-1f1b": (Mesh(pp=2), models.lm_loss, models.sgd, {"schedule": "1f1b", "microbatches": 2}),
    "dp2-tp2-vocab-parallel-zero3": (Mesh(dp=2, tp=2), models.lm_loss, models.adamw, {"zero": 3}),
    "dp2-clamped-count": (Mesh(dp=2), clamped_mean, models.adamw, {}),
    "dp2-maximum-count": (Mesh(dp=2), at_least_one_mean, models.sgd, {}),
    "dp2-shifted-count": (Mesh(dp=2), shifted_mean, models.sgd, {}),
    "dp2-mean-over-mean": (Mesh(dp=2), mean_over_mean, models.adamw, {}),
    "dp2-boolean-index-mean": (Mesh(dp=2), selected_mean, models.adamw, {}),
    "pp2-1f1b-clamped-count": (Mesh(pp=2), clamped_mean, models.sgd, {"schedule": "1f1b", "microbatches": 2}),
    "cp2-clamped-count": (Mesh(cp=2), clamped_mean, models.sgd, {}),
}
SLOW_CASES = {
    "dp2-zero2-microbatches": (Mesh(dp=2), models.lm_loss, models.adamw, {"zero": 2, "microbatches": 2}),
    "pp2-gpipe": (Mesh(pp=2), models.lm_loss, models.adamw, {"schedule": "gpipe", "microbatches": 4}),
    "pp2-interleaved": (Mesh(pp=2), masked_mean, models.adamw,
                        {"schedule": "interleaved-1f1b", "microbatches": 2, "stages_per_rank": 2}),
    "pp2-zb-h1-recompute": (Mesh(pp=2), models.lm_loss, models.adamw,
                            {"schedule": "zb-h1", "microbatches": 2, "recompute": "full"}),
    "dp2-pp2-zbv-zero3": (Mesh(dp=2, pp=2), models.lm_loss, models.sgd,
                          {"schedule": "zbv", "microbatches": 2, "zero": 3}),
    "tp2-sequence-parallel": (Mesh(tp=2), masked_mean, models.adamw, {"sequence_parallel": True}),
    "dp2-pp2-tp2": (Mesh(dp=2, pp=2, tp=2), models.lm_loss, models.adamw, {"microbatches": 2}),
}


def _check(launcher, case: tuple) -> None:
    mesh, loss_fn, optimizer, options = case
    assert_equivalent(gpt2, mesh, (IDS,), PADDED, loss_fn, optimizer, steps=2, launcher=launcher, **options)


@pytest.mark.parametrize("name", sorted(CASES))
def test_padded_labels_are_exact(launcher, name: str) -> None:
    _check(launcher, CASES[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW_CASES))
def test_padded_labels_are_exact_on_every_schedule(launcher, name: str) -> None:
    _check(launcher, SLOW_CASES[name])


def test_the_model_s_own_labels_loss(launcher) -> None:
    """Hugging Face's ``labels=`` loss, which the model computes in float32 even in float64: each part's sum is
    divided by the batch's count in float32, so the run is exact to float32's rounding (a mean of means is
    6e-3 off)."""
    report: list[Report] = []
    assert_equivalent(models.factory(models.llama), Mesh(dp=2), (IDS,), None, None, models.sgd, steps=2,
                      rtol=1e-6, atol=1e-7, kwargs={"labels": PADDED}, launcher=launcher, microbatches=2,
                      update_rtol=1e-6, report=report)
    assert report[0].update_error > 1e-12, report  # (float32 inside: an exact match would mean no division)


def test_the_control_weights_each_part_by_its_counted_tokens() -> None:
    parts = split_batch(((((IDS,), {}), PADDED)), 4, dp=2, microbatches=2)
    assert part_weights(gpt2, parts, models.lm_loss) == [2 / 38, 4 / 38, 16 / 38, 16 / 38]
    assert part_weights(gpt2, parts, square_mean) == [1 / 4] * 4


def test_mixed_precision_with_padded_labels(launcher) -> None:
    assert_equivalent(models.factory(models.gpt2, dtype=torch.float32), Mesh(dp=2), (IDS,), PADDED, models.lm_loss, models.sgd, steps=2, launcher=launcher,
                      precision="mixed", microbatches=2)


def test_the_rank_graph_divides_by_the_batch_count() -> None:
    pm = parallelize(gpt2(), Mesh(dp=2, tp=2), example_inputs=(IDS,), example_target=PADDED, loss_fn=models.lm_loss,
                     optimizer=models.sgd)
    code = pm.graph(1).code
    assert "loss_count_0" in code and "div" in code
    counts = pm.compile((IDS,), {}, PADDED).captured.counts
    assert counts.sources == ["cross_entropy_loss"]
    assert float(counts.count([IDS[:4], PADDED[:4]])[0]) == 6  # rows 1-3 count 2 each, row 0 none


def test_a_count_it_cannot_divide_out_is_named() -> None:
    """A count-normalized term that is not an affine part of the loss stays a mean of means, with a warning."""
    def squared(out: object, target: torch.Tensor) -> torch.Tensor:
        return models.lm_loss(out, target) ** 2

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallelize(gpt2(), Mesh(dp=2), example_inputs=(IDS,), example_target=PADDED, loss_fn=squared,
                    optimizer=models.sgd)
    text = " ".join(str(w.message) for w in caught)
    assert "cross_entropy_loss" in text and "not an affine part" in text, text


def test_a_clamp_applies_to_the_whole_batch_s_count() -> None:
    """A part with no counted token is not clamped to 1 on its own: the clamp is one device's, on the sum."""
    counts = parallelize(gpt2(), Mesh(dp=2), example_inputs=(IDS,), example_target=PADDED, loss_fn=clamped_mean,
                         optimizer=models.sgd).compile((IDS,), {}, PADDED).captured.counts
    assert float(counts.count([IDS[:1], PADDED[:1]])[0]) == 0  # row 0 counts none
    assert [float(c) for c in counts.per_part(torch.zeros(1, dtype=torch.float64), 4)] == [0.25]
    assert [float(c) for c in counts.per_part(torch.full((1,), 6.0, dtype=torch.float64), 4)] == [1.5]


def test_a_division_by_an_unrecognized_count_is_named() -> None:
    """A mean over the part's elements divided by the count: each part would divide by its own."""
    def mean_over_count(out: object, target: torch.Tensor) -> torch.Tensor:
        losses, mask = _token_losses(out, target)
        return (losses * mask).mean() / mask.sum()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallelize(gpt2(), Mesh(dp=2), example_inputs=(IDS,), example_target=PADDED, loss_fn=mean_over_count,
                    optimizer=models.sgd).compile((IDS,), {}, PADDED)
    text = " ".join(str(w.message) for w in caught)
    assert "divides by sum" in text and "not a count" in text, text
