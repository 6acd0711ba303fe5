"""A GPT in plain torch, for planning published GPT sizes without Hugging Face installed.

``GPT`` is the GPT-2 architecture (Radford et al. 2019) as Megatron-LM's GPT
runs of Narayanan et al. 2021 use it: learned positions, pre-norm blocks,
fused query/key/value projection, tanh GeLU, output projection tied to the
token embedding. It is written op for op as Hugging Face's
``GPT2LMHeadModel`` computes it (``Conv1D`` weights stored (in, out) and
applied with ``addmm``; the same module names), so its captured graph, and the
planner's profile of it, is that model's: ``tests/test_planner_gpt.py``
compares the two profiles. ``gpt(layers, hidden, heads)`` builds one on the
meta device (no memory); ``gpt3_175b`` and ``gpt_1t`` are the presets.

Invariant: ``forward(ids)`` returns the logits ``(B, S, vocab)``; the model
holds no state besides its parameters.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Projection(nn.Module):
    """``x @ weight + bias`` with the weight stored (in, out), as GPT-2's ``Conv1D`` (one ``addmm``)."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(inputs, outputs))
        self.bias = nn.Parameter(torch.zeros(outputs))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)  # (B*S, out)
        return out.view(*x.shape[:-1], self.weight.shape[1])


class TanhGelu(nn.Module):
    """GeLU with the tanh approximation, written out as GPT-2 computes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.hidden, self.head_dim = hidden, hidden // heads
        self.c_attn = Projection(hidden, 3 * hidden)
        self.c_proj = Projection(hidden, hidden)
        self.resid_dropout = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(self.hidden, dim=2)  # (B, S, H) each
        shape = (*x.shape[:-1], -1, self.head_dim)
        k, v, q = (t.view(shape).transpose(1, 2) for t in (k, v, q))  # (B, heads, S, D)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=self.head_dim**-0.5,
                                             is_causal=True)
        out = out.reshape(out.shape[0], -1, q.shape[2], v.shape[-1]).transpose(1, 2).contiguous()  # (B, S, heads, D)
        return self.resid_dropout(self.c_proj(out.reshape(*out.shape[:-2], -1)))


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.c_fc = Projection(hidden, 4 * hidden)
        self.act = TanhGelu()
        self.c_proj = Projection(4 * hidden, hidden)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=1e-5)
        self.attn = Attention(hidden, heads)
        self.ln_2 = nn.LayerNorm(hidden, eps=1e-5)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(self.ln_1(x)) + x
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, positions: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(positions, hidden)
        self.drop = nn.Dropout(0.0)
        self.h = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden, eps=1e-5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)  # (1, S)
        x = self.drop(self.wte(ids) + self.wpe(positions))  # (B, S, H)
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT(nn.Module):
    """GPT-2's architecture at any size; ``forward(ids)`` -> logits ``(B, S, vocab)``."""

    def __init__(self, layers: int, hidden: int, heads: int, *, vocab: int = 51200, positions: int = 2048) -> None:
        super().__init__()
        for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("vocab", vocab),
                            ("positions", positions)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPT {name}={value!r} must be an integer >= 1")
        if hidden % heads:
            raise ValueError(f"GPT hidden={hidden} does not divide into heads={heads}; use a hidden size that is a "
                             f"multiple of {heads} (e.g. {heads * max(1, round(hidden / heads))})")
        self.transformer = Transformer(layers, hidden, heads, vocab, positions)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as GPT-2's

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer(ids))  # (B, S, vocab)


def gpt(layers: int, hidden: int, heads: int, *, vocab: int = 51200, positions: int = 2048) -> GPT:
    """A GPT of the given size on the meta device: no memory, for planning."""
    with torch.device("meta"):
        return GPT(layers, hidden, heads, vocab=vocab, positions=positions)


def gpt3_175b() -> GPT:
    """GPT-3 175B (Brown et al. 2020): 96 layers, hidden 12288, 96 heads, 2048 positions, on the meta device."""
    return gpt(96, 12288, 96, vocab=50257)


def gpt_1t() -> GPT:
    """The trillion-parameter GPT of Narayanan et al. 2021 (Table 1's last row): 128 layers, hidden 25600,
    160 heads, vocabulary 51200, on the meta device."""
    return gpt(128, 25600, 160)
