"""Context parallelism with attention masks the graph computes (sliding windows, padding), equal to one device.

Each mask is taken from the model captured on whole sequences; a cp rank evaluates its rows (its queries'
global positions against every key, the padding gathered from the cp ranks) and the ring skips the blocks it
leaves empty (``passes/context_masks.py``)."""
from __future__ import annotations

import pytest
import torch

import autopar
import models
from autopar import Mesh
from autopar.core.errors import UnsupportedError
from autopar.testing import assert_equivalent

IDS = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(2))
IDS16 = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
TARGET16 = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(4))


def _equivalent(launcher, make: object, mesh: Mesh, ids: torch.Tensor, target: torch.Tensor, **kwargs: object) -> None:
    assert_equivalent(make, mesh, (ids,), target, models.lm_loss, models.adamw, steps=2, rtol=1e-9, atol=1e-10,
                      launcher=launcher, kwargs=kwargs or None)


@pytest.mark.parametrize("window", [3, 4])
def test_mistral_sliding_window_cp2(launcher, window: int) -> None:
    """A window of 3 or 4 tokens on 8: it binds on the whole sequence (a chunk holds 2, a rank 4 tokens)."""
    _equivalent(launcher, models.factory(models.mistral, window=window), Mesh(cp=2), IDS, TARGET)


def _padding(left: bool) -> torch.Tensor:
    """(2, 8) attention mask: sequence 0 padded at its end (3 tokens), sequence 1 at its start (2 tokens), or both
    at the start (``left``)."""
    mask = torch.ones(2, 8, dtype=torch.long)
    if left:
        mask[0, :3] = 0
    else:
        mask[0, 5:] = 0
    mask[1, :2] = 0
    return mask


def _ignored(target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return target.masked_fill(mask == 0, -100)


@pytest.mark.parametrize("left", [False, True])
def test_bert_padding_mask_cp2(launcher, left: bool) -> None:
    """BERT (bidirectional) with pads on both ends of the sequences; labels ignored at the pads."""
    mask = _padding(left)
    _equivalent(launcher, models.factory(models.bert), Mesh(cp=2), IDS, _ignored(TARGET, mask), attention_mask=mask)


@pytest.mark.parametrize("left", [False, True])
def test_llama_padding_mask_cp2(launcher, left: bool) -> None:
    """A causal LM with right or left padding (a pad query at the start sees no key: its row is 0, not NaN)."""
    mask = _padding(left)
    _equivalent(launcher, models.factory(models.llama), Mesh(cp=2), IDS, _ignored(TARGET, mask), attention_mask=mask)


class MaskedAttention(torch.nn.Module):
    """One attention layer whose mask is ``build(S, device)``."""

    def __init__(self, build: object) -> None:
        super().__init__()
        self.embed, self.qkv, self.out = torch.nn.Embedding(96, 16), torch.nn.Linear(16, 48), torch.nn.Linear(16, 96)
        self.build = build
        self.to(torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.embed(ids)).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)  # (B, H, S, D) each
        x = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.build(ids.shape[1], ids.device))
        return self.out(x.transpose(1, 2).flatten(2))


def _one_future_token(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril(1)


def test_mask_from_an_op_without_a_rule_is_refused() -> None:
    """A mask built with ``tril`` over (query, key): no rule follows its dims, so it is refused, naming the op."""
    with pytest.raises(UnsupportedError, match=r"node tril.*no rule for"):
        _compile(MaskedAttention(_one_future_token), Mesh(cp=2), IDS, TARGET)


def _compile(model: torch.nn.Module, mesh: Mesh, ids: torch.Tensor, target: torch.Tensor, **kwargs: object) -> None:
    pm = autopar.parallelize(model, mesh, loss_fn=models.lm_loss, optimizer=models.adamw)
    pm.compile((ids,), kwargs, target)
