"""Pinned tests of the strategies tensor parallelism relies on (column- and row-parallel
projections, attention per head, vocab-parallel embedding and cross-entropy,
reductions, Partial propagation, ops without rules), and the slow test of the rules
on captured Hugging Face models. The nn ops' ground-truth cases are in
``harness/cases/nn.py``; ``test_sharding_rules.py`` runs them.
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch.distributed.tensor import Shard

from harness.rules import F64, P, R, aten, check_op, has, seeded
from autopar.passes.rules import Strategy, has_rule, local_op, strategies


# ---------------------------------------------------------------------------
# The strategies that matter, pinned down.


def test_linear_column_and_row_parallel() -> None:
    x, w, b = torch.randn(4, 6, 8, dtype=F64), torch.randn(12, 8, dtype=F64), torch.randn(12, dtype=F64)
    found = check_op(aten.linear.default, (x, w, b), {}, 2, seeded())
    assert has(found, (R, Shard(0), Shard(0)), Shard(2)).note == "column-parallel"
    assert has(found, (Shard(2), Shard(1), P), P).note == "row-parallel"
    found = check_op(aten.linear.default, (x, w), {}, 4, seeded())
    has(found, (R, Shard(0)), Shard(2))
    has(found, (Shard(2), Shard(1)), P)
    has(found, (Shard(0), R), Shard(0))  # batch


def test_addmm_with_in_out_weight_like_gpt2_conv1d() -> None:
    bias, x, w = torch.randn(12, dtype=F64), torch.randn(6, 8, dtype=F64), torch.randn(8, 12, dtype=F64)
    found = check_op(aten.addmm.default, (bias, x, w), {}, 2, seeded())
    assert has(found, (Shard(0), R, Shard(1)), Shard(1)).note == "column-parallel"
    assert has(found, (P, Shard(1), Shard(0)), P).note == "row-parallel"


def test_sdpa_per_head() -> None:
    q, k, v = (torch.randn(2, 4, 6, 8, dtype=F64) for _ in range(3))
    for mask, mask_p in [(torch.randn(2, 1, 6, 6, dtype=F64), R), (torch.randn(2, 4, 6, 6, dtype=F64), Shard(1))]:
        found = check_op(aten.scaled_dot_product_attention.default, (q, k, v, mask), {}, 2, seeded())
        assert has(found, (Shard(1), Shard(1), Shard(1), mask_p), Shard(1)).note == "heads"
    found = check_op(aten.scaled_dot_product_attention.default, (q, k, v), {"is_causal": True}, 4, seeded())
    has(found, (Shard(1),) * 3, Shard(1))
    assert not [s for s in found if s.output == Shard(2)]  # causal: query positions stay whole
    kv = torch.randn(2, 2, 6, 8, dtype=F64)  # grouped-query attention: 4 query heads, 2 kv heads
    found = check_op(aten.scaled_dot_product_attention.default, (q, kv, kv), {"enable_gqa": True}, 2, seeded())
    has(found, (Shard(1),) * 3, Shard(1))


def test_embedding_vocab_parallel() -> None:
    weight = torch.randn(12, 6, dtype=F64)
    ids = torch.tensor([[0, 5, 11, 6, 2, 8], [3, 3, 9, 1, 10, 4]])
    found = check_op(aten.embedding.default, (weight, ids), {}, 3, seeded())
    s = has(found, (Shard(0), R), P)
    assert s.note == "vocab-parallel" and local_op(aten.embedding.default, s, 3, 1) is not None
    has(found, (Shard(1), R), Shard(2))
    has(found, (R, Shard(1)), Shard(1))


def test_cross_entropy_vocab_parallel() -> None:
    logits = torch.randn(6, 12, dtype=F64)
    target = torch.tensor([0, 11, 5, -100, 7, 4])
    for reduction in (0, 1, 2):
        found = check_op(aten.cross_entropy_loss.default, (logits, target), {"reduction": reduction}, 3, seeded())
        assert has(found, (Shard(1), R), R).note == "vocab-parallel"
        has(found, (Shard(0), Shard(0)), Shard(0) if reduction == 0 else P)


def test_partial_propagation() -> None:
    a, b = torch.randn(4, 6, dtype=F64), torch.randn(6, 4, dtype=F64)
    has(check_op(aten.mm.default, (a, b), {}, 2, seeded()), (P, R), P)
    has(check_op(aten.mm.default, (a, b), {}, 2, seeded()), (R, P), P)
    found = check_op(aten.add.Tensor, (a, a), {}, 2, seeded())
    has(found, (P, P), P)
    assert not [s for s in found if s.inputs in ((P, R), (R, P))]
    assert not [s for s in check_op(aten.add.Tensor, (a, 1.0), {}, 2, seeded()) if P in s.inputs]
    has(check_op(aten.mul.Tensor, (a, a), {}, 2, seeded()), (P, R), P)
    assert not [s for s in check_op(aten.mul.Tensor, (a, a), {}, 2, seeded()) if s.inputs == (P, P)]
    for op, args in [(aten.neg.default, (a,)), (aten.clone.default, (a,)), (aten.view.default, (a, [24])),
                     (aten.reshape.default, (a, [2, 12])), (aten.transpose.int, (a, 0, 1)), (aten.sum.default, (a,))]:
        has(check_op(op, args, {}, 2, seeded()), (P,), P)
    assert not [s for s in check_op(aten.exp.default, (a,), {}, 2, seeded()) if P in s.inputs]


def test_reductions_over_the_sharded_dim() -> None:
    x = torch.randn(4, 6, dtype=F64)
    has(check_op(aten.sum.dim_IntList, (x, [1]), {}, 2, seeded()), (Shard(1),), P)
    s = has(check_op(aten.mean.dim, (x, [1]), {}, 3, seeded()), (Shard(1),), P)
    assert local_op(aten.mean.dim, s, 3, 0) is not None
    assert not [s for s in check_op(aten.amax.default, (x, [1]), {}, 2, seeded()) if s.inputs == (Shard(1),)]


def test_ops_without_rules_replicate_only() -> None:
    x = torch.randn(4, 4, dtype=F64)
    assert not has_rule(aten.tril.default) and has_rule(aten.linear.default) and has_rule(operator.getitem)
    assert strategies(aten.tril.default, (x,), {}, 2) == [Strategy((R,), R, "replicate")]
    assert strategies(aten.sort.default, (x,), {}, 2)[0].output == (R, R)
    assert strategies(aten.unsafe_split.Tensor, (x, 1), {}, 2)[0].output == (R, R, R, R)


def test_strategies_read_only_shapes() -> None:
    """Rules run on meta tensors too (the graph carries fake ones)."""
    x, w = torch.empty(2, 6, 8, device="meta"), torch.empty(12, 8, device="meta")
    found = strategies(aten.linear.default, (x, w), {}, 2)
    has(found, (R, Shard(0)), Shard(2))


# ---------------------------------------------------------------------------
# The rules on real captured graphs (slow: exports Hugging Face models).

# ops these models produce that run replicated by design
_REPLICATED_BY_DESIGN = {aten.scalar_tensor.default}


def _tiny_models() -> tuple[dict[str, tuple[torch.nn.Module, dict]], torch.Tensor, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 96, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    common = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64)
    decoder = dict(num_key_value_heads=2, **common)
    return {
        "gpt2": (transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=96, n_embd=32, n_head=4, n_layer=1, n_positions=16)), {"use_cache": False}),
        "llama": (transformers.LlamaForCausalLM(transformers.LlamaConfig(**decoder)), {"use_cache": False}),
        "mistral": (transformers.MistralForCausalLM(transformers.MistralConfig(**decoder)), {"use_cache": False}),
        "qwen2": (transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**decoder)), {"use_cache": False}),
        "bert": (transformers.BertForMaskedLM(transformers.BertConfig(**common)), {}),
        "opt": (transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=96, hidden_size=32, num_attention_heads=4, num_hidden_layers=1, ffn_dim=64,
            word_embed_proj_dim=32)), {"use_cache": False}),
    }, ids, mask


class _WithLoss(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, extra: dict) -> None:
        super().__init__()
        self.model, self.extra = model, extra

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask, labels=ids, **self.extra).loss


@pytest.mark.slow
def test_rules_cover_exported_models() -> None:
    """Every op of the exported train-mode graphs has a rule, and the rules run on the
    graphs' fake tensors; the projections offer column- and row-parallel strategies."""
    models, ids, mask = _tiny_models()
    for name, (model, extra) in models.items():
        graph = torch.export.export(_WithLoss(model.train(), extra), (ids, mask), strict=False).graph
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
            assert has_rule(node.target) or node.target in _REPLICATED_BY_DESIGN, f"{name}: no rule for {node.target}"
            found = strategies(node.target, args, kwargs, 2)
            if node.target in (aten.linear.default, aten.addmm.default):
                notes = {s.note for s in found}
                assert {"column-parallel", "row-parallel"} <= notes, f"{name}: {node.format_node()} {notes}"
