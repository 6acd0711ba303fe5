"""The planner on the model families autopar parallelizes, at their published sizes, built on the meta device.

- Every family plans from a meta-device model (no memory): LLaMA-2 7B and 70B,
  Mistral-7B, Qwen2-7B, Gemma-7B, Mixtral-8x7B, T5-3B and T5-11B, BERT-large,
  ViT-huge. The profile's parameter count is the model's and the published
  one; each repeated layer's parameters are one layer module's, and its
  forward FLOPs per token are twice the parameters a token meets (a Mixtral
  token meets 2 of 8 experts); the memory the explanation names for the
  largest layer is 16 bytes per parameter (mixed-precision Adam); with
  tp=pp=1 and no ZeRO the state is 16 bytes per parameter of the whole
  model; the best plan fits the device.
- A meta model's profile equals the same model's on the CPU (a LLaMA, and a
  Mixtral, whose router takes a CPU-only path).
- Inputs: guessed for encoder-decoders and image models; a model whose inputs
  cannot be guessed gets an error naming ``example_inputs``;
  ``parallelize(model, "auto")`` cuts keyword inputs to the capture's batch too.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import sympy
import torch

import models
from autopar.cli import main
from autopar.planner.cluster import GB
from autopar.planner.model_profile import b_sym, profile_model, s_sym
from autopar.planner.auto import auto_choice
from autopar.planner import plan

transformers = pytest.importorskip("transformers")
from harness.families import FAMILIES, tiny_vit  # noqa: E402  (it builds transformers' models)

TESTS = str(Path(__file__).parent)
T = transformers
# T5 captures an encoder and a decoder at four tp sizes: about 15 s each on 2 cores, a decoder's plan 8-29 s; the
# default run keeps the profile checks of the meta models below, and every family's plan is under -m slow
SLOW = {"t5-3b", "t5-11b", "llama2-7b", "llama2-70b", "mistral-7b", "qwen2-7b", "gemma-7b", "vit-huge",
        "mixtral-8x7b", "bert-large"}


def _active_params(layer: torch.nn.Module) -> int:
    """Parameters a token meets in ``layer``: all, except the experts a mixture-of-experts router skips."""
    total = sum(p.numel() for p in layer.parameters())
    moe = getattr(getattr(layer, "mlp", None), "experts", None)
    cfg_k = getattr(getattr(layer, "mlp", None), "top_k", None)
    if moe is None or cfg_k is None:
        return total
    experts = sum(p.numel() for p in moe.parameters())
    return total - experts + experts * cfg_k // moe.num_experts


@pytest.mark.parametrize("name, factory, billions, seq, whole_fits",
                         [pytest.param(*f, marks=[pytest.mark.slow] if f[0] in SLOW else []) for f in FAMILIES],
                         ids=[f[0] for f in FAMILIES])
def test_planning_a_meta_model_of_every_family(name: str, factory: Callable, billions: float, seq: int | None,
                                               whole_fits: bool) -> None:
    with torch.device("meta"):
        model = factory()
    batch = 64 if seq else 1024
    result = plan(model, 64, cluster="dgx-a100", global_batch=batch, seq_len=seq)
    psi = result.profile.total_params
    assert psi == sum(p.numel() for p in model.parameters())
    assert psi / 1e9 == pytest.approx(billions, rel=0.005)
    tokens = 1 if seq else (224 // 14) ** 2 + 1  # a ViT's sequence: its patches and the class token
    for seg in result.profile.layers:
        if seg.count == 1:  # T5's first block, with the relative position bias
            continue
        layer = model.get_submodule(seg.name.removesuffix(".*"))[-1]
        assert seg.parts[1].param_elements == sum(p.numel() for p in layer.parameters()), seg.name
        flops = sympy.Poly(seg.parts[1].flops, b_sym, s_sym)
        per_token = (flops.coeff_monomial(b_sym * s_sym) if seq else flops.coeff_monomial(b_sym) / tokens)
        ratio = per_token / (2 * _active_params(layer))  # biases and norms: parameters without matmul FLOPs
        assert 0.99 <= ratio <= (1.1 if seq else 1.3), (seg.name, ratio)  # a ViT's attention is per image
    largest = max(seg.parts[1].param_elements for seg in result.profile.layers)
    assert f"needs {16 * largest / GB:.1f} GB for parameters, gradients and optimizer state" in str(result)
    whole = next(c for c in result.every.values() if (c.config.tp, c.config.pp, c.config.zero) == (1, 1, 0))
    assert whole.memory["parameters"] + whole.memory["gradients"] + whole.memory["optimizer"] == 16 * psi
    assert whole.fits == whole_fits
    best = result.best
    assert best.fits and best.total_memory <= result.cluster.memory
    assert best.config.dp * best.config.pp * best.config.tp == 64


def _tiny_llama() -> torch.nn.Module:
    return T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=256))


def _tiny_mixtral() -> torch.nn.Module:
    return T.MixtralForCausalLM(T.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                                num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                                num_local_experts=4, num_experts_per_tok=2))


@pytest.mark.parametrize("factory", [_tiny_llama, pytest.param(_tiny_mixtral, marks=pytest.mark.slow)],
                         ids=["llama", "mixtral"])  # (Mixtral's experts: -m slow, 15 s)
def test_a_meta_models_profile_is_the_cpu_models(factory: Callable) -> None:
    torch.manual_seed(0)
    on_cpu = profile_model(factory(), tp_sizes=(1, 2))
    with torch.device("meta"):
        on_meta = profile_model(factory(), tp_sizes=(1, 2))
    assert on_meta.tp_sizes == on_cpu.tp_sizes == (1, 2)
    for seg_m, seg_c in zip(on_meta.segments, on_cpu.segments, strict=True):
        assert (seg_m.name, seg_m.count, seg_m.entering) == (seg_c.name, seg_c.count, seg_c.entering)
        for tp in (1, 2):
            m, c = seg_m.parts[tp], seg_c.parts[tp]
            assert (m.params, m.flops, m.saved, m.attention, m.traffic, m.ops) == \
                (c.params, c.flops, c.saved, c.attention, c.traffic, c.ops), (seg_m.name, tp)
            assert [(x.op, x.direction, x.elements) for x in m.collectives] == \
                [(x.op, x.direction, x.elements) for x in c.collectives]


@pytest.mark.slow
def test_t5s_first_block_is_profiled_apart_and_the_shortened_capture_matches_the_full_one() -> None:
    with torch.device("meta"):
        model = T.T5ForConditionalGeneration(T.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=4,
                                                        num_heads=4))
    short, full = (profile_model(model, tp_sizes=(1,), shorten=x) for x in (True, False))
    assert [(s.name, s.count) for s in short.segments] == [
        ("head", 1), ("encoder.block.0", 1), ("encoder.block.*", 3), ("decoder.block.0", 1),
        ("decoder.block.*", 3), ("tail", 1)]
    assert len(full.segments) == 10
    for key in ("flops", "saved", "traffic"):
        total = [float(sum((getattr(seg.parts[1], key) for seg in p.sequence()), sympy.Integer(0))
                       .subs({b_sym: 4, s_sym: 64})) for p in (short, full)]
        assert total[0] == pytest.approx(total[1], rel=1e-9), key
    # the decoder's first block also runs the encoder's final norm and embeds the decoder's ids with the tied
    # embedding: parameters it uses but does not own, which the cost model stores once per rank
    decoder_first = short.segments[3].parts[1].params
    assert sorted(e for k, e in decoder_first.items() if not k.startswith("decoder.block.0.")) == [64, 256 * 64]


def test_inputs_the_planner_cannot_guess_are_asked_for() -> None:
    with pytest.raises(ValueError, match=r"cannot tell the inputs of Sequential: .* pass example_inputs=\(x,\)"):
        plan(torch.nn.Sequential(torch.nn.Linear(4, 4)), 2, cluster="cpu", global_batch=4, seq_len=None)
    with torch.device("meta"):
        vit = tiny_vit()
    with pytest.raises(ValueError, match="pixel_values .* plan it with seq_len=None"):
        plan(vit, 2, cluster="cpu", global_batch=4, seq_len=16)
    mlp = models.mlp((4, 8, 2), dtype=torch.float32)
    result = plan(mlp, 2, cluster="cpu", global_batch=4, seq_len=None, example_inputs=(torch.ones(2, 4),))
    assert result.profile.total_params == 4 * 8 + 8 + 8 * 2 + 2


def test_cli_plans_an_image_model_without_a_sequence(capsys, monkeypatch) -> None:
    monkeypatch.syspath_prepend(TESTS)
    assert main(["plan", "harness.families:tiny_vit", "--devices", "2", "--cluster", "cpu"]) == 0
    assert "ViTForImageClassification" in capsys.readouterr().out


def test_parallelize_auto_cuts_keyword_inputs_to_the_captures_batch(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    model = models.llama(layers=2, d=32, dtype=torch.float32)
    ids = torch.zeros(8, 16, dtype=torch.long)
    chosen = auto_choice(model, "auto", example_inputs=(ids,), example_kwargs={"attention_mask": torch.ones(8, 16)},
                         optimizer=None)
    assert chosen.config.dp * chosen.config.pp * chosen.config.tp == 2
