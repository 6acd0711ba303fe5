"""Context parallelism on eager attention (matmul-softmax-matmul): each chain rewritten to SDPA, then to the ring
(``passes/context_eager.py``), equal to one device.

GPT-2's and BERT's eager softmax computes in the model's dtype: float64 within 1e-12. LLaMA's and Mistral's
compute it in float32 (``softmax(..., dtype=torch.float32).to(q.dtype)``); the rewritten attention computes in
float64 (docs/decisions.md), so those runs equal one device running the float64 attention (SDPA) within 1e-12,
and differ from the eager model on one device by what its float32 softmax rounds, measured on one device."""
from __future__ import annotations

import functools

import pytest
import torch

import autopar
import models
from autopar import Mesh
from autopar.core.errors import UnsupportedError
from autopar.testing import assert_equivalent, parallel_run, reference_run, relative_errors
from harness.mixed import assert_mixed

IDS = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(2))


def eager(name: str, **kw: object) -> torch.nn.Module:
    """``models.<name>`` on Hugging Face's eager attention."""
    model = getattr(models, name)(**kw)
    model.config._attn_implementation = "eager"
    return model


def _padding() -> torch.Tensor:
    """(2, 8): sequence 0 padded at its end (3 tokens), sequence 1 at its start (2 tokens)."""
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 5:], mask[1, :2] = 0, 0
    return mask


def test_gpt2_eager_cp2(launcher) -> None:
    """GPT-2's eager attention (scores scaled, the causal mask added, a float64 softmax): exact."""
    assert_equivalent(functools.partial(eager, "gpt2"), Mesh(cp=2), (IDS,), TARGET, models.lm_loss, models.adamw,
                      steps=2, rtol=1e-9, atol=1e-10, launcher=launcher)


def test_bert_eager_padding_cp2(launcher) -> None:
    """BERT's eager attention, bidirectional, with a padding mask at both ends: exact."""
    mask = _padding()
    assert_equivalent(functools.partial(eager, "bert"), Mesh(cp=2), (IDS,), TARGET.masked_fill(mask == 0, -100),
                      models.lm_loss, models.adamw, steps=2, rtol=1e-9, atol=1e-10, launcher=launcher,
                      kwargs={"attention_mask": mask})


def _against_float64_attention(launcher, name: str, mesh: Mesh, options: dict | None = None,
                               **kw: object) -> None:
    """A model whose eager softmax is float32: the cp run equals one device on SDPA (float64) within 1e-12, and
    differs from one device on eager attention by no more than SDPA on one device does (the control)."""
    ids, target = (IDS, TARGET) if mesh.dp == 1 else (torch.cat([IDS, IDS.flip(1)]), torch.cat([TARGET, TARGET]))
    args = (ids,), target, models.lm_loss, models.adamw, 2
    one_eager = reference_run(functools.partial(eager, name, **kw), *args)
    one_sdpa = reference_run(functools.partial(getattr(models, name), **kw), *args)
    control, _ = relative_errors(one_eager, one_sdpa)
    assert 1e-12 < control < 1e-5, control  # float32's rounding of the probabilities, no more
    for run in parallel_run(functools.partial(eager, name, **kw), mesh, *args, launcher=launcher,
                            **(options or {})):
        exact, what = relative_errors(one_sdpa, run)
        assert exact < 1e-12, (exact, what)
        off, what = relative_errors(one_eager, run)
        assert off < 1.5 * control, (off, control, what)


def test_llama_eager_cp2(launcher) -> None:
    """LLaMA's eager attention: GQA's repeated K/V heads, RoPE, the causal mask, a float32 softmax."""
    _against_float64_attention(launcher, "llama", Mesh(cp=2))


@pytest.mark.parametrize("window", [3, pytest.param(4, marks=pytest.mark.slow)])
def test_mistral_eager_sliding_window_cp2(launcher, window: int) -> None:
    """Mistral's eager attention with a window of 3 or 4 of 8 tokens (binding across the ranks' chunks)."""
    _against_float64_attention(launcher, "mistral", Mesh(cp=2), window=window)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, options", [(Mesh(tp=2, cp=2), {}), (Mesh(dp=2, cp=2), {"zero": 3}),
                                           (Mesh(pp=2, cp=2), {"microbatches": 2}), (Mesh(cp=4), {})])
def test_llama_eager_composes(launcher, mesh: Mesh, options: dict) -> None:
    """LLaMA's eager attention under tp (heads sharded), ZeRO-3 over dp x cp, pp, and cp=4 (chunks of one token)."""
    _against_float64_attention(launcher, "llama", mesh, options)


@pytest.mark.parametrize("precision", [pytest.param("bf16", marks=pytest.mark.slow), "mixed"])
def test_llama_eager_under_mixed_precision(launcher, precision: str) -> None:
    """bf16 compute: the eager chain (its float32 softmax cast back to bf16) becomes the SDPA path's bf16 ring,
    within the mixed-precision bounds of one device running the eager model under the same policy (SGD)."""
    assert_mixed(functools.partial(eager, "llama", dtype=torch.float32), Mesh(cp=2), (IDS,), TARGET, models.lm_loss,
                 models.sgd, 3, launcher, precision)


class WhereAttention(torch.nn.Module):
    """Attention written as older models write it: scores divided by a 0-dim ``full``, masked by ``where`` with
    the dtype's lowest value (causal, from aranges) and by ``masked_fill`` with -inf (keys more than 4 tokens
    before the query)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.qkv, self.out = torch.nn.Embedding(96, 16), torch.nn.Linear(16, 48), torch.nn.Linear(16, 96)
        self.to(torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.embed(ids)).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)  # (B, H, S, D) each
        pos = torch.arange(ids.shape[1], device=ids.device)
        scores = q @ k.transpose(-1, -2) / torch.full([], 8 ** 0.5, dtype=q.dtype)  # (B, H, S, S)
        scores = torch.where(pos[None, :] <= pos[:, None], scores, torch.finfo(q.dtype).min)
        scores = scores.masked_fill(pos[None, :] < pos[:, None] - 4, float("-inf"))  # a window of 5 tokens
        x = torch.softmax(scores, dim=-1) @ v  # (B, H, S, D)
        return self.out(x.transpose(1, 2).flatten(2))


def test_where_and_masked_fill_forms_cp2(launcher) -> None:
    """The scale as a division by a 0-dim tensor, masks by ``where`` and ``masked_fill``: exact."""
    assert_equivalent(WhereAttention, Mesh(cp=2), (IDS,), TARGET, models.lm_loss, models.adamw, steps=2,
                      rtol=1e-9, atol=1e-10, launcher=launcher)


def test_rewritten_graph_holds_the_ring_and_no_square() -> None:
    """The rank's graph calls the ring once per layer and holds no softmax and no value over (local, local)
    (12 tokens: 6 per rank, no other dim of 6)."""
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    pm = autopar.parallelize(eager("llama"), Mesh(cp=2), loss_fn=models.lm_loss, optimizer=models.adamw)
    pm.compile((ids,), {}, ids)
    gm = pm.graph(0)
    rings = [n for n in gm.graph.nodes if n.target is torch.ops.autopar.ring_attention.default]
    squares = [n for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
               and n.meta["val"].dim() >= 2 and tuple(n.meta["val"].shape[-2:]) == (6, 6)]
    softmaxes = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.softmax.int, torch.ops.aten._softmax.default)]
    assert len(rings) == 2 and not squares and not softmaxes
    assert [n.args[3] for n in rings] == [8 ** -0.5] * 2  # the scale, read from the graph
    assert all(len(n.args) == 7 for n in rings)  # each with the rank's rows of the mask


def test_eager_dropout_in_training_is_refused() -> None:
    """Attention dropout 0.1 while training: refused, naming it (the ring has no dropout)."""
    pm = autopar.parallelize(eager("gpt2", dropout=0.1), Mesh(cp=2), loss_fn=models.lm_loss, optimizer=models.adamw)
    with pytest.raises(UnsupportedError, match=r"dropout_p=0.1; set the attention dropout to 0"):
        pm.compile((IDS,), {}, TARGET)


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_rewritten_capture_computes_the_model(name: str) -> None:
    """The pass alone, on one device: the captured eager graph with each layer's chain as SDPA computes the
    model's logits on SDPA (float64) within 1e-13, and holds no softmax."""
    from autopar.compiler.capture import capture
    from autopar.passes.context_eager import sdpa_from_eager

    model = eager(name)
    cap = capture(model, (IDS,), {}, with_loss=False)
    gm, replaced = sdpa_from_eager(cap.gm)
    assert replaced == 2 and not any(n.target is torch.ops.aten.softmax.int for n in gm.graph.nodes)
    with torch.no_grad():
        got = cap.run({**dict(model.named_parameters()), **dict(model.named_buffers())}, [IDS], gm).logits
        want = getattr(models, name)()(IDS).logits  # the same weights (seeded), on SDPA
    assert float((got - want).norm() / want.norm()) < 1e-13


def test_returned_attention_weights_are_left_alone() -> None:
    """With ``output_attentions=True`` the probabilities are read outside the chain: nothing is replaced (under
    cp the existing check then refuses the softmax over the local sequence)."""
    from autopar.compiler.capture import capture
    from autopar.passes.context_eager import sdpa_from_eager

    cap = capture(eager("llama"), (IDS,), {"output_attentions": True}, with_loss=False)
    assert sdpa_from_eager(cap.gm)[1] == 0
