"""Context parallelism with attention masks the graph computes (sliding windows, padding), equal to one device.

Each mask is taken from the model captured on whole sequences; a cp rank evaluates its rows (its queries'
global positions against every key, the padding gathered from the cp ranks) and the ring skips the blocks it
leaves empty (``passes/context_masks.py``)."""
from __future__ import annotations

import copy

import functools

import pytest
import torch

import autopar
import models
from autopar import Mesh
from autopar.core.errors import CaptureError, UnsupportedError
from autopar.testing import assert_equivalent
from harness.mixed import assert_mixed

IDS = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(2))
IDS16 = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
TARGET16 = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(4))


def _equivalent(launcher, make: object, mesh: Mesh, ids: torch.Tensor, target: torch.Tensor,
                bounds: dict | None = None, **kwargs: object) -> None:
    assert_equivalent(make, mesh, (ids,), target, models.lm_loss, models.adamw, steps=2, launcher=launcher,
                      kwargs=kwargs or None, **(bounds or {"rtol": 1e-9, "atol": 1e-10}))


@pytest.mark.parametrize("window", [3, 4])
def test_mistral_sliding_window_cp2(launcher, window: int) -> None:
    """A window of 3 or 4 tokens on 8: it binds on the whole sequence (a chunk holds 2, a rank 4 tokens)."""
    _equivalent(launcher, models.factory(models.mistral, window=window), Mesh(cp=2), IDS, TARGET)


def gemma2_sdpa(exact: bool = False) -> torch.nn.Module:
    """Gemma-2 (alternating sliding-window and global layers) without attention soft-capping, on its SDPA
    attention: Hugging Face declines SDPA for Gemma-2 at construction because of soft-capping, so the model is
    built eager and switched (with soft-capping on, eager attention is refused: test_context_parallel.py).
    ``exact``: its norms in the model's dtype (``models.gemma2_exact``)."""
    model = models.gemma2_exact() if exact else models.gemma2()
    model.config.attn_logit_softcapping = None
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    model.config._attn_implementation = "sdpa"
    return model


# Gemma-2's norms compute in float32 and sum their weights' gradients over the tokens in float32: over the cp
# ranks' chunks in another order than on one device, so its bounds are float32's (updates measured within 4.5e-8)
FLOAT32_NORMS = {"rtol": 1e-6, "atol": 1e-7, "update_rtol": 1e-5}


def test_gemma2_alternating_windows_cp2(launcher) -> None:
    """Layer 0 with a window of 4 tokens on 8, layer 1 global (causal): two masks, each from the graph."""
    _equivalent(launcher, gemma2_sdpa, Mesh(cp=2), IDS, TARGET, FLOAT32_NORMS)


def gemma2_exact_sdpa() -> torch.nn.Module:
    return gemma2_sdpa(exact=True)


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_gemma2_with_norms_in_float64_is_exact(launcher, cp: int) -> None:
    """The same two masks, with Gemma-2's norms in the model's dtype: within 1e-12 of one device."""
    _equivalent(launcher, gemma2_exact_sdpa, Mesh(cp=cp), IDS, TARGET)


def test_gemma2_norm_in_the_models_dtype_is_hugging_faces_norm() -> None:
    """The exact variant's norm computes Hugging Face's formula: equal on float32 inputs, and on float64 ones
    within float32's rounding of Hugging Face's (which casts to float32)."""
    hf = models.gemma2().model.norm
    torch.nn.init.normal_(hf.weight, std=0.5)
    ours = models.with_mixin(copy.deepcopy(hf), "Gemma2RMSNorm", models.Gemma2Norm)
    x = torch.randn(3, 5, hf.weight.shape[0], dtype=torch.float64)
    assert torch.equal(ours.float()(x.float()), hf.float()(x.float()))
    torch.testing.assert_close(ours.double()(x), hf.double()(x), rtol=1e-6, atol=1e-7)
    assert not torch.equal(ours.double()(x), hf.double()(x))  # the variant does not round to float32


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
        torch.manual_seed(0)
        self.embed, self.qkv, self.out = torch.nn.Embedding(96, 16), torch.nn.Linear(16, 48), torch.nn.Linear(16, 96)
        self.build = build
        self.to(torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.embed(ids)).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)  # (B, H, S, D) each
        x = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.build(ids.shape[1], ids.device))
        return self.out(x.transpose(1, 2).flatten(2))


def _one_future_token(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril(1)


def _alibi(n: int, device: torch.device) -> torch.Tensor:
    """A float (1, H, S, S) bias: minus each head's slope times the distance, -inf above the diagonal (ALiBi)."""
    pos = torch.arange(n, device=device)
    distance = (pos[None, :] - pos[:, None]).to(torch.float64)  # (S, S): key - query
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64, device=device)[:, None, None]  # (H, 1, 1)
    return (distance.abs() * -slopes).masked_fill(distance > 0, float("-inf"))[None]


def test_float_bias_per_head_cp2(launcher) -> None:
    """A float mask added to the scores, different per head, built from aranges of query and key positions."""
    _equivalent(launcher, functools.partial(MaskedAttention, _alibi), Mesh(cp=2), IDS, TARGET)


def test_mask_from_an_op_without_a_rule_is_refused() -> None:
    """A mask built with ``tril`` over (query, key): no rule follows its dims, so it is refused, naming the op and
    the module it is in."""
    with pytest.raises(UnsupportedError, match=r"node tril.*\(in the model \(MaskedAttention\)\).*no rule for"):
        _compile(MaskedAttention(_one_future_token), Mesh(cp=2), IDS, TARGET)


def test_a_query_by_key_mask_passed_in_is_refused_with_the_fix() -> None:
    """cp cuts inputs along dim 1: a (batch, 1, sequence, sequence) mask would reach a rank's chunks whole."""
    mask = torch.ones(IDS.shape[0], 1, IDS.shape[1], IDS.shape[1], dtype=torch.bool).tril()
    with pytest.raises(UnsupportedError, match=r"\['attention_mask'\] of shape \(\d+, 1, 8, 8\) holds the sequence "
                       r"length 8 in dim 2 but not in dim 1.*\(batch, sequence\) mask"):
        _compile(models.llama(), Mesh(cp=2), IDS, TARGET, attention_mask=mask)


def test_a_capture_that_fails_on_a_mask_kept_whole_names_it() -> None:
    """A (batch, sequence, sequence) mask: dim 1 is cut, dim 2 stays whole, and the capture on one rank's chunks
    fails; the error names the input and says what to pass instead."""
    mask = torch.ones(IDS.shape[0], IDS.shape[1], IDS.shape[1], dtype=torch.bool).tril()
    with pytest.raises(CaptureError, match=r"on one cp rank's chunks(.|\n)*hint: under cp=2 each rank is captured on "
                       r"its 4 of the 8 tokens.*\['attention_mask'\] of shape \(2, 8, 8\)"):
        _compile(models.llama(), Mesh(cp=2), IDS, TARGET, attention_mask=mask)


def _compile(model: torch.nn.Module, mesh: Mesh, ids: torch.Tensor, target: torch.Tensor, **kwargs: object) -> None:
    pm = autopar.parallelize(model, mesh, loss_fn=models.lm_loss, optimizer=models.adamw)
    pm.compile((ids,), kwargs, target)


@pytest.mark.parametrize("name, mesh, kwargs", [
    ("llama", Mesh(dp=2, cp=2), {"padded": True}),
    pytest.param("mistral", Mesh(dp=2, cp=2), {}, marks=pytest.mark.slow),
    pytest.param("mistral", Mesh(cp=4), {}, marks=pytest.mark.slow),
    pytest.param("bert", Mesh(cp=4), {"padded": True}, marks=pytest.mark.slow),
    pytest.param("llama", Mesh(cp=4), {"padded": True}, marks=pytest.mark.slow),
    pytest.param("gemma2_sdpa", Mesh(cp=4), {}, marks=pytest.mark.slow),
])
def test_wider_meshes_with_masks(launcher, name: str, mesh: Mesh, kwargs: dict) -> None:
    """16 tokens: Mistral's window of 4 spans a chunk boundary on every rank at cp=4 (chunks of 2); padded
    sequences (4 and 3 pads, labels ignored there) with the padding gathered from four ranks."""
    ids, target = torch.cat([IDS16, IDS16.flip(1)]), torch.cat([TARGET16, TARGET16.flip(0)])
    make = gemma2_sdpa if name == "gemma2_sdpa" else models.factory(getattr(models, name))
    extra = {}
    if kwargs.get("padded"):
        mask = torch.ones_like(ids)
        mask[0, 12:], mask[1, :3], mask[2, :5], mask[3, 9:] = 0, 0, 0, 0
        target, extra = _ignored(target, mask), {"attention_mask": mask}
    bounds = FLOAT32_NORMS if name == "gemma2_sdpa" else None
    _equivalent(launcher, make, mesh, ids, target, bounds, **extra)


@pytest.mark.parametrize("cp, window", [(2, 3), (4, 3), (4, 5)])
def test_blocks_a_window_leaves_empty_are_skipped(cp: int, window: int) -> None:
    """Each rank computes exactly the (query chunk, key chunk) pairs where its rows of a sliding-window mask
    let some query see some key; the others are skipped."""
    from autopar.core.ring_attention import _pairs, balanced_chunks, positions

    n, c = 4 * cp, 2  # sequence length, chunk length
    q, k = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
    whole = (k <= q) & (k > q - window)  # (S, S)
    blocks = whole.view(2 * cp, c, 2 * cp, c).any(3).any(1)  # (query chunk, key chunk): non-empty
    for me in range(cp):
        rows = whole[positions(2 * c, cp, me)][None, None]  # (1, 1, local, S)
        computed = {(balanced_chunks(cp, me)[a], balanced_chunks(cp, src)[b])
                    for src in range(cp) for a, b, _, _ in _pairs(cp, me, src, False, rows, c)}
        assert computed == {(qc, kc) for qc in balanced_chunks(cp, me) for kc in range(2 * cp) if blocks[qc, kc]}
    assert int(blocks.sum()) < (2 * cp) * (2 * cp + 1) // 2  # fewer than causal attention alone computes


def _gathers() -> tuple[dict[str, int], dict[str, int], list[tuple[int, int]]]:
    """One step of BERT with a padding mask at cp=2: the gathers run (calls, bytes) and the plan's."""
    mask = _padding(False)
    pm = autopar.parallelize(models.bert(), Mesh(cp=2), loss_fn=models.lm_loss, optimizer=models.adamw)
    pm.step(IDS, attention_mask=mask, target=_ignored(TARGET, mask))
    return (pm.communication(calls=True), pm.communication(),
            [(c.count, c.bytes) for c in pm.plan.collectives if c.axis == "cp" and c.op == "all_gather"])


def test_padding_gathers_run_as_planned(launcher) -> None:
    """The padding mask is gathered once per step for all layers: one all-gather of each rank's (2, 4) chunk."""
    for calls, sent, planned in launcher(_gathers, 2):
        assert planned == [(1, 2 * 4 * 8)]
        assert (calls["all_gather@cp"], sent["all_gather@cp"]) == planned[0]



@pytest.mark.parametrize("name, mesh, options", [
    pytest.param("llama_padded", Mesh(tp=2, cp=2), {}, marks=pytest.mark.slow), ("alibi", Mesh(tp=2, cp=2), {}),
    ("mistral", Mesh(cp=2), {"recompute": "full"}), ("llama_padded", Mesh(dp=2, cp=2), {"zero": 3}),
    pytest.param("mistral", Mesh(pp=2, cp=2), {"microbatches": 2}, marks=pytest.mark.slow),
    pytest.param("llama_padded", Mesh(tp=2, cp=2), {"sequence_parallel": True}, marks=pytest.mark.slow),
    *(pytest.param("gemma2_exact", mesh, options, marks=pytest.mark.slow) for mesh, options in (
        (Mesh(dp=2, cp=2), {}), (Mesh(tp=2, cp=2), {}), (Mesh(pp=2, cp=2), {"microbatches": 2}))),
])
def test_masks_compose(launcher, name: str, mesh: Mesh, options: dict) -> None:
    """Masks under tp (LLaMA's heads sharded, the padding's rows broadcast over them; the per-head bias model's
    attention is left whole on each tp rank by the solver), full recomputation (the ring and its mask rows run
    again), ZeRO-3 over dp x cp, and pp and sequence parallelism (-m slow)."""
    ids, target, extra = torch.cat([IDS, IDS.flip(1)]), torch.cat([TARGET, TARGET.flip(0)]), {}
    make = {"alibi": functools.partial(MaskedAttention, _alibi), "mistral": models.factory(models.mistral),
            "llama_padded": models.factory(models.llama), "gemma2_exact": gemma2_exact_sdpa}[name]
    if name == "llama_padded":
        mask = torch.cat([_padding(False), _padding(True)])
        target, extra = _ignored(target, mask), {"attention_mask": mask}
    assert_equivalent(make, mesh, (ids,), target, models.lm_loss, models.adamw, steps=2, rtol=1e-9, atol=1e-10,
                      launcher=launcher, kwargs=extra or None, **options)


@pytest.mark.parametrize("precision", [pytest.param("bf16", marks=pytest.mark.slow), "mixed"])
def test_window_under_mixed_precision(launcher, precision: str) -> None:
    """Mistral's window with bf16 compute (the rings and their mask rows in bf16's graph): within the
    mixed-precision bounds of one device running the same policy (SGD: per parameter too)."""
    assert_mixed(models.factory(models.mistral, dtype=torch.float32), Mesh(cp=2), (IDS,), TARGET, models.lm_loss,
                 models.sgd, 3, launcher, precision)


def test_the_mask_rows_are_computed_once_for_every_layer() -> None:
    """Mistral computes its sliding-window mask once for both layers: the rank's graph computes its rows of it
    once, and both ring attentions read that one value (op counts of the rank's graph, no run needed)."""
    pm = autopar.parallelize(models.mistral(), Mesh(cp=2), loss_fn=models.lm_loss, optimizer=models.adamw)
    pm.compile((IDS,), {}, TARGET)
    graph = pm.graph(0).graph
    rings = [n for n in graph.nodes if n.target is torch.ops.autopar.ring_attention.default]
    masks = {n.args[-1] for n in rings}
    assert len(rings) == 2 and len(masks) == 1 and None not in masks, [n.args[-1] for n in rings]
