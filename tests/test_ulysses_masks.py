"""Mask tensors under ``cp_attention="all_to_all"``: each rank computes the whole mask from the whole-sequence
graph (the padding gathered from the cp ranks) and attends over the whole sequence for its head group with it
(``passes/context_masks.py``, ``autopar/core/ulysses.py``), equal to one device in float64."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import autopar
import models
from autopar import Mesh
from autopar.core.collectives import Binding, bind
from autopar.core.ring_attention import positions
from autopar.core.ulysses import ulysses_attention
from autopar.testing import assert_equivalent
from test_context_eager import _against_float64_attention
from test_context_masks import IDS, IDS16, TARGET, TARGET16, MaskedAttention, _alibi, _ignored, _padding

B, H, S, D = 2, 4, 16, 8
A2A = {"cp_attention": "all_to_all"}


def _masks(kind: str) -> torch.Tensor:
    """A whole-sequence mask: per-head float bias (1, H, S, S) with -inf entries, or a boolean (B, 1, S, S)
    padding-and-window mask with a row no key may attend."""
    gen = torch.Generator().manual_seed(1)
    if kind == "bias":
        bias = torch.randn(1, H, S, S, dtype=torch.float64, generator=gen)
        return bias.masked_fill((torch.rand(1, H, S, S, generator=gen) < 0.3) & ~torch.eye(S, dtype=torch.bool),
                                float("-inf"))
    pos = torch.arange(S)
    window = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 5)
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[0, :3], keep[1, 13:] = False, False
    return (window[None] & keep[:, None, :])[:, None]  # row 0 of sequence 0 sees no key


def _rank(kind: str) -> float:
    cp, me = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, S, D, dtype=torch.float64, generator=gen) for _ in range(4))
    mask = _masks(kind)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*full, attn_mask=mask, scale=0.3)
    want.backward(dout)
    mine = positions(S // cp, cp, me)
    local = [x[:, :, mine].clone().requires_grad_() for x in (q, k, v)]
    with bind(Binding({"cp": dist.group.WORLD})):
        out = ulysses_attention(*local, 0.3, False, "cp", cp, mask)[0]
        out.backward(dout[:, :, mine])
    errors = [(out - want[:, :, mine]).abs().max()]
    errors += [(x.grad - f.grad[:, :, mine]).abs().max() for x, f in zip(local, full)]
    return float(torch.stack(errors).max())  # (NaN propagates)


@pytest.mark.parametrize("kind", ["bias", "padding"])
def test_masked_ulysses_equals_whole_sequence_attention(launcher, kind: str) -> None:
    """The op with a per-head float bias (each rank reads its head group) and a boolean mask broadcast over
    heads (rows no key may attend give 0, as SDPA's): output and gradients within 1e-13."""
    assert max(launcher(_rank, 2, kind)) < 1e-13


def _equivalent(launcher, make: object, ids: torch.Tensor, target: torch.Tensor, **kwargs: object) -> None:
    assert_equivalent(make, Mesh(cp=2), (ids,), target, models.lm_loss, models.adamw, steps=2, rtol=1e-9, atol=1e-10,
                      launcher=launcher, kwargs=kwargs or None, **A2A)


def test_mistral_sliding_window(launcher) -> None:
    """Mistral's window of 3 tokens on 8 (binding across the ranks' chunks), the mask from the graph."""
    _equivalent(launcher, models.factory(models.mistral, window=3), IDS, TARGET)


def test_llama_padding(launcher) -> None:
    """LLaMA with right and left padding (labels ignored at the pads; a left pad query sees no key)."""
    mask = _padding(True)
    _equivalent(launcher, models.factory(models.llama), IDS, _ignored(TARGET, mask), attention_mask=mask)


def test_bert_padding(launcher) -> None:
    """BERT (bidirectional) padded at the end of one sequence and the start of the other."""
    mask = _padding(False)
    _equivalent(launcher, models.factory(models.bert), IDS, _ignored(TARGET, mask), attention_mask=mask)


def test_per_head_float_bias(launcher) -> None:
    """An ALiBi-like (1, H, S, S) float bias: each rank adds its head group's."""
    _equivalent(launcher, functools.partial(MaskedAttention, _alibi), IDS, TARGET)


def test_llama_eager(launcher) -> None:
    """LLaMA's eager attention (its float mask rewritten into SDPA's): equal to one device on SDPA."""
    _against_float64_attention(launcher, "llama", Mesh(cp=2), A2A)


@pytest.mark.slow
@pytest.mark.parametrize("name, mesh", [("mistral", Mesh(cp=4)), ("llama", Mesh(cp=4)), ("llama", Mesh(dp=2, cp=2))])
def test_wider_meshes(launcher, name: str, mesh: Mesh) -> None:
    """16 tokens: Mistral's window of 4 across chunks of 2 at cp=4; LLaMA padded (4 and 3 pads, labels ignored)."""
    ids, target = torch.cat([IDS16, IDS16.flip(1)]), torch.cat([TARGET16, TARGET16.flip(0)])
    extra = {}
    if name == "llama":
        mask = torch.ones_like(ids)
        mask[0, 12:], mask[1, :3], mask[2, :5], mask[3, 9:] = 0, 0, 0, 0
        target, extra = _ignored(target, mask), {"attention_mask": mask}
    assert_equivalent(models.factory(getattr(models, name)), mesh, (ids,), target, models.lm_loss, models.adamw,
                      steps=2, rtol=1e-9, atol=1e-10, launcher=launcher, kwargs=extra or None, **A2A)


@pytest.mark.slow
@pytest.mark.parametrize("name, mesh, options", [
    ("llama", Mesh(dp=2, cp=2), {"zero": 3}), ("mistral", Mesh(cp=2), {"recompute": "full"}),
    ("mistral", Mesh(pp=2, cp=2), {"microbatches": 2}), ("llama", Mesh(pp=2, cp=2), {"microbatches": 2})])
def test_masks_compose(launcher, name: str, mesh: Mesh, options: dict) -> None:
    """Masks under ZeRO-3 over dp x cp, full recomputation (each all-to-all attention and its mask run again)
    and pp (the mask computed on the stage of its attentions)."""
    ids, target, extra = torch.cat([IDS, IDS.flip(1)]), torch.cat([TARGET, TARGET.flip(0)]), {}
    if name == "llama":
        mask = torch.cat([_padding(False), _padding(True)])
        target, extra = _ignored(target, mask), {"attention_mask": mask}
    assert_equivalent(models.factory(getattr(models, name)), mesh, (ids,), target, models.lm_loss, models.adamw,
                      steps=2, rtol=1e-9, atol=1e-10, launcher=launcher, kwargs=extra or None, **A2A, **options)


def _collectives() -> tuple[dict[str, int], dict[str, int], list[tuple[str, int, int]], str]:
    mask = _padding(False)
    pm = autopar.parallelize(models.llama(), Mesh(cp=2), loss_fn=models.lm_loss, optimizer=models.adamw, **A2A)
    pm.step(IDS, attention_mask=mask, target=_ignored(TARGET, mask))
    return (pm.communication(calls=True), pm.communication(),
            [(c.op, c.count, c.bytes) for c in pm.plan.collectives if c.axis == "cp"], pm.graph(0).code)


def test_masked_exchanges_run_as_planned(launcher) -> None:
    """The padding is gathered once per step (no other collective for the mask); the all-to-alls stay 4 per
    attention each way; calls and bytes of both are what the plan counts."""
    for calls, sent, planned, code in launcher(_collectives, 2):
        gathers = [(n, b) for op, n, b in planned if op == "all_gather"]
        assert gathers == [(1, 2 * 4 * 8)]  # each rank's (2, 4) chunk of the int64 padding
        assert (calls["all_gather@cp"], sent["all_gather@cp"]) == gathers[0]
        a2a = [(n, b) for op, n, b in planned if op == "all_to_all"]
        assert [n for n, _ in a2a] == [8, 8]
        assert (calls["all_to_all@cp"], sent["all_to_all@cp"]) == tuple(map(sum, zip(*a2a)))
        assert code.count("torch.ops.autopar.ulysses_attention.default(") == 2
