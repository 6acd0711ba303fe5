"""The planner's GPT (autopar/planner/gpt.py) and what its profile says of tensor parallelism.

The plain-torch GPT computes what Hugging Face's GPT-2 computes (same logits
from the same weights) and its layers profile the same, so the published runs
the planner is calibrated on read the same without transformers installed.
Under sequence parallelism, a norm's weight-gradient all-reduce is counted in
the layer that uses the weight, once per microbatch, at the weight's size; the
plan text lists the largest layer's collectives and says where the all-to-alls
come from.
"""
from __future__ import annotations

import pytest
import sympy
import torch

from autopar.planner import GPT, gpt, gpt3_175b, gpt_1t, plan
from autopar.planner.cluster import Cluster
from autopar.planner.model_profile import b_sym, profile_model, s_sym

LAYER_FIELDS = ("flops", "narrow", "traffic", "saved", "saved_other", "attention_fused", "kept_selective",
                "communicated")


def test_the_gpt_computes_what_hugging_faces_gpt2_computes() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    ours = GPT(3, 64, 4, vocab=128, positions=64).eval()
    assert ours.load_state_dict(hf.state_dict()) is not None  # the same names and shapes, every one
    ids = torch.randint(0, 128, (2, 16))
    assert torch.equal(ours(ids), hf(ids).logits)
    # its layers profile as GPT-2's: the calibration on GPT-2 models of Megatron's sizes holds for it
    short, theirs = (profile_model(m, tp_sizes=(1, 2)) for m in (ours, hf))
    at = {b_sym: 3, s_sym: 128}
    [mine], [layer] = short.layers, theirs.layers
    assert mine.name == layer.name == "transformer.h.*" and mine.count == layer.count == 3
    for tp in (1, 2):
        a, b = mine.parts[tp], layer.parts[tp]
        assert a.params == b.params and a.ops == b.ops
        assert sorted((c.op, c.direction, str(c.elements)) for c in a.collectives) == \
            sorted((c.op, c.direction, str(c.elements)) for c in b.collectives)
        for field in LAYER_FIELDS:
            assert float(sympy.sympify(getattr(a, field)).xreplace(at)) == \
                float(sympy.sympify(getattr(b, field)).xreplace(at)), (tp, field)
    assert short.total_params == theirs.total_params


def test_presets_are_the_published_sizes() -> None:
    assert sum(p.numel() for p in gpt3_175b().parameters()) / 1e9 == pytest.approx(175, rel=0.01)
    trillion = gpt_1t()
    assert sum(p.numel() for p in trillion.parameters()) / 1e9 == pytest.approx(1008, rel=0.01)
    assert len(trillion.transformer.h) == 128 and next(trillion.parameters()).device.type == "meta"


def test_a_norms_weight_gradient_all_reduce_is_counted_per_layer_at_the_weights_size() -> None:
    hidden = 64
    profile = profile_model(gpt(3, hidden, 4, vocab=128), tp_sizes=(1, 2))
    head, tail = profile.segments[0], profile.segments[-1]
    [layer] = profile.layers
    tokens = {b_sym: 3, s_sym: 128}
    for seg in (head, layer, tail):
        for c in seg.sequence_parallel[2].collectives:  # none that scales with the tokens is a weight's
            assert c.elements.free_symbols or c.op == "all_reduce"
    norms = [c for c in layer.sequence_parallel[2].collectives if not c.elements.free_symbols]
    assert [(c.op, c.direction, int(c.elements)) for c in norms] == [("all_reduce", "backward", hidden)] * 4
    assert not any(c.op == "all_reduce" for c in head.sequence_parallel[2].collectives)  # ln_1, ln_2: per layer
    moved = [float(c.elements.xreplace(tokens)) for c in layer.sequence_parallel[2].collectives]
    assert max(moved) == 3 * 128 * hidden  # the activations: b x s x hidden


def test_the_plan_lists_the_largest_layers_tp_collectives() -> None:
    cluster = Cluster.preset("dgx-a100").replace(memory=0.25e9)  # too small without sequence parallelism
    result = plan(gpt(4, 512, 8, vocab=1024), 8, cluster=cluster, global_batch=8, seq_len=8192, tp=(8,), pp=(1,),
                  zero=(0,), recompute=("none",))
    best = result.best.config
    assert best.tp == 8 and best.sequence_parallel and best.microbatch_size == 1
    [line] = [x for x in result.explanation if x.startswith("tp collectives per microbatch")]
    assert "of each transformer.h.* layer (tp=8 with sequence parallelism): forward 2 all-gathers of 8.4 MB, " \
           "2 reduce-scatters of 8.4 MB, 2 all-to-alls of 8.4 MB; backward 4 all-gathers of 8.4 MB, 2 " \
           "reduce-scatters of 8.4 MB, 2 all-to-alls of 8.4 MB" in line  # 8192 x 512 x 2 bytes
    assert "4 all-reduces of 1.0 kB (parameters' gradients)" in line  # ln_1 and ln_2 weights and biases, bf16
    assert "2 of the backward all-gathers gather kept shards again" in line
    assert "the all-to-alls (each moves 1/tp of an all-gather's bytes) turn a norm's output" in line
