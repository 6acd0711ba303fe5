"""Capture: the models the brief names are captured in train mode; failures are CaptureErrors with hints."""
from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

import models
from autopar import CaptureError, Mesh, parallelize
from autopar.compiler.capture import capture
from autopar.core.graph import Slot, SlotKind
from autopar.passes.stage_cuts import split_stages

IDS = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(0))

CASES = {
    "mlp": (models.factory(models.mlp, widths=(8, 16, 4)), (torch.randn(4, 8, dtype=torch.float64),)),
    "transformer": (models.factory(models.transformer), (IDS % 32,)),
    "cnn": (models.factory(models.cnn), (torch.randn(4, 3, 8, 8, dtype=torch.float64),)),
    "gpt2": (models.factory(models.gpt2), (IDS,)),
    "llama": (models.factory(models.llama), (IDS,)),
    "bert": (models.factory(models.bert), (IDS,)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_captured_graph_computes_what_the_model_computes(name: str) -> None:
    make, args = CASES[name]
    model = make()
    cap = capture(model, args, {})
    assert all("val" in n.meta for n in cap.gm.graph.nodes if n.op == "call_function")
    assert any("nn_module_stack" in n.meta for n in cap.gm.graph.nodes if n.op == "call_function")
    cap.gm.graph.lint()
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    buffers_before = {k: v.clone() for k, v in model.named_buffers()}
    got = cap.run(state, pytree.tree_leaves((args, {})))
    # the reference run mutates buffers too (batch norm statistics), so restore them first
    graph_buffers = {k: v.clone() for k, v in model.named_buffers()}
    for k, v in model.named_buffers():
        v.copy_(buffers_before[k])
    want = model(*args)
    for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for k, v in model.named_buffers():
        torch.testing.assert_close(graph_buffers[k], v)


def test_loss_is_part_of_the_graph_and_tied_weights_share_one_placeholder() -> None:
    model = models.gpt2()
    cap = capture(model, (IDS,), {}, with_loss=True, loss_fn=models.lm_loss, target=IDS)
    assert any("cross_entropy" in str(n.target) for n in cap.gm.graph.nodes)
    assert cap.aliases == {"lm_head.weight": "transformer.wte.weight"}
    assert "lm_head.weight" not in cap.param_names and "transformer.wte.weight" in cap.param_names
    state = dict(model.named_parameters())
    loss = cap.run(state, pytree.tree_leaves(((IDS,), {}, IDS)))
    loss.backward()
    got = model.transformer.wte.weight.grad.clone()
    model.zero_grad()
    models.lm_loss(model(IDS), IDS).backward()
    torch.testing.assert_close(got, model.transformer.wte.weight.grad, rtol=1e-12, atol=1e-12)


def test_a_key_value_cache_output_gets_a_hint() -> None:
    model = models.gpt2()
    model.config.use_cache = True
    with pytest.raises(CaptureError, match="use_cache=False") as info:
        capture(model, (IDS,), {})
    assert info.value.cause is not None


class _Branchy(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum() > 0 else x  # a branch on a tensor value


def test_a_data_dependent_branch_is_a_capture_error() -> None:
    with pytest.raises(CaptureError, match="torch.where or torch.cond"):
        capture(_Branchy(), (torch.randn(3),), {})


def test_a_non_tensor_input_is_a_capture_error() -> None:
    with pytest.raises(CaptureError, match="input of type object cannot be captured"):
        parallelize(models.mlp((4, 2)), Mesh(dp=1), example_inputs=(object(),))


def test_compiles_without_a_process_group_and_shows_the_graph() -> None:
    x = torch.randn(8, 8, dtype=torch.float64)
    pm = parallelize(models.mlp((8, 16, 4)), Mesh(dp=4), example_inputs=(x,), example_target=torch.randn(8, 4),
                     loss_fn=models.mse, optimizer=models.sgd)
    assert "aten.linear" in pm.graph(3).code and "mse_loss" in pm.graph(3).code
    text = str(pm.plan)
    assert "Mesh(dp=4)" in text and "all_reduce" in text and "[2, 8]" in text
    with pytest.raises(ValueError, match="rank 4 is outside the mesh of 4 ranks"):
        pm.graph(4)


def test_a_batch_that_does_not_divide_names_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"batch 6 does not divide by dp\*microbatches = 2\*2 = 4; pass a batch "
                                         r"that is a multiple of 4 or set microbatches to one of \[1, 3\]"):
        parallelize(models.mlp((8, 4)), Mesh(dp=2), example_inputs=(torch.randn(6, 8),), microbatches=2)


class _MaskedAttention(torch.nn.Module):
    """Attention under a mask built from positions: causal, a sliding window, or the caller's own."""

    def __init__(self, window: int | None) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, dtype=torch.float64)
        self.window = window

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q = self.proj(x).unflatten(-1, (2, 4)).transpose(1, 2)  # (B, heads, S, 4)
        if mask is None:
            pos = torch.arange(x.shape[1])
            mask = pos[None, :] <= pos[:, None]
            if self.window is not None:
                mask = mask & (pos[:, None] - pos[None, :] < self.window)
            mask = mask.expand(x.shape[0], 1, -1, -1)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum()


def _attention_calls(cap: object) -> list:
    return [n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_mask_built_from_positions_becomes_is_causal(name: str) -> None:
    make, args = CASES[name]
    calls = _attention_calls(capture(make(), args, {}))
    assert calls and all(n.args[3:6] == (None, 0.0, True) for n in calls)  # no mask tensor made, saved or sent


def test_only_causal_or_input_independent_masks_are_folded() -> None:
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    causal, window = _MaskedAttention(None), _MaskedAttention(3)
    assert _attention_calls(capture(causal, (x,), {}))[0].args[5] is True
    kept = _attention_calls(capture(window, (x,), {}))[0]  # a sliding window is not causal: the mask stays
    assert isinstance(kept.args[3], torch.fx.Node)
    given = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    kept = _attention_calls(capture(causal, (x, given), {}))[0]  # the caller's mask is an input: it stays
    assert isinstance(kept.args[3], torch.fx.Node)
    for model, inputs in [(causal, (x,)), (window, (x,)), (causal, (x, given))]:
        cap = capture(model, inputs, {})
        torch.testing.assert_close(cap.run(dict(model.named_parameters()), list(inputs), cap.gm), model(*inputs))


def test_input_slots_carry_their_index_into_every_stage() -> None:
    """An input's slot holds its position among the flat user inputs (the target's included), in the captured
    graph and in each pipeline stage that reads it: the executor feeds it from there."""
    model = models.mlp((8, 16, 16, 4))
    cap = capture(model, (torch.randn(4, 8, dtype=torch.float64),), {}, with_loss=True, loss_fn=models.mse,
                  target=torch.randn(4, 4, dtype=torch.float64))
    inputs = [s for s in cap.slots if s.kind is SlotKind.INPUT]
    assert [s.index for s in inputs] == [0, 1]
    stages = split_stages(cap, ["2"], {n for n, _ in model.named_parameters()})
    fed = [[(s.name, s.index) for s in st.slots if s.kind is SlotKind.INPUT] for st in stages]
    assert fed == [[(inputs[0].name, 0)], [(inputs[1].name, 1)]]  # the features first, the target last
    with pytest.raises(ValueError, match="an input slot has its index"):
        Slot(SlotKind.INPUT, "x")
