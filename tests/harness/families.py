"""The model families autopar plans, at their published sizes (``tests/test_planner_families.py``,
``benchmarks/planner_speed.py``), and a small ViT. Build them on the meta device: the large ones hold billions of
parameters."""
from __future__ import annotations

from typing import Callable

import torch
import transformers as T


def _llama2_7b() -> torch.nn.Module:
    return T.LlamaForCausalLM(T.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                            num_attention_heads=32, vocab_size=32000))


def _llama2_70b() -> torch.nn.Module:
    return T.LlamaForCausalLM(T.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                            num_attention_heads=64, num_key_value_heads=8, vocab_size=32000))


def _mistral_7b() -> torch.nn.Module:
    return T.MistralForCausalLM(T.MistralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                                num_attention_heads=32, num_key_value_heads=8, vocab_size=32000))


def _qwen2_7b() -> torch.nn.Module:
    return T.Qwen2ForCausalLM(T.Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                            num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                            tie_word_embeddings=False))


def _gemma_7b() -> torch.nn.Module:
    return T.GemmaForCausalLM(T.GemmaConfig(hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                                            num_attention_heads=16, num_key_value_heads=16, head_dim=256,
                                            vocab_size=256000))


def _mixtral_8x7b() -> torch.nn.Module:
    return T.MixtralForCausalLM(T.MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                                num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                                num_local_experts=8, num_experts_per_tok=2))


def _t5(d_ff: int, heads: int) -> Callable[[], torch.nn.Module]:
    return lambda: T.T5ForConditionalGeneration(T.T5Config(d_model=1024, d_ff=d_ff, d_kv=128, num_heads=heads,
                                                           num_layers=24, vocab_size=32128))


def _bert_large() -> torch.nn.Module:
    return T.BertForMaskedLM(T.BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                          intermediate_size=4096))


def _vit_huge() -> torch.nn.Module:
    return T.ViTForImageClassification(T.ViTConfig(hidden_size=1280, num_hidden_layers=32, num_attention_heads=16,
                                                   intermediate_size=5120, patch_size=14, image_size=224))


# name, factory, published parameters (billions), sequence (None: images), planned tp=pp=1 zero=0 fits 80 GB
FAMILIES = [
    ("llama2-7b", _llama2_7b, 6.74, 2048, False),
    ("llama2-70b", _llama2_70b, 68.98, 2048, False),
    ("mistral-7b", _mistral_7b, 7.24, 2048, False),
    ("qwen2-7b", _qwen2_7b, 7.62, 2048, False),
    ("gemma-7b", _gemma_7b, 8.54, 2048, False),
    ("mixtral-8x7b", _mixtral_8x7b, 46.70, 2048, False),
    ("t5-3b", _t5(16384, 32), 2.85, 512, True),
    ("t5-11b", _t5(65536, 128), 11.31, 512, False),
    ("bert-large", _bert_large, 0.335, 512, True),
    ("vit-huge", _vit_huge, 0.632, None, True),
]


def tiny_vit() -> torch.nn.Module:
    return T.ViTForImageClassification(T.ViTConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                                   intermediate_size=128, image_size=32, patch_size=8))
