"""Sharding rules for the neural-network ops: reductions and scans (sum, mean,
max-like, cumsum, softmax), normalization, attention, embedding and losses, with
the local ops that compute their mean-of-shards, vocab-parallel and batch-mean
strategies.

Every strategy is sound on real tensors, as ``tests/test_sharding_rules.py``
checks for each entry (the cases for these ops are in ``tests/harness/cases/nn.py``).
"""

from __future__ import annotations


import torch
from torch.distributed.tensor import Shard

from autopar.core.ring_attention import ring_attention
from autopar.passes.rules.base import (
    BATCH, BATCH_MEAN, COLUMN_PARALLEL, MEAN_OF_SHARDS, PARTIAL, VOCAB_PARALLEL, Call, Collectives, LocalOp, Op, P,
    R, Rule, Strategy, broadcast_placement, dims_except, divisible, first_tensor, mapped, norm_dim, summable,
)

aten = torch.ops.aten

HEADS = "heads"  # attention sharded on the heads dim
SPLIT_QUERIES = "split-queries"  # attention sharded on the query positions


RING = ring_attention._opoverload  # autopar::ring_attention (context parallelism's rewrite of an attention)


# ---------------------------------------------------------------------------
# Reductions and scans.


def _along(call: Call, *, linear: bool) -> list[Strategy]:
    """Ops along one dim (softmax, cumsum): any other dim may be sharded."""
    x = first_tensor(call)
    return mapped(call, dims_except(x.ndim, norm_dim(call["dim"], x.ndim)), linear=linear)


def _cumsum(call: Call) -> list[Strategy]:
    return _along(call, linear=True)


def _softmax(call: Call) -> list[Strategy]:
    return _along(call, linear=False)


def _reduction(kind: str) -> Rule:
    """sum / mean / max-like. Over dims that are not sharded the shard moves to the output
    dim; over the sharded dim, sum gives Partial, mean gives Partial with each rank's
    local mean divided by n (``MEAN_OF_SHARDS``), and max-like gives nothing (not a sum)."""

    def rule(call: Call) -> list[Strategy]:
        x = call["self"]
        dims = call.get("dim", [])
        dims = [dims] if isinstance(dims, int) else list(dims)
        reduced = {norm_dim(d, x.ndim) for d in dims} if dims else set(range(x.ndim))
        keep = call.get("keepdim", False)
        outputs = 2 if call.op in (aten.max.dim, aten.min.dim) else None
        linear = kind != "max" and summable(x) and summable(call.get("dtype", x.dtype))
        kept = {d: d if keep else d - sum(r < d for r in reduced) for d in range(x.ndim) if d not in reduced}
        found = mapped(call, kept, linear=linear, outputs=outputs)
        if linear:
            note = PARTIAL if kind == "sum" else MEAN_OF_SHARDS
            found += [call.strategy(P, note, self=Shard(d)) for d in sorted(reduced) if divisible(x.shape[d], call.n)]
        return found

    return rule


@LocalOp
def mean_of_shards(call: Call, rank: int, collectives: Collectives | None) -> torch.Tensor:
    """A mean over a sharded dim: the local mean over 1/n of the elements, divided by n,
    is this rank's summand of the full mean."""
    return call.run() / call.n


# ---------------------------------------------------------------------------
# Normalization and attention.


def _norm(call: Call) -> list[Strategy]:
    """layer_norm / rms_norm: only the dims that are not normalized; weight and bias Replicate."""
    x = call["input"]
    outputs = 3 if call.op is aten.native_layer_norm.default else None
    return mapped(call, dims_except(x.ndim - len(call["normalized_shape"])), linear=False, outputs=outputs)


def _sdpa(call: Call) -> list[Strategy] | None:
    """q, k, v sharded alike on a batch or heads dim (GQA: both head counts divide), the mask
    sharded there where it has the dim at full size, else Replicate; or, without a causal
    mask, the query positions sharded with k and v replicated. Dropout inside needs the
    lowering to draw each rank's part of one mask."""
    q, k, v, mask = call["query"], call["key"], call["value"], call["attn_mask"]
    nd = q.ndim
    if nd < 3 or k.ndim != nd or v.ndim != nd:
        return None
    found = []
    for d in range(nd - 2):
        if call["enable_gqa"] and d == nd - 3:
            ok = divisible(q.shape[d], call.n) and divisible(k.shape[d], call.n) and k.shape[d] == v.shape[d]
        else:
            ok = divisible(q.shape[d], call.n) and q.shape[d] == k.shape[d] == v.shape[d]
        if ok:
            m = broadcast_placement(mask, d, nd, q.shape[d])
            note = HEADS if d == nd - 3 else BATCH
            found.append(call.strategy(Shard(d), note, query=Shard(d), key=Shard(d), value=Shard(d), attn_mask=m))
    if not call["is_causal"] and divisible(q.shape[-2], call.n):
        m = broadcast_placement(mask, nd - 2, nd, q.shape[-2])
        found.append(call.strategy(Shard(nd - 2), SPLIT_QUERIES, query=Shard(nd - 2), attn_mask=m))
    return found


def _ring(call: Call) -> list[Strategy]:
    """Ring attention over the cp axis (q, k, v of (B, H, S, E)): the batch or the heads sharded alike on all
    three, and on both outputs (the attention and its (B, H, S) log-sum-exp); the sequence is the ring's. A
    mask's rows are sharded there where they have the dim at full size, else replicated (broadcast)."""
    q, k, v, mask = call["q"], call["k"], call["v"], call["mask"]
    found = []
    for d in range(q.ndim - 2):
        if divisible(q.shape[d], call.n) and q.shape[d] == k.shape[d] == v.shape[d]:
            note = HEADS if d == q.ndim - 3 else BATCH
            found.append(call.strategy((Shard(d), Shard(d)), note, q=Shard(d), k=Shard(d), v=Shard(d),
                                       mask=broadcast_placement(mask, d, q.ndim, q.shape[d])))
    return found


# ---------------------------------------------------------------------------
# Embedding and losses.


def _embedding(call: Call) -> list[Strategy]:
    """Indices sharded -> output sharded alike; weight Shard(1) -> output sharded on the
    embedding dim; weight Shard(0) -> Partial output, each rank looking up only the ids in
    its vocabulary range (``VOCAB_PARALLEL`` local op); weight Partial -> Partial."""
    weight, ids = call["weight"], call["indices"]
    found = [call.strategy(Shard(d), BATCH, indices=Shard(d)) for d, s in enumerate(ids.shape) if divisible(s, call.n)]
    if divisible(weight.shape[1], call.n):
        found.append(call.strategy(Shard(ids.ndim), COLUMN_PARALLEL, weight=Shard(1)))
    if summable(weight):
        if divisible(weight.shape[0], call.n) and not call["scale_grad_by_freq"] and not call["sparse"]:
            found.append(call.strategy(P, VOCAB_PARALLEL, weight=Shard(0)))
        found.append(call.strategy(P, PARTIAL, weight=P))
    return found


@LocalOp
def vocab_parallel_embedding(call: Call, rank: int, collectives: Collectives | None) -> torch.Tensor:
    """Embedding over rows [rank * rows, (rank + 1) * rows) of the vocabulary; ids outside give zeros."""
    rows = call["weight"].shape[0]
    local = call["indices"] - rank * rows
    outside = (local < 0) | (local >= rows)  # ids another rank looks up
    pad = call["padding_idx"] - rank * rows
    looked_up = call.run(indices=local.masked_fill(outside, 0), padding_idx=pad if 0 <= pad < rows else -1)
    return looked_up.masked_fill(outside.unsqueeze(-1), 0)


def _class_dim(x: torch.Tensor) -> int:
    return 1 if x.ndim >= 2 else 0


def _loss(call: Call) -> list[Strategy]:
    """cross_entropy_loss / nll_loss. Batch (or extra) dims sharded with the target:
    reduction none -> sharded, sum -> Partial, mean -> Partial through a local op
    (class targets: local sum / all-reduced count of counted targets, ``BATCH_MEAN``;
    probability targets: local mean / n). Cross-entropy also shards the class dim
    (``VOCAB_PARALLEL``): logits Shard(class dim), target Replicate, a local op that
    all-reduces max, sum of exps and the target logit; the loss is then Replicate."""
    x, target, weight = call["self"], call["target"], call["weight"]
    reduction, c = call["reduction"], _class_dim(x)
    probs = target.dtype.is_floating_point
    smoothing = call.get("label_smoothing", 0.0)
    found = []
    for d in range(x.ndim):
        if d == c or not divisible(x.shape[d], call.n) or not summable(x):
            continue
        o = d - (d > c)  # the loss has the input's dims but the class dim
        if reduction == 0:
            out, note = Shard(o), BATCH
        elif reduction == 2:
            out, note = P, BATCH
        elif probs:
            out, note = P, MEAN_OF_SHARDS
        elif weight is None or smoothing == 0:
            out, note = P, BATCH_MEAN
        else:
            continue
        found.append(call.strategy(out, note, self=Shard(d), target=Shard(d if probs else o)))
    vocab = call.op is aten.cross_entropy_loss.default and not probs and weight is None
    if vocab and x.ndim >= 1 and divisible(x.shape[c], call.n):
        found.append(call.strategy(R, VOCAB_PARALLEL, self=Shard(c)))
    return found


@LocalOp
def batch_mean_loss(call: Call, rank: int, collectives: Collectives | None) -> torch.Tensor:
    """A loss mean over a sharded batch: the local sum over the all-reduced count of counted targets."""
    target, weight = call["target"], call["weight"]
    total = call.run(reduction=2)
    counted = target != call["ignore_index"]
    if weight is not None:
        counted = weight[target.masked_fill(~counted, 0)] * counted
    return total / collectives.all_reduce_sum(counted.sum().to(total.dtype))


@LocalOp
def vocab_parallel_cross_entropy(call: Call, rank: int, collectives: Collectives | None) -> torch.Tensor:
    """Cross-entropy over logits sharded on the class dim: max, sum of exps and the target logit all-reduced."""
    x, target = call["self"], call["target"]
    c, rows = _class_dim(x), x.shape[_class_dim(x)]
    top = collectives.all_reduce_max(x.detach().amax(c, keepdim=True))
    shifted = x - top  # (N, V/n, ...)
    log_total = collectives.all_reduce_sum(shifted.exp().sum(c)).log()  # (N, ...)
    local = target - rank * rows
    mine = (local >= 0) & (local < rows)
    picked = shifted.gather(c, local.clamp(0, rows - 1).unsqueeze(c)).squeeze(c)
    losses = log_total - collectives.all_reduce_sum(torch.where(mine, picked, 0))
    smoothing = call["label_smoothing"]
    if smoothing:
        mean_logit = collectives.all_reduce_sum(shifted.sum(c)) / (rows * call.n)
        losses = (1 - smoothing) * losses + smoothing * (log_total - mean_logit)
    counted = target != call["ignore_index"]
    losses = torch.where(counted, losses, 0)
    reduction = call["reduction"]
    if reduction == 0:
        return losses
    return losses.sum() if reduction == 2 else losses.sum() / counted.sum()


# ---------------------------------------------------------------------------
# The tables.

RULES: dict[Op, Rule] = {
    # cumsum: any dim but the scanned one; Partial -> Partial
    aten.cumsum.default: _cumsum,
    # softmax family: any dim but the normalized one
    **dict.fromkeys([aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
                     aten._log_softmax.default], _softmax),
    # sum: over the sharded dim -> Partial
    **dict.fromkeys([aten.sum.default, aten.sum.dim_IntList], _reduction("sum")),
    # mean: over the sharded dim -> Partial, the local mean divided by n
    **dict.fromkeys([aten.mean.default, aten.mean.dim], _reduction("mean")),
    # max-like: only over dims that are not sharded (a max is not a sum)
    **dict.fromkeys([aten.amax.default, aten.amin.default, aten.max.default, aten.min.default,
                     aten.max.dim, aten.min.dim], _reduction("max")),
    # layer_norm / rms_norm: dims that are not normalized
    **dict.fromkeys([aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default], _norm),
    # attention: batch or heads of q, k, v alike (mask broadcast-aware), or the query positions
    aten.scaled_dot_product_attention.default: _sdpa,
    # context parallelism's ring attention: batch or heads, its sequence passed around the cp ring
    RING: _ring,
    # embedding: indices sharded, embedding dim sharded, or vocab-parallel (Partial)
    aten.embedding.default: _embedding,
    # losses: batch-sharded with the target; cross-entropy also vocab-parallel
    **dict.fromkeys([aten.cross_entropy_loss.default, aten.nll_loss.default], _loss),
}

# (op, note) -> what a rank runs in place of the op under that strategy
LOCAL_OPS: dict[tuple[Op, str], LocalOp] = {
    (aten.mean.default, MEAN_OF_SHARDS): mean_of_shards,
    (aten.mean.dim, MEAN_OF_SHARDS): mean_of_shards,
    (aten.cross_entropy_loss.default, MEAN_OF_SHARDS): mean_of_shards,
    (aten.cross_entropy_loss.default, BATCH_MEAN): batch_mean_loss,
    (aten.nll_loss.default, BATCH_MEAN): batch_mean_loss,
    (aten.cross_entropy_loss.default, VOCAB_PARALLEL): vocab_parallel_cross_entropy,
    (aten.embedding.default, VOCAB_PARALLEL): vocab_parallel_embedding,
}

# replacements that add values of several ranks inside (the solver weighs their precision)
SUMS_INSIDE: frozenset[tuple[Op, str]] = frozenset({
    (aten.cross_entropy_loss.default, VOCAB_PARALLEL),  # log-sum-exp over the vocabulary's shards
    (aten.cross_entropy_loss.default, BATCH_MEAN),  # loss sums of the batch's shards
    (aten.nll_loss.default, BATCH_MEAN),
})
