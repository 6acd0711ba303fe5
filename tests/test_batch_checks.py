"""Where dp ranks or microbatches split the batch, an op computing along the samples is refused by name: each
share sees its own samples only, and each of these trained silently wrong before (a softmax over the batch on
dp=2: outputs off by 1.5; centering by the batch mean on pp=2 with two microbatches: off by 0.46; a pairwise
distance loss on dp=2: loss 5.836 against one device's 5.660). Per-sample ops (a label's logit picked by
``arange`` over the flattened tokens) and ops along other dims are not refused, and the check stays off where
nothing splits the batch (tp=2)."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import models
from autopar import Mesh, UnsupportedError, parallelize
from autopar.testing import assert_equivalent
from harness.exactness import IDS, TARGET


class Mixer(nn.Module):
    """An embedding, one op over the samples (``kind``), a head."""

    def __init__(self, kind: str = "") -> None:
        super().__init__()
        self.kind = kind
        self.emb, self.fc, self.head = nn.Embedding(96, 16), nn.Linear(16, 16), nn.Linear(16, 96)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)  # (B, S, 16)
        if self.kind == "softmax":
            x = x * torch.softmax(x.sum(-1, keepdim=True), dim=0)
        elif self.kind == "center":
            x = x - x.mean(0, keepdim=True)
        elif self.kind == "maxnorm":
            x = x / x.abs().amax()
        elif self.kind == "whole-center":
            x = (x - x.mean()) / x.std()
        elif self.kind == "scaled":
            x = x * x.norm().sigmoid()
        return self.head(torch.tanh(self.fc(x)))


def make(kind: str = "") -> nn.Module:
    torch.manual_seed(0)
    return Mixer(kind).double()


def ce(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, 96), t.reshape(-1))


def pairwise(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    z = out.mean(1)  # (B, 96)
    return ce(out, t) + torch.cdist(z, z).mean()


def contrastive(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    z = F.normalize(out.mean(1), dim=-1)
    return ce(out, t) + F.cross_entropy(z @ z.T, torch.arange(z.shape[0]))


def gram(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    z = out.mean(1)
    return ce(out, t) + (z.T @ z).pow(2).mean()


def first(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ce(out, t) + out[0].pow(2).mean()


def picked(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    flat = out.reshape(-1, 96).log_softmax(-1)
    return -flat[torch.arange(flat.shape[0]), t.reshape(-1)].mean()


@pytest.mark.parametrize("kind, loss, mesh, options, match", [
    ("softmax", ce, Mesh(dp=2), {}, r"dp=2 splits the batch, and node softmax .* computes along the samples"),
    ("center", ce, Mesh(pp=2), {"microbatches": 2},
     r"microbatches=2 splits the batch, and node mean .* reduces over the samples but not over every dim"),
    ("", pairwise, Mesh(dp=2), {}, r"node cdist .* relates the samples to each other"),
    ("", contrastive, Mesh(dp=2), {}, r"node matmul .* relates the samples to each other"),
    ("", gram, Mesh(dp=2), {}, r"node matmul .* sums over the samples"),
    ("", first, Mesh(dp=2), {}, r"node select .* takes one sample: on each share of 4 samples"),
], ids=["softmax", "center", "cdist", "contrastive", "gram", "first"])
def test_an_op_along_the_samples_is_refused_where_the_batch_is_split(kind: str, loss, mesh: Mesh, options: dict,
                                                                     match: str) -> None:
    pm = parallelize(make(kind), mesh, loss_fn=loss, optimizer=models.adamw, **options)
    with pytest.raises(UnsupportedError, match=match):
        pm.compile((IDS,), {}, TARGET)


def test_the_same_op_runs_where_nothing_splits_the_batch() -> None:
    parallelize(make("center"), Mesh(tp=2), loss_fn=ce, optimizer=models.adamw).compile((IDS,), {}, TARGET)


def test_a_label_picked_per_token_is_exact_on_dp2(launcher) -> None:
    assert_equivalent(functools.partial(make, ""), Mesh(dp=2), (IDS,), TARGET, picked, models.adamw, steps=2,
                      rtol=1e-9, atol=1e-10, launcher=launcher)


def summed(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, 96), t.reshape(-1), reduction="sum") / 64  # one device's 8 x 8 tokens


@pytest.mark.parametrize("loss, warned", [(summed, True), (ce, False), (picked, False)],
                         ids=["sum-over-a-number", "mean", "picked-mean"])
def test_a_loss_summing_over_the_samples_is_named_where_the_batch_is_split(loss, warned: bool) -> None:
    """A sum over the batch divided by a number (one device's token count) came out halved on dp=2 (each rank's
    sum over its half, averaged); the contract's loss is a mean: a warning names the sum."""
    import warnings

    pm = parallelize(make(), Mesh(dp=2), loss_fn=loss, optimizer=models.adamw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm.compile((IDS,), {}, TARGET)
    named = [w for w in caught if "the loss sums over the samples" in str(w.message)]
    assert bool(named) == warned, [str(w.message) for w in caught]
    if warned:
        assert "cross_entropy_loss" in str(named[0].message) and "dp=2 split the batch" in str(named[0].message)


def weighted(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    m = (t > 10).double()
    return (F.cross_entropy(out.reshape(-1, 96), t.reshape(-1), reduction="none") * (m / m.sum()).reshape(-1)).sum()


def masked(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    m = (t > 10).double().reshape(-1)
    return (F.cross_entropy(out.reshape(-1, 96), t.reshape(-1), reduction="none") * m).sum() / m.sum().clamp(min=1)


@pytest.mark.parametrize("kind, loss, mesh, options, match", [
    ("maxnorm", ce, Mesh(dp=2), {}, r"dp=2 splits the batch, and node div .* combines embedding with amax"),
    ("whole-center", ce, Mesh(cp=2), {}, r"cp=2 splits the sequence, and node sub .* combines embedding with mean"),
    ("scaled", ce, Mesh(pp=2), {"microbatches": 2},
     r"microbatches=2 splits the batch, and node mul .* with linalg_vector_norm"),
    ("", weighted, Mesh(dp=2), {}, r"node div .* combines \w+ with sum"),
], ids=["max-dp", "standardized-cp", "norm-microbatches", "count-weights-dp"])
def test_a_statistic_of_a_share_combined_with_its_values_is_refused(kind: str, loss, mesh: Mesh, options: dict,
                                                                    match: str) -> None:
    """One number from all of a share's values (its max, mean, norm, count) used on those values again: each
    share's number is its own (``x / x.abs().amax()`` on dp=2 trained silently wrong before)."""
    pm = parallelize(make(kind), mesh, loss_fn=loss, optimizer=models.adamw, **options)
    with pytest.raises(UnsupportedError, match=match):
        pm.compile((IDS,), {}, TARGET)


@pytest.mark.parametrize("mesh", [Mesh(dp=2), Mesh(cp=2)], ids=["dp", "cp"])
def test_a_loss_over_its_count_is_not_a_share_statistic(mesh: Mesh) -> None:
    """Statistics combined with each other only (a masked sum over its count) are the runtime's to combine."""
    parallelize(make(), mesh, loss_fn=masked, optimizer=models.adamw).compile((IDS,), {}, TARGET)


def test_an_input_without_the_batch_at_dim0_says_where_a_shared_tensor_belongs() -> None:
    from autopar.runtime.batch import split_batch

    table = torch.zeros(5, 16)
    with pytest.raises(ValueError, match=r"input tensor #1 has dim 0 of size 5 but the batch is 8; .* register it "
                                         r"as a buffer"):
        split_batch(((IDS, table), {}), 2, dp=2, microbatches=1)
