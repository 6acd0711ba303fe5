"""Weight gradients that wait: the graph ops a split backward (``B`` then ``W``) runs.

``passes/split_backward.py`` replaces each ``linear`` / ``addmm`` / ``mm``
whose weight is a trainable parameter by the matching op here. Forward they
call the same ATen op (the same numbers). Backward they return the gradient of
the activation input (and of the bias) at once; the weight's gradient, a
matmul of the saved input with the incoming gradient, is computed then only if
no `collect` is active. Under `collect` it is recorded instead and computed
when the `WeightGradients` record is run: the ``W`` action of a zero-bubble
schedule, after the ``B`` that recorded it.

Invariant: `collect` + `WeightGradients.run` accumulate into each parameter's
``.grad`` exactly the gradient one backward accumulates. Each site of a
parameter used several times (tied embeddings) records its own contribution,
so nothing is counted twice; the parameter's post-accumulate-grad hooks fire
as they would in one backward, once per site.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

aten = torch.ops.aten
_ACTIVE = threading.local()


class WeightGradients:
    """The weight gradients one backward left for later, in the order it met them."""

    def __init__(self) -> None:
        self.pending: list[Callable[[], None]] = []

    def run(self) -> None:
        """Computes every recorded weight gradient and accumulates it into its parameter."""
        pending, self.pending = self.pending, []
        for compute in pending:
            compute()


@contextmanager
def collect() -> Iterator[WeightGradients]:
    """While active, the split ops record their weight gradients instead of computing them."""
    record = WeightGradients()
    previous = getattr(_ACTIVE, "record", None)
    _ACTIVE.record = record
    try:
        yield record
    finally:
        _ACTIVE.record = previous


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _Split(torch.autograd.Function):
    """``y = op(x, w, b)`` for op in linear (w: out x in), addmm / mm (w: in x out), weight gradient deferrable."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kind: str) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.kind, ctx.weight, ctx.bias_shape = kind, w, None if b is None else b.shape
        if kind == "linear":
            return aten.linear.default(x, w, b)
        return aten.mm.default(x, w) if b is None else aten.addmm.default(b, x, w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        x, w = ctx.saved_tensors
        weight_first = ctx.kind == "linear"  # linear's weight is out x in
        gx = (grad @ w if weight_first else grad @ w.t()) if ctx.needs_input_grad[0] else None
        gb = None
        if ctx.needs_input_grad[2]:
            gb = _flat(grad).sum(0) if weight_first else grad.sum(0)
            gb = gb.reshape(ctx.bias_shape)
        gw = None
        if ctx.needs_input_grad[1]:
            def weight_grad() -> torch.Tensor:
                g2, x2 = _flat(grad), _flat(x)
                return g2.t() @ x2 if weight_first else x2.t() @ g2

            record = getattr(_ACTIVE, "record", None)
            if record is None:
                gw = weight_grad()
            else:
                weight = ctx.weight
                record.pending.append(lambda: torch.autograd.backward(weight, weight_grad()))
        return gx, gw, gb, None


def split_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``aten.linear(x, w, b)`` whose weight gradient may wait (see the module docstring)."""
    return _Split.apply(x, w, b, "linear")


def split_addmm(b: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``aten.addmm(b, x, w)`` whose weight gradient may wait."""
    return _Split.apply(x, w, b, "addmm")


def split_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``aten.mm(x, w)`` whose weight gradient may wait."""
    return _Split.apply(x, w, None, "mm")
