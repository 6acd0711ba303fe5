"""Model factories shared by the tests: small, seeded, picklable by reference."""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

logging.getLogger("transformers").setLevel(logging.ERROR)


def mlp(widths: tuple[int, ...], act: str = "tanh", dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append({"tanh": nn.Tanh(), "relu": nn.ReLU(), "gelu": nn.GELU()}[act])
    return nn.Sequential(*layers).to(dtype)


class TinyTransformer(nn.Module):
    """Embedding, ``nn.TransformerEncoder`` layers, a head: a small transformer from torch alone."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, ff: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)))  # (B, S, vocab)


def transformer(vocab: int = 32, d: int = 16, heads: int = 2, layers: int = 2, ff: int = 32,
                dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TinyTransformer(vocab, d, heads, layers, ff).to(dtype)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)  # (B, 8, 4, 4)
        x = F.relu(self.conv2(x))
        return self.fc(x.flatten(1))


def cnn(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return SmallCNN().to(dtype)


def gpt2(layers: int = 2, d: int = 32, heads: int = 4, vocab: int = 96, dtype: torch.dtype = torch.float64,
         seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=layers, n_embd=d, n_head=heads, vocab_size=vocab, n_positions=64, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).to(dtype).train()


def llama(layers: int = 2, d: int = 32, heads: int = 4, kv_heads: int = 2, vocab: int = 96,
          dtype: torch.dtype = torch.float64, seed: int = 0, tied: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=64, use_cache=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).to(dtype).train()


def bert(layers: int = 2, d: int = 32, heads: int = 4, vocab: int = 96, dtype: torch.dtype = torch.float64,
         seed: int = 0) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = BertConfig(hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers, num_attention_heads=heads,
                     vocab_size=vocab, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=0)
    return BertForMaskedLM(cfg).to(dtype).train()


def lm_loss(out: object, target: torch.Tensor) -> torch.Tensor:
    """Token cross-entropy on a model output (a tensor of logits or an object with ``.logits``)."""
    logits = out if isinstance(out, torch.Tensor) else out.logits  # (B, S, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def sgd(params: list, lr: float = 0.1, momentum: float = 0.9) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def adamw(params: list, lr: float = 1e-2) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)


def factory(fn: object, **kw: object) -> functools.partial:
    """A zero-argument model factory, picklable for worker processes."""
    return functools.partial(fn, **kw)


class SkipNet(nn.Module):
    """A chain of blocks where some block inputs also receive earlier blocks' outputs (skip connections)."""

    def __init__(self, width: int, depth: int, skips: tuple[tuple[int, int], ...]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.skips = skips  # (i, j): the output of block i is added to the input of block j > i + 1
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for j, block in enumerate(self.blocks):
            for i, k in self.skips:
                if k == j:
                    x = x + outs[i]
            x = block(x)
            outs.append(x)
        return self.head(x)


def skipnet(width: int = 6, depth: int = 6, skips: tuple[tuple[int, int], ...] = ((0, 3),),
            dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return SkipNet(width, depth, skips).to(dtype)


def mlp_default() -> nn.Module:
    """A model whose inputs cannot be guessed (used by the command-line tests)."""
    return mlp((4, 2))
