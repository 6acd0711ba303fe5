"""Under cp each rank holds a share of every sequence's tokens, and the loss is averaged over the cp ranks: a loss
that sums over the tokens without dividing by their number (a per-sample loss, ``ce(reduction="sum") / batch``
or ``kl_div(reduction="batchmean")`` on (B, S, V), exact under dp) came out cp times too small, and so did every
gradient. Refused, naming the node; a mean over the tokens and a sum over a count of the inputs still compile."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autopar
import models
from autopar import Mesh
from autopar.core.errors import UnsupportedError

IDS = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(2))


def _tokens(out: object) -> torch.Tensor:
    """GPT-2's logits on the tokens flattened: (B * S, V)."""
    return out.logits.reshape(-1, out.logits.shape[-1])


def _per_sample(out: object, target: torch.Tensor) -> torch.Tensor:
    """Each sequence's summed token loss, averaged over the sequences."""
    return F.cross_entropy(_tokens(out), target.reshape(-1), reduction="sum") / target.shape[0]


def _summed_then_scaled(out: object, target: torch.Tensor) -> torch.Tensor:
    losses = F.cross_entropy(_tokens(out), target.reshape(-1), reduction="none")  # (B * S,)
    return 0.01 * losses.sum()


def _kl_per_sample(out: object, target: torch.Tensor) -> torch.Tensor:
    """A distillation-style KL divergence on (B, S, V), ``"batchmean"``: its sum over the tokens over B."""
    soft = F.one_hot(target, out.logits.shape[-1]).to(out.logits.dtype) * 0.9 + 0.1 / out.logits.shape[-1]
    return F.kl_div(out.logits.log_softmax(-1), soft, reduction="batchmean")


def _per_position(out: object, target: torch.Tensor) -> torch.Tensor:
    """Each position's loss averaged over the sequences, summed over the positions."""
    return F.cross_entropy(out.logits.transpose(1, 2), target, reduction="none").mean(0).sum()


def _masked_mean(out: object, target: torch.Tensor) -> torch.Tensor:
    losses = F.cross_entropy(out.logits.transpose(1, 2), target, reduction="none")  # (B, S)
    mask = (target > 10).to(losses.dtype)
    return (losses * mask).sum() / mask.sum()


def _compile(loss_fn: object, mesh: Mesh) -> None:
    autopar.parallelize(models.gpt2(), mesh, example_inputs=(IDS,), example_target=TARGET, loss_fn=loss_fn,
                        optimizer=models.adamw)


@pytest.mark.parametrize("loss_fn", [_per_sample, _summed_then_scaled, _kl_per_sample])
@pytest.mark.parametrize("mesh", [Mesh(cp=2), Mesh(dp=2, cp=2)])
def test_a_loss_summed_over_the_tokens_is_refused_under_cp(loss_fn: object, mesh: Mesh) -> None:
    """Trained with the loss and gradients halved at cp=2 before (a per-sample loss of 20.6, one device's 41.3)."""
    with pytest.raises(UnsupportedError, match=r"node (cross_entropy_loss|sum|kl_div).* sums over the tokens of "
                                               r"\((16|8|4|2)(, 4)?(, 96)?,?\) \(local sequence length 4\).*cp "
                                               r"times too small"):
        _compile(loss_fn, mesh)


@pytest.mark.parametrize("loss_fn", [models.lm_loss, _masked_mean])
def test_a_mean_over_the_tokens_compiles_under_cp(loss_fn: object) -> None:
    _compile(loss_fn, Mesh(cp=2))


def test_a_loss_per_position_summed_is_refused_under_cp() -> None:
    """``losses.mean(0).sum()``: a mean over the samples, then a sum over the rank's positions."""
    with pytest.raises(UnsupportedError, match=r"node sum.* sums over the tokens of \(4,\) \(local sequence length 4\)"):
        _compile(_per_position, Mesh(cp=2))
