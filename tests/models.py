"""Model factories shared by the tests: small, seeded, picklable by reference (those written by hand in
models_handmade.py, re-exported here)."""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from models_handmade import (FeedForward, FusedSliceBlock, FusedSliceLM, KernelAttention, LoopMoE,  # noqa: F401
                             LoopMoELM, fused_slice, kernel_attention, loop_moe)

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
         seed: int = 0, dropout: float = 0.0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=layers, n_embd=d, n_head=heads, vocab_size=vocab, n_positions=64, use_cache=False,
                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
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


def loss_without_dropout(make: object, ids: torch.Tensor, target: torch.Tensor) -> float:
    """``lm_loss`` of a fresh ``make()`` on one device with dropout off (eval mode): a parallel run whose first loss
    equals it dropped nothing."""
    with torch.no_grad():
        return float(lm_loss(make().eval()(ids), target))


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


def phi3(layers: int = 2, d: int = 32, heads: int = 4, kv_heads: int = 2, vocab: int = 96,
         dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    """Fused projections cut by slicing (q|k|v, GQA: blocks of unequal widths) and by chunk (gate|up)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    cfg = Phi3Config(hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers, num_attention_heads=heads,
                     num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=64, use_cache=False,
                     pad_token_id=0, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                     attention_dropout=0.0)
    return Phi3ForCausalLM(cfg).to(dtype).train()


def gemma2(layers: int = 2, d: int = 32, heads: int = 4, kv_heads: int = 2, vocab: int = 96,
           dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    """Logit soft-capping, alternating sliding-window layers, tied embeddings, float32 norms."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    cfg = Gemma2Config(hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=d // heads, vocab_size=vocab,
                       max_position_embeddings=64, use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                       sliding_window=4, attn_implementation="eager")
    return Gemma2ForCausalLM(cfg).to(dtype).train()


def gemma2_exact(**kw: object) -> nn.Module:
    """``gemma2`` with its RMS norms computing in the model's dtype. Hugging Face's norm casts its input to
    float32, so in a float64 model the sum of a norm weight's gradient over the tokens is a float32 sum, whose
    order (one device against a cp rank's chunks) moves updates by float32's rounding: this one computes the
    same ``x / rms(x) * (1 + w)`` without the cast, so float64 runs compare within 1e-12."""
    return with_mixin(gemma2(**kw), "Gemma2RMSNorm", Gemma2Norm)


def llama_exact(**kw: object) -> nn.Module:
    """``llama`` with its RMS norms and rotary angles computing in the model's dtype. Hugging Face's cast to float32:
    a float64 model then sums each norm's squares and takes cos and sin in float32, where inductor's fused kernels
    (another order of the sum, other vectorized cos and sin) round otherwise than eager's by float32's 6e-8."""
    return with_mixin(with_mixin(llama(**kw), "LlamaRMSNorm", RMSNorm), "LlamaRotaryEmbedding", Rotary)


def mixtral_exact(**kw: object) -> nn.Module:
    """``mixtral_eager`` with its norms and router computing in the model's dtype (Hugging Face's router takes
    its softmax in float32), so that float64 runs compare within 1e-12 also where the sums are reordered."""
    model = with_mixin(with_mixin(mixtral_eager(**kw), "MixtralRMSNorm", RMSNorm), "MixtralRotaryEmbedding", Rotary)
    return with_mixin(model, "MixtralTopKRouter", TopKRouter)


class RMSNorm:
    """An RMS norm, ``w * x * rsqrt(mean(x^2) + eps)``, in the dtype of its input; mixed into Hugging Face's
    class, whose weight and ``variance_epsilon`` it reads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


class Rotary:
    """Rotary embeddings' cos and sin in the dtype of the hidden states; mixed into Hugging Face's class, whose
    ``inv_freq`` and ``attention_scaling`` it reads."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = self.inv_freq.to(x.dtype)[None, :, None] * position_ids.to(x.dtype)[:, None, :]  # (B, D/2, S)
        angles = torch.cat((freqs, freqs), dim=1).transpose(1, 2)  # (B, S, D)
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling


class TopKRouter:
    """Mixtral's router (softmax over the experts, the top k renormalised) in the dtype of its input."""

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden.reshape(-1, self.hidden_dim), self.weight)
        top, chosen = torch.topk(logits.softmax(dim=-1), self.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), chosen


class Gemma2Norm:
    """Gemma-2's RMS norm, ``x * rsqrt(mean(x^2) + eps) * (1 + w)``, in the dtype of its input; mixed into
    Hugging Face's class, whose weight and eps it reads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def t5(layers: int = 2, d: int = 32, heads: int = 4, vocab: int = 96, dtype: torch.dtype = torch.float64,
       seed: int = 0) -> nn.Module:
    """An encoder-decoder with relative position buckets; call with ``decoder_input_ids=``."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = T5Config(d_model=d, d_kv=d // heads, d_ff=2 * d, num_layers=layers, num_decoder_layers=layers,
                   num_heads=heads, vocab_size=vocab, dropout_rate=0.0, use_cache=False, pad_token_id=0,
                   eos_token_id=1, decoder_start_token_id=0)
    return T5ForConditionalGeneration(cfg).to(dtype).train()


def bart(layers: int = 2, d: int = 32, heads: int = 4, vocab: int = 96, dtype: torch.dtype = torch.float64,
         seed: int = 0) -> nn.Module:
    """An encoder-decoder with learned positions; call with ``decoder_input_ids=``."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(seed)
    cfg = BartConfig(d_model=d, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=heads,
                     decoder_attention_heads=heads, encoder_ffn_dim=2 * d, decoder_ffn_dim=2 * d, vocab_size=vocab,
                     max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                     use_cache=False, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    return BartForConditionalGeneration(cfg).to(dtype).train()


def mamba(layers: int = 2, d: int = 32, vocab: int = 96, dtype: torch.dtype = torch.float64,
          seed: int = 0) -> nn.Module:
    """A selective state-space model (the sequential scan), computed partly in float32 by the model itself."""
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(seed)
    cfg = MambaConfig(hidden_size=d, state_size=8, num_hidden_layers=layers, vocab_size=vocab, use_cache=False,
                      expand=2, conv_kernel=4)
    return MambaForCausalLM(cfg).to(dtype).train()


def mixtral(layers: int = 2, d: int = 32, heads: int = 4, kv_heads: int = 2, vocab: int = 96, experts: int = 4,
            dtype: torch.dtype = torch.float32, seed: int = 0, experts_implementation: str | None = None) -> nn.Module:
    """Mixture of experts (top-2 of 4). Float32: Hugging Face's grouped expert matmul has no float64 kernel."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=64, use_cache=False,
                        pad_token_id=0, bos_token_id=0, eos_token_id=0, num_local_experts=experts,
                        num_experts_per_tok=2)
    return _experts_as(MixtralForCausalLM(cfg).to(dtype).train(), experts_implementation)


def qwen3_moe(layers: int = 2, d: int = 32, heads: int = 4, kv_heads: int = 2, vocab: int = 96, experts: int = 4,
              dtype: torch.dtype = torch.float32, seed: int = 0, experts_implementation: str | None = None) -> nn.Module:
    """Mixture of experts with q/k norms; float32 for the same reason as ``mixtral``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(hidden_size=d, intermediate_size=2 * d, moe_intermediate_size=d, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=d // heads,
                         vocab_size=vocab, max_position_embeddings=64, use_cache=False, pad_token_id=0,
                         bos_token_id=0, eos_token_id=0, num_experts=experts, num_experts_per_tok=2,
                         decoder_sparse_step=1, mlp_only_layers=[])
    return _experts_as(Qwen3MoeForCausalLM(cfg).to(dtype).train(), experts_implementation)


def _experts_as(model: nn.Module, implementation: str | None, aux: bool = False) -> nn.Module:
    """``"eager"``: Hugging Face's loop over the experts that received tokens (the form with float64 kernels);
    ``aux``: the load-balancing loss is part of the output (``aux_loss``)."""
    if implementation is not None:
        model.config._experts_implementation = implementation
    model.config.output_router_logits = aux
    return model


def mixtral_eager(aux: bool = True, **kw: object) -> nn.Module:
    """``mixtral`` in float64 with the eager expert loop."""
    return _experts_as(mixtral(dtype=torch.float64, **kw), "eager", aux)


def qwen3_moe_eager(aux: bool = True, **kw: object) -> nn.Module:
    """``qwen3_moe`` in float64 with the eager expert loop."""
    return _experts_as(qwen3_moe(dtype=torch.float64, **kw), "eager", aux)


def moe_loss(out: dict, target: torch.Tensor) -> torch.Tensor:
    """Token cross-entropy plus the load-balancing auxiliary loss (Hugging Face: ``aux_loss``, ``router_logits``)."""
    aux = out.get("aux_loss")
    loss = lm_loss(out["logits"], target)
    return loss if aux is None else loss + 0.01 * aux


def deepseek_v3(layers: int = 2, d: int = 32, heads: int = 4, vocab: int = 96, experts: int = 8,
                dtype: torch.dtype = torch.float64, seed: int = 0, aux: bool = False) -> nn.Module:
    """Shared experts, a sigmoid router with a correction bias and grouped top-k (4 groups, 2 kept), eager
    experts; the first layer dense."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(hidden_size=d, intermediate_size=2 * d, moe_intermediate_size=d, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
                           max_position_embeddings=64, use_cache=False, pad_token_id=0, bos_token_id=0,
                           eos_token_id=0, n_routed_experts=experts, n_shared_experts=1, num_experts_per_tok=2,
                           n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                           qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
    return _experts_as(DeepseekV3ForCausalLM(cfg).to(dtype).train(), "eager", aux)


def mistral(layers: int = 2, d: int = 32, heads: int = 4, kv_heads: int = 2, vocab: int = 96,
            dtype: torch.dtype = torch.float64, seed: int = 0, window: int = 4) -> nn.Module:
    """A sliding-window attention (``window`` tokens), GQA, RoPE."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=64, use_cache=False,
                        sliding_window=window, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return MistralForCausalLM(cfg).to(dtype).train()


def deepseek_v3_exact(**kw: object) -> nn.Module:
    """``deepseek_v3`` with its router computing in the model's dtype. Hugging Face's router casts its input and
    weight to float32, so in a float64 model any float64 rounding in front of it (tp's partial sums, the order in
    which an expert's rows are added) moves routing weights and router gradients by float32's 6e-8: this one
    computes the same grouped top-k (``DeepSeekRouter``) without the cast, so float64 runs compare within 1e-12."""
    return with_mixin(deepseek_v3(**kw), "DeepseekV3TopkRouter", DeepSeekRouter)


def with_mixin(model: nn.Module, class_name: str, mixin: type) -> nn.Module:
    """``model`` with every module of class ``class_name`` (itself included) given ``mixin``'s methods first."""
    for m in model.modules():
        if type(m).__name__ == class_name:
            m.__class__ = type(mixin.__name__, (mixin, type(m)), {})
    return model


class DeepSeekRouter:
    """DeepSeek-V3's routing (sigmoid scores, a correction bias that only steers the choice, the ``topk_group``
    best of ``n_group`` groups by the sum of their two best scores, top-k within them, weights normalised and
    scaled) in the dtype of its input; mixed into Hugging Face's router class, whose parameters it reads."""

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, groups = self.num_experts, self.num_group
        logits = F.linear(hidden.reshape(-1, self.hidden_dim), self.weight)
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.to(scores.dtype)
        best = choice.view(-1, groups, n // groups).topk(2, dim=-1).values.sum(-1)  # (T, groups)
        kept = torch.zeros_like(best).scatter(1, best.topk(self.topk_group, dim=-1).indices, 1.0)
        allowed = kept.repeat_interleave(n // groups, dim=1) > 0  # (T, E)
        chosen = choice.masked_fill(~allowed, float("-inf")).topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * self.routed_scaling_factor, chosen


def __getattr__(name: str) -> object:
    """The families beyond the zoo (``models_more.py``), read on first use (it imports this module)."""
    import models_more

    if name in models_more.__all__:
        return getattr(models_more, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
