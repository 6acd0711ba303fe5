"""A Llama in plain torch, for planning published Llama 3 runs without Hugging Face installed.

``Llama`` is the Llama 3 architecture (Grattafiori et al. 2024) as torchtitan
trains it: RMSNorm pre-norm blocks, rotary positions (the cos/sin tables
computed once and used by every layer), grouped-query attention (``kv_heads``
key/value heads shared by ``heads / kv_heads`` query heads each), a SwiGLU
feed-forward, an untied output projection. It is written op for op as Hugging
Face's ``LlamaForCausalLM`` computes it (``rotate_half``, the key/value heads
repeated by ``expand`` and ``reshape``), whose capture and tensor-parallel plan
autopar checks. ``llama(...)`` builds one on the meta device (no memory);
``llama3_8b``, ``llama3_70b`` and ``llama3_405b`` are the published sizes.

Invariant: ``forward(ids)`` returns the logits ``(B, S, vocab)``; the model
holds no state besides its parameters and the rotary tables (buffers).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (B, heads, S, D)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (B, kv_heads, S, D)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        groups = self.heads // self.kv_heads
        k, v = (t[:, :, None].expand(b, t.shape[1], groups, s, self.head_dim).reshape(b, -1, s, self.head_dim)
                for t in (k, v))  # (B, heads, S, D)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.self_attn = Attention(hidden, heads, kv_heads)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.mlp = MLP(hidden, ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Llama 3's architecture at any size; ``forward(ids)`` -> logits ``(B, S, vocab)``."""

    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, *, vocab: int = 128256,
                 rope_theta: float = 500000.0) -> None:
        super().__init__()
        for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("kv_heads", kv_heads),
                            ("ffn", ffn), ("vocab", vocab)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Llama {name}={value!r} must be an integer >= 1")
        if hidden % heads or heads % kv_heads:
            raise ValueError(f"Llama hidden={hidden}, heads={heads}, kv_heads={kv_heads}: heads must divide hidden "
                             "and kv_heads must divide heads")
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        dim = hidden // heads
        self.register_buffer("inv_freq", 1.0 / rope_theta ** (torch.arange(0, dim, 2).float() / dim),
                             persistent=False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).float()  # (S,)
        angles = positions[:, None] * self.inv_freq[None, :]  # (S, D/2)
        table = torch.cat((angles, angles), dim=-1)  # (S, D)
        cos, sin = table.cos().to(self.embed_tokens.weight.dtype), table.sin().to(self.embed_tokens.weight.dtype)
        x = self.embed_tokens(ids)  # (B, S, H)
        for block in self.layers:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))  # (B, S, vocab)


def llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, *, vocab: int = 128256) -> Llama:
    """A Llama of the given size on the meta device: no memory, for planning."""
    with torch.device("meta"):
        return Llama(layers, hidden, heads, kv_heads, ffn, vocab=vocab)


def llama3_8b() -> Llama:
    """Llama 3 8B: 32 layers, hidden 4096, 32 heads, 8 key/value heads, feed-forward 14336."""
    return llama(32, 4096, 32, 8, 14336)


def llama3_70b() -> Llama:
    """Llama 3 70B: 80 layers, hidden 8192, 64 heads, 8 key/value heads, feed-forward 28672."""
    return llama(80, 8192, 64, 8, 28672)


def llama3_405b() -> Llama:
    """Llama 3.1 405B: 126 layers, hidden 16384, 128 heads, 8 key/value heads, feed-forward 53248."""
    return llama(126, 16384, 128, 8, 53248)
