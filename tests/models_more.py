"""Hugging Face families beyond the standing zoo (``tests/test_zoo_more.py``), built from small configs with
random weights; ``models`` re-exports them."""
from __future__ import annotations

import torch
from torch import nn

from models import Gemma2Norm, _experts_as, with_mixin

__all__ = [
    "qwen3", "gemma3", "gemma3_exact", "olmo2", "gpt_neox", "falcon", "stablelm", "granite", "gpt_oss", "olmoe",
    "qwen2_moe", "modernbert", "roberta", "bert_classifier", "modernbert_classifier",
]


def _causal_lm(config_class: str, model_class: str, layers: int, d: int, heads: int, kv_heads: int | None,
               vocab: int, dtype: torch.dtype, seed: int, **extra: object) -> nn.Module:
    """A Hugging Face causal LM of the common config keys and ``extra`` (``kv_heads=None``: the family has no GQA
    key). The families below take further config keys as ``**config``, which override their own."""
    import transformers

    torch.manual_seed(seed)
    keys = dict(hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers, num_attention_heads=heads,
                vocab_size=vocab, max_position_embeddings=64, use_cache=False, pad_token_id=0, bos_token_id=0,
                eos_token_id=0)
    if kv_heads is not None:
        keys["num_key_value_heads"] = kv_heads
    cfg = getattr(transformers, config_class)(**(keys | extra))
    return getattr(transformers, model_class)(cfg).to(dtype).train()


def qwen3(layers: int = 2, d: int = 32, heads: int = 4, kv_heads: int = 2, vocab: int = 96,
          dtype: torch.dtype = torch.float64, seed: int = 0, **config: object) -> nn.Module:
    """Qwen3 (dense): q/k RMS norms per head, GQA, an explicit head_dim."""
    return _causal_lm("Qwen3Config", "Qwen3ForCausalLM", layers, d, heads, kv_heads, vocab, dtype, seed,
                      **(dict(head_dim=d // heads) | config))


def gemma3(layers: int = 2, d: int = 32, heads: int = 4, kv_heads: int = 2, vocab: int = 96,
           dtype: torch.dtype = torch.float64, seed: int = 0, **config: object) -> nn.Module:
    """Gemma-3 (text): q/k norms, local (sliding, own RoPE base) and global layers, a scaled embedding."""
    return _causal_lm("Gemma3TextConfig", "Gemma3ForCausalLM", layers, d, heads, kv_heads, vocab, dtype, seed,
                      **(dict(head_dim=d // heads, sliding_window=4, attn_implementation="eager",
                              layer_types=["sliding_attention", "full_attention"][:layers] * max(1, layers // 2))
                         | config))


def gemma3_exact(**kw: object) -> nn.Module:
    """``gemma3`` with its RMS norms computing in the model's dtype (the float32 cast of ``gemma2_exact``)."""
    return with_mixin(gemma3(**kw), "Gemma3RMSNorm", Gemma2Norm)


def olmo2(layers: int = 2, d: int = 32, heads: int = 4, kv_heads: int = 2, vocab: int = 96,
          dtype: torch.dtype = torch.float64, seed: int = 0, **config: object) -> nn.Module:
    """OLMo-2: norms after attention and MLP, q/k norms over all heads' width (a norm across the tp cut)."""
    return _causal_lm("Olmo2Config", "Olmo2ForCausalLM", layers, d, heads, kv_heads, vocab, dtype, seed, **config)


def gpt_neox(layers: int = 2, d: int = 32, heads: int = 4, vocab: int = 96, dtype: torch.dtype = torch.float64,
             seed: int = 0, **config: object) -> nn.Module:
    """GPT-NeoX (Pythia): a fused qkv interleaved per head, partial rotary, parallel attention and MLP."""
    return _causal_lm("GPTNeoXConfig", "GPTNeoXForCausalLM", layers, d, heads, None, vocab, dtype, seed,
                      **(dict(rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0) | config))


def falcon(layers: int = 2, d: int = 32, heads: int = 4, vocab: int = 96, dtype: torch.dtype = torch.float64,
           seed: int = 0, **config: object) -> nn.Module:
    """Falcon (new decoder architecture): a fused qkv with grouped kv heads, parallel attention and MLP."""
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(seed)
    keys = dict(hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads, num_kv_heads=2,
                new_decoder_architecture=True, vocab_size=vocab, max_position_embeddings=64, use_cache=False,
                hidden_dropout=0.0, attention_dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    cfg = FalconConfig(**(keys | config))
    return FalconForCausalLM(cfg).to(dtype).train()


def stablelm(layers: int = 2, d: int = 32, heads: int = 4, kv_heads: int = 2, vocab: int = 96,
             dtype: torch.dtype = torch.float64, seed: int = 0, **config: object) -> nn.Module:
    """StableLM: LayerNorm, partial rotary, qkv bias."""
    return _causal_lm("StableLmConfig", "StableLmForCausalLM", layers, d, heads, kv_heads, vocab, dtype, seed,
                      **(dict(partial_rotary_factor=0.5, use_qkv_bias=True, hidden_dropout=0.0,
                              attention_dropout=0.0) | config))


def granite(layers: int = 2, d: int = 32, heads: int = 4, kv_heads: int = 2, vocab: int = 96,
            dtype: torch.dtype = torch.float64, seed: int = 0, **config: object) -> nn.Module:
    """Granite: LLaMA with multipliers on the embedding, the residuals, the attention and the logits."""
    return _causal_lm("GraniteConfig", "GraniteForCausalLM", layers, d, heads, kv_heads, vocab, dtype, seed,
                      **(dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3,
                              logits_scaling=4.0) | config))


def gpt_oss(layers: int = 2, d: int = 32, heads: int = 4, kv_heads: int = 2, vocab: int = 96, experts: int = 4,
            dtype: torch.dtype = torch.float64, seed: int = 0, experts_implementation: str | None = "eager",
            aux: bool = False, **config: object) -> nn.Module:
    """GPT-OSS: attention sinks, alternating sliding layers, top-2 of 4 experts with biases and a clamped SwiGLU."""
    model = _causal_lm("GptOssConfig", "GptOssForCausalLM", layers, d, heads, kv_heads, vocab, dtype, seed,
                       **(dict(head_dim=d // heads, num_local_experts=experts, num_experts_per_tok=2,
                               sliding_window=4, attn_implementation="eager") | config))
    return _experts_as(model, experts_implementation, aux)


def olmoe(layers: int = 2, d: int = 32, heads: int = 4, kv_heads: int = 2, vocab: int = 96, experts: int = 4,
          dtype: torch.dtype = torch.float64, seed: int = 0, experts_implementation: str | None = "eager",
          aux: bool = False, **config: object) -> nn.Module:
    """OLMoE: top-2 of 4 experts, q/k norms over all heads' width."""
    model = _causal_lm("OlmoeConfig", "OlmoeForCausalLM", layers, d, heads, kv_heads, vocab, dtype, seed,
                       **(dict(num_experts=experts, num_experts_per_tok=2) | config))
    return _experts_as(model, experts_implementation, aux)


def qwen2_moe(layers: int = 2, d: int = 32, heads: int = 4, kv_heads: int = 2, vocab: int = 96, experts: int = 4,
              dtype: torch.dtype = torch.float64, seed: int = 0, experts_implementation: str | None = "eager",
              aux: bool = False, **config: object) -> nn.Module:
    """Qwen2-MoE: top-2 of 4 experts and a shared expert behind a sigmoid gate, qkv bias."""
    model = _causal_lm("Qwen2MoeConfig", "Qwen2MoeForCausalLM", layers, d, heads, kv_heads, vocab, dtype, seed,
                       **(dict(moe_intermediate_size=d, shared_expert_intermediate_size=d, num_experts=experts,
                               num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[]) | config))
    return _experts_as(model, experts_implementation, aux)


def modernbert(layers: int = 2, d: int = 32, heads: int = 4, vocab: int = 96, dtype: torch.dtype = torch.float64,
               seed: int = 0, **config: object) -> nn.Module:
    """ModernBERT: local (windowed) and global attention, RoPE, a fused Wqkv, GeGLU, no biases."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    torch.manual_seed(seed)
    keys = dict(hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers, num_attention_heads=heads,
                vocab_size=vocab, max_position_embeddings=64, global_attn_every_n_layers=2, local_attention=4,
                pad_token_id=0, bos_token_id=0, eos_token_id=0, cls_token_id=0, sep_token_id=0,
                attn_implementation="eager")
    cfg = ModernBertConfig(**(keys | config))
    return ModernBertForMaskedLM(cfg).to(dtype).train()


def roberta(layers: int = 2, d: int = 32, heads: int = 4, vocab: int = 96, dtype: torch.dtype = torch.float64,
            seed: int = 0, **config: object) -> nn.Module:
    """RoBERTa: BERT with positions counted from the padding index (computed from the input ids)."""
    from transformers import RobertaConfig, RobertaForMaskedLM

    torch.manual_seed(seed)
    keys = dict(hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers, num_attention_heads=heads,
                vocab_size=vocab, max_position_embeddings=64, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0, pad_token_id=1)
    cfg = RobertaConfig(**(keys | config))
    return RobertaForMaskedLM(cfg).to(dtype).train()


def bert_classifier(layers: int = 2, d: int = 32, heads: int = 4, vocab: int = 96,
                    dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    """BERT with a sequence classification head (the pooler reads each sequence's first token)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers, num_attention_heads=heads,
                     vocab_size=vocab, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=0, num_labels=3)
    return BertForSequenceClassification(cfg).to(dtype).train()


def modernbert_classifier(pooling: str = "mean", dtype: torch.dtype = torch.float64, seed: int = 0,
                          **config: object) -> nn.Module:
    """ModernBERT with a sequence classification head over the mean of each sequence's tokens (``pooling="mean"``)
    or its first token (``"cls"``)."""
    from transformers import ModernBertForSequenceClassification

    base = modernbert(dtype=dtype, seed=seed, classifier_pooling=pooling, num_labels=3, attn_implementation="sdpa",
                      **config).config
    torch.manual_seed(seed)
    return ModernBertForSequenceClassification(base).to(dtype).train()
