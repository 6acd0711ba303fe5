"""Ground-truth cases of the shape ops: view / reshape / flatten, expand, permute / transpose, unsqueeze /
squeeze, slice / narrow, select, split, getitem, cat / stack, index, gather, pad, diff, repeat_interleave."""

from __future__ import annotations

import operator
from typing import Any

import torch
from hypothesis import strategies as st

from harness.rules import Case, Draw, aten, cases


CASES: dict[Any, Case] = {}
case = cases(CASES)


@case(aten.flatten.using_ints)
def _flatten(d: Draw, op: Any) -> tuple[tuple, dict]:
    shape = d.shape(1, 4)
    start = d(st.integers(0, len(shape) - 1))
    end = d(st.integers(start, len(shape) - 1))
    return (d.floats(shape), start - len(shape) if d(st.booleans()) else start, end), {}


@case(aten.view.default, aten.reshape.default, aten._unsafe_view.default)
def _view(d: Draw, op: Any) -> tuple[tuple, dict]:
    # build both shapes from groups of factors, so that dims merge and split
    groups = [[d.size() for _ in range(d(st.integers(1, 2)))] for _ in range(d(st.integers(1, 3)))]
    a, b = [], []
    for g in groups:
        merged = 1
        for s in g:
            merged *= s
        a, b = (a + g, b + [merged]) if d(st.booleans()) else (a + [merged], b + g)
    if d(st.booleans()):
        b[d(st.integers(0, len(b) - 1))] = -1
    return (d.floats(a), b), {}


@case(aten.expand.default)
def _expand(d: Draw, op: Any) -> tuple[tuple, dict]:
    out = d.shape()
    shape = d.broadcastable(out)
    size = [s if i < len(out) - len(shape) or shape[i - len(out) + len(shape)] == 1 or d(st.booleans()) else -1
            for i, s in enumerate(out)]
    return (d.floats(shape), size), {}


@case(aten.transpose.int, aten.permute.default, aten.t.default)
def _permute(d: Draw, op: Any) -> tuple[tuple, dict]:
    if op is aten.t.default:
        return (d.floats(d.shape(0, 2)),), {}
    x = d.floats(d.shape())
    if op is aten.transpose.int:
        return (x, d.dim(x.ndim), d.dim(x.ndim)), {}
    return (x, d(st.permutations(range(x.ndim)))), {}


@case(aten.unsqueeze.default)
def _unsqueeze(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape(0))
    return (x, d(st.integers(-x.ndim - 1, x.ndim))), {}


@case(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def _squeeze(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats([d.pick(1, d.n, 2 * d.n, 5) for _ in range(d(st.integers(1, 4)))])
    if op is aten.squeeze.default:
        return (x,), {}
    if op is aten.squeeze.dim:
        return (x, d.dim(x.ndim)), {}
    return (x, sorted(set(d(st.lists(st.integers(0, x.ndim - 1), max_size=x.ndim))))), {}


@case(aten.slice.Tensor)
def _slice(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape())
    dim = d.dim(x.ndim)
    if d(st.booleans()):
        return (x, dim, 0, 2**63 - 1), {}
    size = x.shape[dim]
    return (x, dim, d(st.integers(0, size)), d(st.integers(0, size + 2)), d.pick(1, 2)), {}


@case(aten.narrow.default)
def _narrow(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape())
    dim = d.dim(x.ndim)
    start = d.pick(0, d(st.integers(0, x.shape[dim])))
    return (x, dim, start, d.pick(x.shape[dim] - start, d(st.integers(0, x.shape[dim] - start)))), {}


@case(aten.select.int)
def _select(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape())
    dim = d.dim(x.ndim)
    return (x, dim, d(st.integers(-x.shape[dim], x.shape[dim] - 1))), {}


@case(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)
def _split(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape())
    dim = d.dim(x.ndim)
    size = x.shape[dim]
    if op is aten.unbind.int:
        return (x, dim), {}
    if op is aten.split_with_sizes.default:
        cut = sorted(d(st.lists(st.integers(0, size), max_size=3)))
        return (x, [b - a for a, b in zip([0, *cut], [*cut, size])], dim), {}
    return (x, d(st.integers(1, size + 1)), dim), {}


@case(operator.getitem)
def _getitem(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape())
    items = torch.split(x, d(st.integers(1, x.shape[0])), 0)
    return (items, d(st.integers(0, len(items) - 1))), {}


@case(aten.cat.default, aten.stack.default)
def _concat(d: Draw, op: Any) -> tuple[tuple, dict]:
    shape = d.shape()
    dim = d.dim(len(shape) + (op is aten.stack.default))
    count = d(st.integers(1, 3))
    if op is aten.stack.default:
        return ([d.floats(shape) for _ in range(count)], dim), {}
    shapes = [shape[:dim % len(shape)] + [d.size()] + shape[dim % len(shape) + 1:] for _ in range(count)]
    return ([d.floats(s) for s in shapes], dim), {}


@case(aten.index.Tensor)
def _index(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape(1, 4))
    used = d(st.lists(st.integers(0, x.ndim - 1), min_size=1, max_size=x.ndim, unique=True))
    shape = d.shape(1, 2)
    indices: list[Any] = [None] * (max(used) + 1)
    for i in used:
        indices[i] = d.ints(d.broadcastable(shape), x.shape[i])
    return (x, indices), {}


@case(aten.gather.default)
def _gather(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape())
    dim = d.dim(x.ndim)
    shape = [s if d(st.integers(0, 3)) else d(st.integers(1, s)) for s in x.shape]
    shape[dim] = d.size()
    return (x, dim, d.ints(shape, x.shape[dim])), {}


@case(aten.pad.default)
def _pad(d: Draw, op: Any) -> tuple[tuple, dict]:
    x = d.floats(d.shape(2, 4))
    mode = d.pick("constant", "replicate")
    pairs = d(st.integers(1, min(2, x.ndim - 1))) if mode == "constant" else (1 if x.ndim == 2 else 2)
    pads = [d(st.integers(0, 2)) for _ in range(2 * pairs)]
    value = d.pick(None, 0.0, 1.5) if mode == "constant" else None
    return (x, pads, mode, value), {}


@case(aten.repeat_interleave.self_int)
def _repeat_interleave(d: Draw, op: Any) -> tuple[tuple, dict]:
    shape = d.shape()
    return (d.floats(shape), d(st.integers(1, 3)), d.dim(len(shape))), {}


@case(aten.diff.default)
def _diff(d: Draw, op: Any) -> tuple[tuple, dict]:
    shape = d.shape()
    dim = d.dim(len(shape))

    def extra() -> torch.Tensor | None:  # a prepend / append: any length along dim
        if not d(st.booleans()):
            return None
        return d.floats(shape[:dim % len(shape)] + [d.size()] + shape[dim % len(shape) + 1:])

    return (d.floats(shape), 1, dim, extra(), extra()), {}
