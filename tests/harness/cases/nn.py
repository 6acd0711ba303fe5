"""Ground-truth cases of the reductions and scans, normalization, attention, embedding and losses."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from hypothesis import strategies as st

from autopar.core.collectives import Binding, bind
from autopar.passes.rules.nn import RING
from harness.rules import Case, Draw, aten, cases


CASES: dict[Any, Case] = {}
case = cases(CASES)


@contextlib.contextmanager
def one_rank_cp() -> Iterator[None]:
    """A cp axis of one rank (a process group of this process alone), where ring attention is the attention of
    the whole sequence: the ground truth of its sharding over another axis (the simulated ranks)."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with bind(Binding({"cp": dist.group.WORLD})):
            yield
    finally:
        if started:
            dist.destroy_process_group()


CONTEXTS: dict[Any, Callable[[], contextlib.AbstractContextManager]] = {RING: one_rank_cp}  # op -> where it runs


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


@case(RING)
def _ring(d: Draw, op: Any) -> tuple[tuple, dict]:
    shape = [d.size(), d.size(), 2 * d.size(), d.pick(2, 4)]  # (B, H, S, E): S even (two chunks per cp rank)
    q, k, v = d.floats(shape), d.floats(shape), d.floats(shape)
    return (q, k, v, d.pick(0.5, 1.0), d(st.booleans()), "cp"), {}


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
