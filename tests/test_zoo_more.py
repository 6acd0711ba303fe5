"""More Hugging Face families, float64, exact: Qwen3, Gemma-3, OLMo-2, GPT-NeoX, Falcon, StableLM, Granite, RoBERTa,
ModernBERT and the MoE models GPT-OSS (attention sinks), OLMoE and Qwen2-MoE (eager experts).

Each run trains the model (tiny config, random weights) with AdamW for two steps and compares loss, output and
every parameter with one device within 1e-12 relative (``assert_equivalent``) on tp=2, pp=2 (two microbatches,
1F1B), dp=2 with ZeRO-3, and for the MoE models dp=2 x ep=2. Gemma-3 is run with its norms in the model's dtype
(``models.gemma3_exact``): Hugging Face's multiply by ``1 + weight.float()``, a float32 sum over the batch, as
Gemma-2's (``harness/exactness.py``). A few cases run by default, the grid under ``-m slow``.

Context parallelism refuses, naming the node, what a cp rank's chunks cannot compute alone: RoBERTa's positions
(a ``cumsum`` of the padding mask over the sequence), a classifier's first token (BERT's pooler) and a mean over
each sequence's tokens (ModernBERT's mean pooling), Mamba's convolution and scan, a roll, gather, scatter, sort,
flip, split, unfold, narrow or convolution over the tokens, a product summing over them, a view folding them
into blocks, any other op given a sequence dim (softmax, variance, norm, difference), a layer norm or pooling
over the tokens, points spaced over their length and a number computed from it; each trained silently wrong
before. A router's softmax over as
many experts as a rank's tokens is not taken for an attention.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autopar
import models
from autopar import Mesh
from autopar.core.errors import UnsupportedError
from autopar.testing import assert_equivalent
from harness.exactness import IDS, TARGET

MESHES = {
    "tp2": (Mesh(tp=2), {}),
    "pp2": (Mesh(pp=2), {"microbatches": 2, "schedule": "1f1b"}),
    "zero3": (Mesh(dp=2), {"zero": 3}),
    "ep2": (Mesh(dp=2, ep=2), {}),
}
DENSE = ["qwen3", "gemma3_exact", "olmo2", "gpt_neox", "falcon", "stablelm", "granite", "roberta", "modernbert"]
MOE = ["gpt_oss", "olmoe", "qwen2_moe"]  # eager experts, no load-balancing loss (a statistic of the whole batch)
FAST = {("qwen3", "tp2"), ("gemma3_exact", "pp2"), ("olmo2", "tp2"), ("roberta", "zero3"), ("gpt_oss", "ep2"),
        ("qwen2_moe", "tp2")}
GRID = [(name, mesh) for name in DENSE for mesh in ("tp2", "pp2", "zero3")] + \
       [(name, mesh) for name in MOE for mesh in MESHES]


def _exact(name: str, mesh_name: str, launcher) -> None:
    mesh, options = MESHES[mesh_name]
    assert_equivalent(models.factory(getattr(models, name)), mesh, (IDS,), TARGET, models.lm_loss, models.adamw,
                      steps=2, rtol=1e-9, atol=1e-10, launcher=launcher, **options)


@pytest.mark.parametrize("name, mesh_name", [
    pytest.param(name, mesh, marks=() if (name, mesh) in FAST else pytest.mark.slow) for name, mesh in GRID])
def test_family_is_exact(launcher, name: str, mesh_name: str) -> None:
    _exact(name, mesh_name, launcher)


def _compile_cp(model: torch.nn.Module, target: torch.Tensor, loss_fn: object = models.lm_loss) -> None:
    pm = autopar.parallelize(model, Mesh(cp=2), loss_fn=loss_fn, optimizer=models.adamw)
    pm.compile((IDS,), {}, target)


def test_positions_counted_over_the_sequence_are_refused_under_cp() -> None:
    """RoBERTa counts positions with a cumsum of the padding mask: on a rank's chunks it restarted at each chunk
    (trained silently wrong before); refused, naming the op and the way around it (pass ``position_ids``)."""
    with pytest.raises(UnsupportedError, match=r"node cumsum .* accumulates along a dim of the local sequence "
                                               r"length 4.*position_ids="):
        _compile_cp(models.roberta(), TARGET)


LABELS = torch.randint(0, 3, (IDS.shape[0],), generator=torch.Generator().manual_seed(3))


def _classify(out: object, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits, target)


def test_a_classifier_reading_the_first_token_is_refused_under_cp() -> None:
    """BERT's pooler takes each sequence's token 0: rank 1's local token 0 is another token (trained silently wrong
    before, its loss twice one device's); refused, naming the op."""
    with pytest.raises(UnsupportedError, match=r"node select .* takes position 0 along a dim of the local sequence"):
        _compile_cp(models.bert_classifier(), LABELS, _classify)


def test_a_mean_over_the_tokens_is_refused_under_cp() -> None:
    """ModernBERT's mean pooling sums each sequence's tokens: on a rank, its chunks' only (trained silently wrong
    before); refused, naming the op."""
    with pytest.raises(UnsupportedError, match=r"node sum.* reduces over dim 1, of the local sequence length 4"):
        _compile_cp(models.modernbert_classifier("mean"), LABELS, _classify)


def test_mamba_is_refused_under_cp() -> None:
    """Mamba's causal convolution and its scan (position after position, ``select`` along the sequence) read
    across the rank's chunks: trained silently wrong before (the outputs off by order 1); refused at the first,
    the convolution, naming it."""
    with pytest.raises(UnsupportedError, match=r"node conv1d .*\(in backbone.layers.0.mixer \(MambaMixer\)\): it "
                                               r"moves or orders values along dim 2, of the local sequence"):
        _compile_cp(models.mamba(dtype=torch.float64), TARGET)


def _positions(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return (ids % 4)[..., None].expand(-1, -1, x.shape[-1])  # (4: a cp=2 rank's tokens of 8)


MIXERS = {  # kind -> (x (B, S, 16), ids (B, S)) -> (B, S, 16), and the op refused
    "roll": (lambda x, ids: torch.roll(x, 1, dims=1), "roll"),  # a token shift
    "gather": (lambda x, ids: torch.gather(x, 1, _positions(x, ids)), "gather"),
    "sort": (lambda x, ids: torch.sort(x, dim=1).values, "sort"),
    "flip": (lambda x, ids: torch.flip(x, dims=[1]), "flip"),
    "index_select": (lambda x, ids: torch.index_select(x, 1, torch.arange(x.shape[1]).flip(0)), "index_select"),
    "scatter": (lambda x, ids: torch.zeros_like(x).scatter_add(1, _positions(x, ids), x), "scatter_add"),
    "index_add": (lambda x, ids: torch.zeros_like(x).index_add(1, torch.arange(x.shape[1]) // 2, x), "index_add"),
    "chunk": (lambda x, ids: torch.cat(x.chunk(2, dim=1)[::-1], 1), "chunk"),
    "unfold": (lambda x, ids: F.pad(x.unfold(1, 2, 1).sum(-1), (0, 0, 0, 1)), "unfold"),
}
SUMS = {  # kind -> a product summing over the tokens, broadcast to (B, S, 16)
    "matmul": lambda x: (x.transpose(1, 2) @ x).sum(1, keepdim=True),  # (B, 16, 16) summed over features
    "tril": lambda x: torch.tril(torch.ones(x.shape[1], x.shape[1], dtype=x.dtype)) @ x,  # a running sum
    "einsum": lambda x: torch.einsum("bsh,bth->bh", x, x)[:, None],
}


class SequenceMixer(torch.nn.Module):
    """An embedding, one op that mixes values along the sequence (``kind``), a head."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb = torch.nn.Embedding(96, 16, dtype=torch.float64)
        self.conv = torch.nn.Conv1d(16, 16, 3, padding=1, dtype=torch.float64)
        self.head = torch.nn.Linear(16, 96, dtype=torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)  # (B, S, 16)
        if self.kind in MIXERS:
            x = x + MIXERS[self.kind][0](x, ids)
        elif self.kind in SUMS:
            x = x + SUMS[self.kind](x)
        elif self.kind == "fold":  # pairs of tokens as one: (B, S / 2, 32)
            b, s, h = x.shape
            x = x + x.reshape(b, s // 2, 2 * h).flip(-1).reshape(b, s, h)
        elif self.kind == "narrow":
            x = x + torch.cat([x.narrow(1, 1, x.shape[1] - 1), x.narrow(1, 0, 1)], 1)
        else:
            x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)  # over (B, 16, S)
        return self.head(torch.tanh(x))


@pytest.mark.parametrize("kind, op", [(kind, op) for kind, (_, op) in MIXERS.items()] + [("conv", "conv1d")])
def test_an_op_moving_values_along_the_sequence_is_refused_under_cp(kind: str, op: str) -> None:
    """Each trained silently wrong on the chunks before (outputs off by order 1); refused, naming the op."""
    with pytest.raises(UnsupportedError, match=rf"node {op} .*moves or orders values along dim \d, of the local "
                                               rf"sequence length 4"):
        _compile_cp(SequenceMixer(kind), TARGET)


@pytest.mark.parametrize("kind, op", [("matmul", "matmul"), ("tril", "matmul"), ("einsum", "einsum")])
def test_a_product_summing_over_the_sequence_is_refused_under_cp(kind: str, op: str) -> None:
    """A token mixing by a product (``x.transpose(1, 2) @ x``, a lower-triangular running sum, an einsum):
    trained silently wrong on the chunks before; refused, naming the op."""
    with pytest.raises(UnsupportedError, match=rf"node {op} .*sums over dim 1 of a factor \(8, 4, 16\), of the "
                                               rf"local sequence length 4"):
        _compile_cp(SequenceMixer(kind), TARGET)


def test_a_view_folding_the_sequence_into_blocks_is_refused_under_cp() -> None:
    """(B, S, H) viewed as (B, S / 2, 2H): a block held tokens of two chunks wherever a chunk was odd (12 tokens
    on cp=2: loss 4.51 against one device's 4.69); refused, naming the view."""
    with pytest.raises(UnsupportedError, match=r"node reshape .*views \(8, 4, 16\) as \(8, 2, 32\), folding "
                                               r"the local sequence"):
        _compile_cp(SequenceMixer("fold"), TARGET)


def test_a_narrow_inside_the_sequence_is_refused_under_cp() -> None:
    with pytest.raises(UnsupportedError, match=r"node narrow .*slices \[1:4\] along a dim of the local sequence"):
        _compile_cp(SequenceMixer("narrow"), TARGET)


ALONG = {  # kind -> (x (B, S, 16)) -> (B, S, 16): an op computing along the tokens, and the op refused
    "softmax": (lambda x: x * torch.softmax(x, dim=1), "softmax"),
    "var": (lambda x: x + x.var(1, keepdim=True), "var"),
    "norm": (lambda x: x / x.norm(dim=1, keepdim=True), "linalg_vector_norm"),
    "diff": (lambda x: x + F.pad(x.diff(dim=1), (0, 0, 1, 0)), "diff"),
    "pool": (lambda x: x + F.avg_pool1d(x.transpose(1, 2), 3, 1, 1).transpose(1, 2), "avg_pool1d"),
    "layer_norm": (lambda x: F.layer_norm(x.transpose(1, 2), (x.shape[1],)).transpose(1, 2), "layer_norm"),
    "linspace": (lambda x: x + torch.linspace(0, 3, x.shape[1], dtype=x.dtype)[None, :, None], "linspace"),
    "length": (lambda x: x * (x.shape[1] / 8), "mul"),  # a number from the sequence's length
}


class AlongTheTokens(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.op = ALONG[kind][0]
        self.emb = torch.nn.Embedding(96, 16, dtype=torch.float64)
        self.head = torch.nn.Linear(16, 96, dtype=torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.op(self.emb(ids))))


@pytest.mark.parametrize("kind", ALONG)
def test_an_op_computing_along_the_sequence_is_refused_under_cp(kind: str) -> None:
    """A softmax, variance, norm, difference, pooling or layer norm over the tokens, points spaced over the
    sequence's length and a number computed from it: each accepted and trained silently wrong on the chunks
    before (outputs off by 0.2-0.9); refused, naming the op."""
    with pytest.raises(UnsupportedError, match=rf"node {ALONG[kind][1]} .*(computes along dim \d, of the local "
                                               rf"sequence length 4|spaces 4 points|takes 0.5 on a rank's chunks "
                                               rf"but 1.0 on whole sequences)"):
        _compile_cp(AlongTheTokens(kind), TARGET)


def test_a_router_over_as_many_experts_as_local_tokens_runs_under_cp(launcher) -> None:
    """OLMoE's router softmax over 4 experts, on the tokens flattened (32, 4), where a cp rank holds 4 tokens of
    each sequence: refused before as an attention over the local sequence; exact."""
    assert_equivalent(models.factory(models.olmoe, layers=1), Mesh(cp=2), (IDS,), TARGET, models.lm_loss,
                      models.adamw, steps=2, rtol=1e-9, atol=1e-10, launcher=launcher)


class TokenLinear(torch.nn.Module):
    """MLP-Mixer's token mixing: a Linear over the 8 positions."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(96, 16, dtype=torch.float64)
        self.tok = torch.nn.Linear(8, 8, dtype=torch.float64)
        self.head = torch.nn.Linear(16, 96, dtype=torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        return self.head(x + self.tok(x.transpose(1, 2)).transpose(1, 2))


def test_a_layer_sized_by_the_sequence_fails_capture_with_the_reason_under_cp() -> None:
    """Capture on a rank's 4 tokens fails in torch's shape check; the error says why (raw before)."""
    from autopar.core.errors import CaptureError

    with pytest.raises(CaptureError, match=r"(?s)on one cp rank's chunks.*hint: under cp=2 each rank is captured on "
                                           r"its 4 of the 8 tokens .* a layer sized by the sequence's length"):
        _compile_cp(TokenLinear(), TARGET)
