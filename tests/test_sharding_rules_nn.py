"""Ground truth for the nn rules (``passes.sharding_rules_nn``): the cases of the
reductions and scans, normalization, attention, embedding and losses; the pinned
tests of the strategies tensor parallelism relies on (column- and row-parallel
projections, attention per head, vocab-parallel embedding and cross-entropy,
reductions, Partial propagation, ops without rules); and the slow test of the rules
on captured Hugging Face models.

The harness comes from ``test_sharding_rules``, whose property tests run these cases
(it imports this module so that its ``CASES`` holds them).
"""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
from hypothesis import strategies as st
from torch.distributed.tensor import Shard

from passes.sharding_rules import Strategy, has_rule, local_op, strategies
from test_sharding_rules import F64, P, R, Draw, _gen, _has, aten, case, check_op


# ---------------------------------------------------------------------------
# The cases: drawing the arguments of each nn op.


@case(aten.cumsum.default, aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
def _along(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape())
    extra = (False,) if op in (aten._softmax.default, aten._log_softmax.default) else ()
    return (x, d.dim(x.ndim), *extra), {}


@case(aten.sum.default, aten.mean.default, aten.max.default, aten.min.default)
def _reduce_all(d: Draw, op: Any) -> tuple[tuple, dict]:
    return (d.floats(d.shape(0)),), {}


@case(aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default)
def _reduce_dims(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape())
    dims = d(st.lists(st.integers(-x.ndim, x.ndim - 1), max_size=x.ndim, unique_by=lambda i: i % x.ndim))
    return (x, dims, d(st.booleans())), {}


@case(aten.max.dim, aten.min.dim)
def _reduce_dim(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape())
    return (x, d.dim(x.ndim), d(st.booleans())), {}


@case(aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default)
def _norm(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape())
    normalized = list(x.shape[x.ndim - d(st.integers(1, x.ndim)):])
    weight = d.floats(normalized) if d(st.booleans()) or op is aten.native_layer_norm.default else None
    if op is aten.rms_norm.default:
        return (x, normalized, weight, 1e-6), {}
    bias = d.floats(normalized) if d(st.booleans()) or op is aten.native_layer_norm.default else None
    return (x, normalized, weight, bias, 1e-5), {}


@case(aten.scaled_dot_product_attention.default)
def _sdpa(d: Draw, op: Any) -> tuple[tuple, dict]:
    batch = [d.size() for _ in range(d(st.integers(1, 2)))]  # (B,) or (B, H)
    length, source, e = d.size(), d.size(), d.pick(2, 4)
    gqa = len(batch) == 2 and d(st.booleans())
    kv_batch = batch[:-1] + [d.pick(1, batch[-1])] if gqa and batch[-1] % 2 == 0 else list(batch)
    if gqa and batch[-1] % kv_batch[-1]:
        kv_batch = list(batch)
    q, k, v = d.floats(batch + [length, e]), d.floats(kv_batch + [source, e]), d.floats(kv_batch + [source, e])
    kwargs: dict[str, Any] = {"enable_gqa": gqa} if gqa else {}
    mask = d.pick("none", "bool", "float", "causal")
    if mask == "causal":
        return (q, k, v, None, 0.0, True), kwargs
    if mask != "none":
        shape = d.broadcastable(batch) + [d.pick(1, length), source]
        kwargs["attn_mask"] = d.bools(shape) | (torch.arange(source) == 0) if mask == "bool" else d.floats(shape)
    if d(st.booleans()):
        kwargs["scale"] = 0.3
    return (q, k, v), kwargs


@case(aten.embedding.default)
def _embedding(d: Draw, op: Any) -> tuple[tuple, dict]:
    weight = d.floats([d.size() * d.pick(1, d.n), d.size()])
    ids = d.ints(d.shape(0, 3), weight.shape[0])
    return ((weight, ids, d(st.integers(0, weight.shape[0] - 1))) if d(st.booleans()) else (weight, ids)), {}


@case(aten.cross_entropy_loss.default, aten.nll_loss.default)
def _loss(d: Draw, op: Any) -> tuple[tuple, dict]:
    nll = op is aten.nll_loss.default
    classes = d.size() * d.pick(1, d.n)
    batch = [d.size() * d.pick(1, d.n) for _ in range(d(st.integers(0, 1 if nll else 2)))]  # (), (N,) or (N, d1)
    x = d.floats(batch[:1] + [classes] + batch[1:])
    kwargs: dict[str, Any] = {"reduction": d.pick(0, 1, 2)}
    if not nll and d(st.integers(0, 3)) == 0:
        target = torch.softmax(d.floats(x.shape), 1 if x.ndim > 1 else 0)
    else:
        target = d.ints(batch, classes)
        if target.ndim and d(st.booleans()):
            target = target.masked_fill(d.bools(batch), -100)
    if d(st.booleans()):
        kwargs["weight"] = d.floats([classes], positive=True)
    if not nll and d(st.booleans()):
        kwargs["label_smoothing"] = 0.1
    return (torch.log_softmax(x, 1 if x.ndim > 1 else 0) if nll else x, target), kwargs


# ---------------------------------------------------------------------------
# The strategies that matter, pinned down.


def test_linear_column_and_row_parallel() -> None:
    x, w, b = torch.randn(4, 6, 8, dtype=F64), torch.randn(12, 8, dtype=F64), torch.randn(12, dtype=F64)
    found = check_op(aten.linear.default, (x, w, b), {}, 2, _gen())
    assert _has(found, (R, Shard(0), Shard(0)), Shard(2)).note == "column-parallel"
    assert _has(found, (Shard(2), Shard(1), P), P).note == "row-parallel"
    found = check_op(aten.linear.default, (x, w), {}, 4, _gen())
    _has(found, (R, Shard(0)), Shard(2))
    _has(found, (Shard(2), Shard(1)), P)
    _has(found, (Shard(0), R), Shard(0))  # batch


def test_addmm_with_in_out_weight_like_gpt2_conv1d() -> None:
    bias, x, w = torch.randn(12, dtype=F64), torch.randn(6, 8, dtype=F64), torch.randn(8, 12, dtype=F64)
    found = check_op(aten.addmm.default, (bias, x, w), {}, 2, _gen())
    assert _has(found, (Shard(0), R, Shard(1)), Shard(1)).note == "column-parallel"
    assert _has(found, (P, Shard(1), Shard(0)), P).note == "row-parallel"


def test_sdpa_per_head() -> None:
    q, k, v = (torch.randn(2, 4, 6, 8, dtype=F64) for _ in range(3))
    for mask, mask_p in [(torch.randn(2, 1, 6, 6, dtype=F64), R), (torch.randn(2, 4, 6, 6, dtype=F64), Shard(1))]:
        found = check_op(aten.scaled_dot_product_attention.default, (q, k, v, mask), {}, 2, _gen())
        assert _has(found, (Shard(1), Shard(1), Shard(1), mask_p), Shard(1)).note == "heads"
    found = check_op(aten.scaled_dot_product_attention.default, (q, k, v), {"is_causal": True}, 4, _gen())
    _has(found, (Shard(1),) * 3, Shard(1))
    assert not [s for s in found if s.output == Shard(2)]  # causal: query positions stay whole
    kv = torch.randn(2, 2, 6, 8, dtype=F64)  # grouped-query attention: 4 query heads, 2 kv heads
    found = check_op(aten.scaled_dot_product_attention.default, (q, kv, kv), {"enable_gqa": True}, 2, _gen())
    _has(found, (Shard(1),) * 3, Shard(1))


def test_embedding_vocab_parallel() -> None:
    weight = torch.randn(12, 6, dtype=F64)
    ids = torch.tensor([[0, 5, 11, 6, 2, 8], [3, 3, 9, 1, 10, 4]])
    found = check_op(aten.embedding.default, (weight, ids), {}, 3, _gen())
    s = _has(found, (Shard(0), R), P)
    assert s.note == "vocab-parallel" and local_op(aten.embedding.default, s, 3, 1) is not None
    _has(found, (Shard(1), R), Shard(2))
    _has(found, (R, Shard(1)), Shard(1))


def test_cross_entropy_vocab_parallel() -> None:
    logits = torch.randn(6, 12, dtype=F64)
    target = torch.tensor([0, 11, 5, -100, 7, 4])
    for reduction in (0, 1, 2):
        found = check_op(aten.cross_entropy_loss.default, (logits, target), {"reduction": reduction}, 3, _gen())
        assert _has(found, (Shard(1), R), R).note == "vocab-parallel"
        _has(found, (Shard(0), Shard(0)), Shard(0) if reduction == 0 else P)


def test_partial_propagation() -> None:
    a, b = torch.randn(4, 6, dtype=F64), torch.randn(6, 4, dtype=F64)
    _has(check_op(aten.mm.default, (a, b), {}, 2, _gen()), (P, R), P)
    _has(check_op(aten.mm.default, (a, b), {}, 2, _gen()), (R, P), P)
    found = check_op(aten.add.Tensor, (a, a), {}, 2, _gen())
    _has(found, (P, P), P)
    assert not [s for s in found if s.inputs in ((P, R), (R, P))]
    assert not [s for s in check_op(aten.add.Tensor, (a, 1.0), {}, 2, _gen()) if P in s.inputs]
    _has(check_op(aten.mul.Tensor, (a, a), {}, 2, _gen()), (P, R), P)
    assert not [s for s in check_op(aten.mul.Tensor, (a, a), {}, 2, _gen()) if s.inputs == (P, P)]
    for op, args in [(aten.neg.default, (a,)), (aten.clone.default, (a,)), (aten.view.default, (a, [24])),
                     (aten.reshape.default, (a, [2, 12])), (aten.transpose.int, (a, 0, 1)), (aten.sum.default, (a,))]:
        _has(check_op(op, args, {}, 2, _gen()), (P,), P)
    assert not [s for s in check_op(aten.exp.default, (a,), {}, 2, _gen()) if P in s.inputs]


def test_reductions_over_the_sharded_dim() -> None:
    x = torch.randn(4, 6, dtype=F64)
    _has(check_op(aten.sum.dim_IntList, (x, [1]), {}, 2, _gen()), (Shard(1),), P)
    s = _has(check_op(aten.mean.dim, (x, [1]), {}, 3, _gen()), (Shard(1),), P)
    assert local_op(aten.mean.dim, s, 3, 0) is not None
    assert not [s for s in check_op(aten.amax.default, (x, [1]), {}, 2, _gen()) if s.inputs == (Shard(1),)]


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
    _has(found, (R, Shard(0)), Shard(2))


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
