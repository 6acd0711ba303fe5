"""How the stage-3 graph ops (``torch.ops.autopar.zero_*``, declared in ``core.zero_ops``) run, and the re-gather of saved parameters for backward.

``zero_all_gather(shard, axis, ranks, dtype)`` returns a layer's full flat parameters (in
``dtype`` when given: mixed precision gathers bf16 copies of the fp32 shards);
its backward reduce-scatters the layer's gradient over the same ranks
(asynchronously; the averaged slice lands in the shard's gradient buffer when
the reduction is waited for). ``zero_prefetch`` starts a later layer's
all-gather early. ``zero_free(full, pieces)`` releases a gathered buffer's
memory after its last forward use. ``zero_begin`` / ``zero_end`` bracket one forward run:
while it runs, a tensor autograd saves for backward that lives in a gathered
buffer is stored as a handle (group, size, stride, offset) instead, so freeing
the buffer loses nothing.

Backward reaches the layers in the reverse of the order the forward finished
with them. A layer's backward begins at its first handle: the layer is
re-gathered (from its prefetch when one is in flight) after the gathers of the
``prefetch`` layers backward reaches next have been started, so that layer L
arrives while layer L+1 computes, as FSDP2's pre-backward prefetch does. A
recomputed layer (``core/recompute_modes.py``) saves no gathered parameter: its
backward begins when backward recomputes its region, which gathers it again;
the region was registered in forward (``on_sharded_region``), so the layers
before it prefetch it and its recomputation prefetches the next ones alike. The
copy is freed once the autograd node that used its last handle has run, or once
the gradients of the layer's parameters are complete (before they are
concatenated and reduce-scattered), whichever comes first. Then a pre-hook on
the op's backward node completes the reduce-scatter still in flight from the
layer before, starts this layer's (from a copy only where the reduction needs
one: another reduce dtype, or gloo, which overwrites its input) and hands the
node a zero-byte stand-in, so autograd drops the layer's incoming gradient. So
no layer's backward waits for another layer's reduction, one reduction is in
flight while the next layer computes, and no two flat gradients are alive at once.

Buffers are freed by releasing their storage (``resize_(0)``) rather than by
dropping references, because a completed collective may keep a reference to
its output for a while; memory use then follows the graph, not that timing.

Invariant: values and gradients are those of the same graph run on full
parameters; only where the parameter bytes live changes.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from autopar.core import zero_ops as _declared  # noqa: F401  (declares the autopar::zero_* ops)
from autopar.core.collectives import bound
from autopar.core.recompute_modes import on_sharded_region
from autopar.runtime import regather
from autopar.runtime.zero_group import FlatShard
from autopar.runtime.zero_trace import Span, ZeroEvent

_ACTIVE = threading.local()  # per thread: the stack of forward runs between zero_begin and zero_end


def owner(shard: torch.Tensor, axis: str, ranks: list[int]) -> FlatShard:
    """The ``FlatShard`` a graph op's shard argument belongs to (the binding's), checked against the graph's ranks."""
    binding = bound()
    state = binding.shards.get(id(shard)) if binding is not None else None
    if not isinstance(state, FlatShard):
        raise RuntimeError(
            f"autopar.zero_all_gather got a plain tensor of shape {tuple(shard.shape)}, not a ZeRO-3 shard; "
            "run zero=3 graphs through ParallelModel (pm.step / pm(...)), which feeds each layer's shard"
        )
    if state.ranks != list(ranks):
        raise RuntimeError(
            f"the graph gathers layer {state.spec.name!r} over {axis} ranks {list(ranks)}, but its shard belongs "
            f"to the group of ranks {state.ranks}; the graph was compiled for another rank"
        )
    return state


def release(full: torch.Tensor) -> None:
    """Frees a gathered buffer's memory now, whoever still holds the tensor."""
    full.untyped_storage().resize_(0)


@dataclass(frozen=True)
class _Handle:
    group: FlatShard
    dtype: torch.dtype  # of the gathered buffer
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _ForwardRun:
    """One forward run's gathered buffers and the saved-tensor hooks that re-gather them for backward."""

    def __init__(self, prefetch: int) -> None:
        self.prefetch = prefetch
        self.buffers: dict[int, tuple[weakref.ref, FlatShard]] = {}  # storage address -> (storage, group)
        self.dtypes: dict[int, torch.dtype] = {}  # storage address -> the gathered buffer's dtype
        self.kept: set[int] = set()  # buffers autograd saved as themselves: never freed early
        self.finished: list[FlatShard] = []  # groups in the order the forward finished with them (``zero_free``)
        self.gather_dtype: dict[FlatShard, torch.dtype] = {}  # what each group was gathered as
        self.outstanding: Counter[FlatShard] = Counter()  # handles saved and not yet used
        self.regathered: dict[FlatShard, torch.Tensor] = {}
        self.computing: dict[FlatShard, Span] = {}  # layers whose backward has begun and not yet completed
        self.recomputed: set[FlatShard] = set()  # layers a recomputation gathers again, its backward not begun
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def track(self, group: FlatShard, full: torch.Tensor) -> None:
        storage = full.untyped_storage()
        self.buffers[storage.data_ptr()] = (weakref.ref(storage), group)
        self.dtypes[storage.data_ptr()] = full.dtype
        self.gather_dtype[group] = full.dtype

    def _entry(self, t: torch.Tensor) -> tuple[int, FlatShard] | None:
        storage = t.untyped_storage()
        entry = self.buffers.get(storage.data_ptr())
        if entry is None or entry[0]() is not storage or storage.nbytes() == 0:
            return None
        return storage.data_ptr(), entry[1]

    def free(self, full: torch.Tensor, pieces: list[torch.Tensor]) -> None:
        """``zero_free``: the forward is done with ``full``; release it unless autograd kept it whole.

        In backward, the re-gathered copy is released as soon as the gradients of ``pieces`` (the
        layer's parameters) are complete, before they are concatenated for the reduce-scatter.
        """
        entry = self._entry(full)
        if entry is None:
            return
        address, group = entry
        if group not in self.finished:
            self.finished.append(group)
        needed = [p for p in pieces if p.requires_grad]  # none under torch.no_grad
        if needed:
            torch.autograd.graph.register_multi_grad_hook(needed, lambda _: self.release_regathered(group))
        if address not in self.kept:
            del self.buffers[address]
            release(full)

    def pack(self, t: torch.Tensor) -> Any:
        if type(t) is not torch.Tensor or t.device.type == "meta":
            return t
        entry = self._entry(t)
        if entry is None:
            return regather.pack(t)  # (a sequence-parallel gathered activation, or kept as it is)
        address, group = entry
        if t.dtype != self.dtypes[address]:  # a reinterpreting view: keep the buffer alive instead
            self.kept.add(address)
            return t
        self.outstanding[group] += 1
        return _Handle(group, t.dtype, tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Handle):
            return regather.unpack(saved)
        group = saved.group
        full = self.regathered.get(group)
        if full is None:
            full = self.begin_backward(group, saved.dtype)
        self.outstanding[group] -= 1
        node = torch._C._current_autograd_node()
        if self.outstanding[group] <= 0 and node is not None:  # the last saved use: free once this node is done
            node.register_hook(lambda *_: self.release_regathered(group))
        return full.as_strided(saved.size, saved.stride, saved.offset)

    def release_regathered(self, group: FlatShard) -> None:
        """The layer's parameter gradients are complete: its backward copy is no longer needed."""
        full = self.regathered.pop(group, None)
        if full is not None:
            release(full)

    def begin_backward(self, group: FlatShard, dtype: torch.dtype) -> torch.Tensor:
        """Backward reached ``group``'s first saved parameter: its layer's backward begins. Returns the layer
        re-gathered (from its prefetch when one is in flight), after starting the gathers of the ``prefetch``
        layers backward reaches next, so that they arrive while this one computes (as FSDP2's pre-backward
        prefetch does). Reduce-scatters still in flight are not waited for here."""
        group.prefetch(dtype, ZeroEvent.REGATHER)  # (issued first: this layer is needed first)
        for ahead in self.next_in_backward(group):
            ahead.prefetch(self.gather_dtype.get(ahead), ZeroEvent.REGATHER)
        full = group.gather(dtype, ZeroEvent.REGATHER)
        self.regathered[group] = full
        if group.trace is not None:
            self.computing[group] = group.trace.open(ZeroEvent.BACKWARD, group.spec.name)
        return full

    def next_in_backward(self, group: FlatShard) -> list[FlatShard]:
        """The ``prefetch`` layers after ``group`` in backward's order (the reverse of the forward's last uses)
        that still have saved parameters to re-gather."""
        if group not in self.finished:
            return []
        before = self.finished[: self.finished.index(group)]
        waiting = [g for g in reversed(before)
                   if (self.outstanding[g] > 0 or g in self.recomputed) and g not in self.regathered]
        return waiting[: self.prefetch]

    @contextlib.contextmanager
    def recomputation(self, groups: tuple[FlatShard, ...]) -> Iterator[None]:
        """Backward recomputes a region that gathers ``groups`` (a recomputed layer's backward begins): their
        gathers (from a prefetch when one is in flight), then those of the ``prefetch`` layers backward reaches
        next, are started before the region runs; its gradient completes the layer's backward span."""
        self.recomputed.difference_update(groups)
        for group in groups:
            group.prefetch(self.gather_dtype.get(group), ZeroEvent.REGATHER)
        last = min((g for g in groups if g in self.finished), key=self.finished.index, default=None)
        for ahead in self.next_in_backward(last) if last is not None else ():
            ahead.prefetch(self.gather_dtype.get(ahead), ZeroEvent.REGATHER)
        for group in groups:
            if group.trace is not None and group not in self.computing:
                self.computing[group] = group.trace.open(ZeroEvent.BACKWARD, group.spec.name)
        outer, _ACTIVE.recomputing = getattr(_ACTIVE, "recomputing", None), self
        try:
            yield
        finally:
            _ACTIVE.recomputing = outer


def _sharded_region(shards: tuple[torch.Tensor, ...]) -> Any:
    """``on_sharded_region``'s hook: in forward, a recomputed region gathers ``shards``' layers; they are
    re-gathered when backward recomputes it (``_ForwardRun.recomputation``)."""
    run, binding = _current(), bound()
    if run is None or binding is None:
        return None
    groups = tuple(g for s in shards if isinstance(g := binding.shards.get(id(s)), FlatShard))
    if not groups:
        return None
    run.recomputed.update(groups)
    return functools.partial(run.recomputation, groups)


on_sharded_region(_sharded_region)


def _stack() -> list[_ForwardRun]:
    if not hasattr(_ACTIVE, "runs"):
        _ACTIVE.runs = []
    return _ACTIVE.runs


def _current() -> _ForwardRun | None:
    runs = _stack()
    return runs[-1] if runs else None


@torch.library.impl("autopar::zero_begin", "CompositeExplicitAutograd")
def zero_begin(prefetch: int = 1) -> None:
    """Starts a forward run: gathered parameters saved for backward are kept as handles and re-gathered."""
    runs = _stack()
    while runs:  # a run an exception interrupted never reached zero_end
        runs.pop().hooks.__exit__(None, None, None)
    run = _ForwardRun(prefetch)
    run.hooks.__enter__()
    runs.append(run)


@torch.library.impl("autopar::zero_end", "CompositeExplicitAutograd")
def zero_end() -> None:
    """Ends the forward run ``zero_begin`` started."""
    runs = _stack()
    if runs:
        runs.pop().hooks.__exit__(None, None, None)


@torch.library.impl("autopar::zero_all_gather", "CompositeExplicitAutograd")
def zero_all_gather(shard: torch.Tensor, axis: str, ranks: list[int],
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """The full flat parameters of ``shard``'s layer, all-gathered over ``axis`` (the dp ranks ``ranks``),
    in ``dtype`` (default: the shard's)."""
    group = owner(shard, axis, ranks)
    full = group.gather(dtype)
    run = _current()
    if run is not None:
        run.track(group, full)
    return full


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.group = owner(*inputs[:3])
    ctx.run = _current() or getattr(_ACTIVE, "recomputing", None)  # (a recomputation's gather: its run's)
    ctx.set_materialize_grads(False)  # the body never reads the gradient: _ReduceFirst has taken it
    ctx.register_prehook(_ReduceFirst(ctx.run, ctx.group, output))


class _ReduceFirst:
    """The pre-hook of a gathered layer's backward node, run when the layer's gradient is complete: releases the
    layer's re-gathered copy, completes the reduce-scatter still in flight from the layer before (backward's
    previous one; it has had this layer's whole backward to finish), starts this layer's and hands the node a
    zero-byte stand-in, so autograd frees the gradient at once. (The reduction reads a copy in ``reduce_dtype``,
    or a copy the backend may overwrite, where it needs one; autograd's reference to the incoming gradient is
    dropped, never its storage released.) So one layer's gradient is in flight while the next computes, and no
    more than one. A backward that brings the layer no gradient (a split backward's B when the layer has only
    deferred weights) reduces zeros, as autograd's materialised gradient did."""

    def __init__(self, run: _ForwardRun | None, group: FlatShard, output: torch.Tensor) -> None:
        self.run, self.group = run, group
        self.shape, self.device = output.shape, output.device

    def __call__(self, grads: tuple) -> tuple | None:
        grad = grads[0]
        if self.run is not None:
            span = self.run.computing.pop(self.group, None)
            if span is not None:
                span.close()
            self.run.release_regathered(self.group)
        self.group.queue.make_room()
        if grad is None:
            zeros = torch.zeros(self.shape, dtype=self.group.reduce_dtype, device=self.device)
            self.group.reduce_gradient(zeros, wait=False, owned=True)
            return None
        flat = grad.contiguous()
        self.group.reduce_gradient(flat, wait=False, owned=flat is not grad)
        return (grad.new_zeros(()).expand(grad.shape),)


def _backward(ctx: Any, grad: torch.Tensor | None) -> tuple[None, None, None, None]:
    """Runs after ``_ReduceFirst``: the layer's gradient is already being reduced and autograd has dropped it."""
    return None, None, None, None  # the averaged slice reaches the shard's gradient through the reduce queue


torch.library.register_autograd("autopar::zero_all_gather", _backward, setup_context=_setup)


@torch.library.impl("autopar::zero_free", "CompositeExplicitAutograd")
def zero_free(full: torch.Tensor, pieces: list[torch.Tensor]) -> None:
    """Releases a gathered layer after its last forward use (saved copies are re-gathered in backward)."""
    run = _current()
    if run is not None:
        run.free(full, pieces)


@torch.library.impl("autopar::zero_prefetch", "CompositeExplicitAutograd")
def zero_prefetch(shard: torch.Tensor, axis: str, ranks: list[int], dtype: torch.dtype | None = None) -> None:
    """Starts all-gathering ``shard``'s layer (in ``dtype``); the layer's ``zero_all_gather`` waits for it."""
    owner(shard, axis, ranks).prefetch(dtype)
