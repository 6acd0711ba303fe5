"""Models written by hand for the tests, each one built around a form of graph the capture must handle:
a fused projection read by slices, experts in a Python loop, attention by SDPA's CPU kernel. ``models``
re-exports them."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FeedForward", "FusedSliceBlock", "FusedSliceLM", "KernelAttention", "LoopMoE", "LoopMoELM",
           "fused_slice", "kernel_attention", "loop_moe"]


class FusedSliceBlock(nn.Module):
    """Attention reading q, k and v by slicing one projection (GQA widths), an MLP chunking gate|up."""

    def __init__(self, d: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, (heads + 2 * kv_heads) * self.hd)
        self.out = nn.Linear(d, d)
        self.gate_up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(self.norm(x))  # (B, S, (H + 2 KV) D)
        q_end, k_end = self.heads * self.hd, (self.heads + self.kv_heads) * self.hd
        q = qkv[..., :q_end].view(b, s, self.heads, self.hd).transpose(1, 2)  # (B, H, S, D)
        k = qkv[..., q_end:k_end].view(b, s, self.kv_heads, self.hd).transpose(1, 2)  # (B, KV, S, D)
        v = qkv[..., k_end:].view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        rep = self.heads // self.kv_heads  # each kv head serves rep query heads
        k = k[:, :, None].expand(b, self.kv_heads, rep, s, self.hd).reshape(b, self.heads, s, self.hd)
        v = v[:, :, None].expand(b, self.kv_heads, rep, s, self.hd).reshape(b, self.heads, s, self.hd)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.out(att)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class FusedSliceLM(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, kv_heads: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(FusedSliceBlock(d, heads, kv_heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # (B, S, vocab)


def fused_slice(vocab: int = 96, d: int = 32, heads: int = 4, kv_heads: int = 2, layers: int = 2,
                dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return FusedSliceLM(vocab, d, heads, kv_heads, layers).to(dtype)


class FeedForward(nn.Module):
    """A SwiGLU feed-forward: one expert, or the shared expert."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LoopMoE(nn.Module):
    """Routed experts in plain PyTorch: router, scores, top-k, a loop over the experts, a weighted combine."""

    def __init__(self, d: int, hidden: int, experts: int, top_k: int, score: str, shared: bool) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(d, hidden) for _ in range(experts))
        self.shared = FeedForward(d, hidden) if shared else None
        self.top_k, self.score = top_k, score

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, d = x.shape
        x = x.reshape(b * s, d)  # (T, d)
        logits = self.router(x)  # (T, E)
        scores = torch.sigmoid(logits) if self.score == "sigmoid" else F.softmax(logits, dim=-1)
        weights, chosen = torch.topk(scores, self.top_k, dim=-1)  # (T, k)
        if self.score == "sigmoid":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        if self.shared is not None:
            out = out + self.shared(x)
        # load balance (Switch): experts' share of routed slots times their mean score
        share = F.one_hot(chosen, len(self.experts)).sum(dim=(0, 1)).to(x.dtype) / chosen.numel()
        aux = len(self.experts) * (share * scores.mean(dim=0)).sum()
        return out.reshape(b, s, d), aux


class LoopMoELM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, experts: int, top_k: int, score: str, shared: bool,
                 aux: bool) -> None:
        super().__init__()
        self.aux = aux
        self.embed = nn.Embedding(vocab, d)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.moes = nn.ModuleList(LoopMoE(d, 2 * d, experts, top_k, score, shared) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor] | torch.Tensor:
        x = self.embed(ids)
        aux = x.new_zeros(())
        for norm, moe in zip(self.norms, self.moes):
            y, a = moe(norm(x))
            x, aux = x + y, aux + a
        logits = self.head(x)  # (B, S, vocab)
        return {"logits": logits, "aux_loss": aux} if self.aux else logits


def loop_moe(vocab: int = 96, d: int = 16, layers: int = 2, experts: int = 4, top_k: int = 2,
             score: str = "softmax", shared: bool = True, aux: bool = True, dtype: torch.dtype = torch.float64,
             seed: int = 0) -> nn.Module:
    """``aux``: the output is a dict with the load-balancing loss (a statistic of the whole batch, so a run that
    splits the batch computes another one, as every data-parallel MoE does), else the logits alone."""
    torch.manual_seed(seed)
    return LoopMoELM(vocab, d, layers, experts, top_k, score, shared, aux).to(dtype)


class KernelAttention(nn.Module):
    """A causal attention layer written with SDPA's CPU kernel (the form a decomposed graph holds)."""

    def __init__(self, vocab: int, d: int, heads: int, length: int) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(length, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.embed(ids) + self.pos(torch.arange(s, device=ids.device))  # (B, S, d)
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # 3 x (B, H, S, d/H)
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)
        return self.head(torch.tanh(out.transpose(1, 2).reshape(b, s, -1)))  # (B, S, vocab)


def kernel_attention(vocab: int = 96, d: int = 16, heads: int = 2, length: int = 64,
                     dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return KernelAttention(vocab, d, heads, length).to(dtype)
