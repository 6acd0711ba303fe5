"""Weight gradients that wait: the graph ops a split backward (``B`` then ``W``) runs.

``passes/split_backward.py`` replaces each ``linear`` / ``addmm`` / ``mm``
whose weight is a trainable parameter by the matching op here. Forward they
call the same ATen op (the same numbers) on the weight detached, so that
autograd's own backward of the op gives the gradient of the activation input
(and of the bias) and no weight gradient: no Python function sits in B's graph.
A hook on the output takes the output's gradient and the input (kept as
autograd keeps a saved tensor: packed by the saved-tensor hooks active in
forward, unpacked in backward); the weight's gradient, a matmul of the two, is
computed then if no `collect` is active (through autograd, so the weight's
hooks and a ZeRO-3 gather's backward run), and under `collect` recorded
instead and computed when the `WeightGradients` record is run: the ``W``
action of a zero-bubble schedule, after the ``B`` that recorded it. An output
that needs no gradient but the weight's (an input and bias that need none)
takes `_Split`, a Python autograd function, as the hook would never fire.

Invariant: `collect` + `WeightGradients.run` accumulate into each parameter's
``.grad`` the gradient one backward accumulates (up to the rounding of a fused
multiply-add). Each site of a parameter used several times (tied embeddings)
records its own contribution, so nothing is counted twice; the parameter's
gradient hooks fire as they would in one backward, once per site.

How a recorded gradient lands: into an existing ``.grad``, one ``addmm_``
(the matmul accumulates in place: no temporary weight-sized tensor, no
separate add; on CPU a quarter to a third of ``W``'s time), after which the
parameter's post-accumulate-grad hooks (data-parallel gradient sync, ZeRO-1/2)
are called with it, as autograd's accumulation calls them. A parameter without
``.grad`` yet, or with hooks on its gradient itself (``register_hook``, which
may replace the gradient), takes autograd's own accumulation, unless a
`KeptGradients` holds last step's gradient tensor of that parameter: then that
tensor, zeroed, becomes ``.grad`` and the matmul lands in it as above.
"""
from __future__ import annotations

import functools
import sys
import threading
import weakref
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

aten = torch.ops.aten
_ACTIVE = threading.local()


class WeightGradients:
    """The weight gradients one backward left for later, in the order it met them."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (weight, a, b): grad a @ b

    def run(self, kept: KeptGradients | None = None) -> None:
        """Computes every recorded weight gradient and accumulates it into its parameter.

        A parameter without ``.grad`` gets the tensor ``kept`` holds for it, if any (see `KeptGradients`).

        Weights that are not leaves (views of a ZeRO-3 layer's gathered buffer) go back through autograd in one
        call, so each gathered buffer's backward (its reduce-scatter) runs once per ``W``, not once per weight.
        """
        pending, self.pending = self.pending, []
        views, grads = [], []
        for weight, a, b in pending:
            if weight.is_leaf:
                _accumulate(weight, a, b, kept)
            else:
                views.append(weight)
                grads.append(a @ b)
        if views:
            torch.autograd.backward(views, grads)


def _post_accumulate_hooks(t: torch.Tensor) -> list:
    """The post-accumulate-grad hooks of ``t`` in registration order (torch keeps them in this attribute)."""
    return list((getattr(t, "_post_accumulate_grad_hooks", None) or {}).values())


def _accumulate(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, kept: KeptGradients | None) -> None:
    """``weight.grad += a @ b`` for a leaf, as one backward would accumulate it (see the module docstring)."""
    grad = weight.grad
    if getattr(weight, "_backward_hooks", None) or (grad is not None and grad.requires_grad):
        torch.autograd.backward(weight, a @ b)
        return
    if grad is None:
        grad = kept.take(weight, a, b) if kept is not None else None
        if grad is None:
            torch.autograd.backward(weight, a @ b)
            return
        weight.grad = grad  # zeroed: then 0 + a @ b (on CPU quicker than ``mm`` with ``out``)
    elif kept is not None and id(weight) in kept:
        kept.drop(weight)
    with torch.no_grad():
        grad.addmm_(a, b)
        for hook in _post_accumulate_hooks(weight):  # (autograd calls them under no_grad too)
            hook(weight)


class KeptGradients:
    """Weight-gradient tensors kept from one step to the next for the first ``W`` of the next step to write into.

    Why: the optimizer's ``zero_grad(set_to_none=True)`` frees the gradients and
    the next step's first ``W`` allocates them again. On CPU the C allocator
    hands large freed blocks back to the system, so that ``W`` touches fresh
    pages (a page fault per 4 KiB: some 5 ms per 32 MiB of weights), and in a
    zero-bubble schedule every delay of an action lengthens the step. Kept
    here, the memory stays resident and ``.grad`` is still None between steps,
    as torch leaves it: optimizers and hooks see what they saw before, and the
    gradient is ``0 + a @ b``, the same numbers as ``a @ b``.
    No memory is added: the kept tensors are the gradients the step's optimizer
    read (``pm.memory()`` counts them there).

    A tensor is reused only if nothing else refers to it (no other Python
    reference, no view of its storage, e.g. a data-parallel bucket's slot) and
    its shape, dtype, device and layout are those of ``a @ b``: a gradient
    someone kept from an earlier step never changes under them.
    """

    def __init__(self) -> None:
        # id(weight) -> weight, for the weights W accumulated into (a weight no longer used drops out)
        self._seen: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._kept: dict[int, torch.Tensor] = {}  # id(weight) -> its gradient tensor of the last step
        self._zeroed: set[int] = set()  # the kept tensors `prepare` checked and zeroed
        self._unprepared: list[int] = []  # the kept tensors `prepare` has yet to check

    def note(self, weight: torch.Tensor) -> None:
        """Remembers that ``W`` accumulates into ``weight``'s gradient (its tensor is kept past the optimizer)."""
        self._seen.setdefault(id(weight), weight)

    def through(self, free: Callable[[], None]) -> None:
        """Runs ``free`` (the optimizer step and its ``zero_grad``); keeps the gradients it set to None."""
        weights = dict(self._seen)
        before = {key: w.grad for key, w in weights.items() if w.grad is not None}
        free()
        self._kept = {key: g for key, g in before.items() if weights[key].grad is None}
        self._zeroed, self._unprepared = set(), list(self._kept)

    def drop(self, weight: torch.Tensor) -> None:
        """Forgets ``weight``: something else made its gradient before ``W`` this step, so keeping the tensor of
        the last one would only hold memory twice."""
        self._seen.pop(id(weight), None)
        self._kept.pop(id(weight), None)
        self._zeroed.discard(id(weight))

    def prepare(self) -> None:
        """Zeroes the kept gradients that may be reused and drops the others, so that ``take`` finds them ready.

        The executor calls it while the step's first receive waits for the pipeline to fill: zeroing costs no
        time of the step there, where the first ``W`` would otherwise pay it.
        """
        unprepared, self._unprepared = self._unprepared, []
        for key in unprepared:
            grad = self._kept.pop(key, None)
            if grad is not None and _unshared(grad):
                self._kept[key] = grad.zero_()
                self._zeroed.add(key)

    def take(self, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
        """The kept gradient of ``weight``, zeroed, if ``a @ b`` may be added into it; else None (autograd
        allocates a new one)."""
        self.note(weight)
        grad = self._kept.pop(id(weight), None)
        zeroed = id(weight) in self._zeroed
        self._zeroed.discard(id(weight))
        if grad is None or not (zeroed or _unshared(grad)):
            return None
        fits = (grad.shape == (a.shape[0], b.shape[1]) and grad.dtype == torch.result_type(a, b) == weight.dtype
                and grad.device == weight.device and grad.is_contiguous() and not grad.requires_grad)
        if not fits:
            return None
        return grad if zeroed else grad.zero_()

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, key: int) -> bool:
        """Whether a gradient tensor of the weight of id ``key`` is kept and not yet taken this step."""
        return key in self._kept


def _unshared(t: torch.Tensor) -> bool:
    """Whether the caller's reference is the only one to ``t`` and no other tensor views its storage."""
    # references: the caller's variable and this function's argument, plus getrefcount's own
    if sys.getrefcount(t) > 3:
        return False
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:  # (a torch that does not tell: never reuse)
        return False
    storage = t.untyped_storage()  # (this storage object holds a reference of its own)
    return use_count(storage._cdata) <= 2


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
        return _op(kind, x, w, b)

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
            a, b = (_flat(grad).t(), _flat(x)) if weight_first else (_flat(x).t(), _flat(grad))  # gw = a @ b
            record = getattr(_ACTIVE, "record", None)
            if record is None:
                gw = a @ b
            else:
                record.pending.append((ctx.weight, a, b))
        return gx, gw, gb, None


def _saved_tensor_hooks() -> tuple | None:
    """The saved-tensor hooks autograd would pack a saved tensor with now (the innermost pair), or None; ``()``
    where this torch does not say (then `_Split` saves the input, as autograd does)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else ()


def _op(kind: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if kind == "linear":
        return aten.linear.default(x, w, b)
    return aten.mm.default(x, w) if b is None else aten.addmm.default(b, x, w)


def _split(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kind: str) -> torch.Tensor:
    """``op(x, w, b)``, its weight gradient left to a hook on the output (autograd never sees the weight here).

    The native op runs on ``w.detach()``, so autograd computes the input's and the bias's gradients in ``B``
    without a Python function; a hook on the output takes its gradient and the input (packed with the
    saved-tensor hooks active now, as autograd would have saved it) and records ``(w, a, b)`` for ``W``.
    Where the output needs no gradient (nor the input nor the bias does), no hook could see it: `_Split`.
    """
    if not (w.requires_grad and torch.is_grad_enabled()):
        return _op(kind, x, w, b)
    hooks = _saved_tensor_hooks()
    if hooks == () or not (x.requires_grad or b is not None and b.requires_grad):
        return _Split.apply(x, w, b, kind)
    y = _op(kind, x, w.detach(), b)
    box = [x if hooks is None else hooks[0](x)]  # (emptied by the hook: the input lives as long as autograd's)
    y.register_hook(functools.partial(_weight_gradient, w, box, None if hooks is None else hooks[1], kind))
    return y


def _weight_gradient(w: torch.Tensor, box: list, unpack: Callable | None, kind: str, grad: torch.Tensor) -> None:
    x = box.pop() if unpack is None else unpack(box.pop())
    a, b = (_flat(grad).t(), _flat(x)) if kind == "linear" else (_flat(x).t(), _flat(grad))  # gw = a @ b
    record = getattr(_ACTIVE, "record", None)
    if record is not None:
        record.pending.append((w, a, b))
    else:  # one backward without collect: the weight's gradient now, through autograd (reentrant)
        torch.autograd.backward(w, a @ b)


def split_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``aten.linear(x, w, b)`` whose weight gradient may wait (see the module docstring)."""
    return _split(x, w, b, "linear")


def split_addmm(b: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``aten.addmm(b, x, w)`` whose weight gradient may wait."""
    return _split(x, w, b, "addmm")


def split_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``aten.mm(x, w)`` whose weight gradient may wait."""
    return _split(x, w, None, "mm")
