"""Sequence parallelism's gathered activations, saved for backward as the shards they were gathered from.

Under sequence parallelism a column-parallel matmul reads the all-gather of a
sequence-sharded value (``autopar::all_gather_rs``), and autograd saves that
gathered input for the weight's gradient: n shards' worth of bytes per rank.
Megatron-LM keeps only the shard and gathers it again in backward; so does a
forward run here. While ``forward_run()`` is active, every ``all_gather_rs``
output is registered with the shard it came from, and the saved-tensor hook
packs any tensor viewing a registered output as a ``Handle`` holding the
shard and the view's geometry. In backward the first unpack of a handle
gathers the shard again; the handles of one gathered value (the query, key
and value projections all save it) share that copy, which autograd frees
with the last of them.

Invariant: an unpacked handle equals the tensor that was packed (the gather
of the same shard over the same group, viewed the same way), so gradients are
those of keeping the gathered tensor. Every tp rank runs the same graph, so
the backward gathers are issued in the same order on every rank of the group.

ZeRO-3's forward run (``runtime/zero_kernels.py``) installs hooks of its own inside
this one; it hands the tensors it does not own to ``pack`` and the handles it did
not make to ``unpack``.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from autopar.core.collectives import bind, bound, observe_gathers

_ACTIVE = threading.local()  # per thread: the running forward's registry, or None


class _Source:
    """One gathered value: the shard it came from and, once backward gathered it again, that copy (on the
    binding the forward ran under: backward may run on another thread)."""

    def __init__(self, shard: torch.Tensor, axis: str, dim: int, dtype: torch.dtype) -> None:
        self.shard, self.axis, self.dim, self.dtype = shard, axis, dim, dtype
        self.binding = bound()
        self.copy: torch.Tensor | None = None

    def gathered(self) -> torch.Tensor:
        if self.copy is None:
            with bind(self.binding):
                self.copy = torch.ops.autopar.all_gather(self.shard, self.axis, self.dim)  # (of a detached shard)
        return self.copy


@dataclass(frozen=True)
class Handle:
    """A saved view of a gathered value: its source and the view's geometry in the gathered storage."""

    source: _Source
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _Registry:
    def __init__(self) -> None:
        self.sources: dict[int, tuple[weakref.ref, _Source]] = {}  # storage address -> (storage, source)

    def add(self, shard: torch.Tensor, out: torch.Tensor, axis: str, dim: int) -> None:
        storage = out.untyped_storage()
        self.sources[storage.data_ptr()] = (weakref.ref(storage), _Source(shard.detach(), axis, dim, out.dtype))

    def find(self, t: torch.Tensor) -> _Source | None:
        storage = t.untyped_storage()
        entry = self.sources.get(storage.data_ptr())
        if entry is None or entry[0]() is not storage or t.dtype != entry[1].dtype:
            return None
        return entry[1]


def pack(t: torch.Tensor) -> Any:
    """``t`` as autograd should keep it: a ``Handle`` when it views a gathered value of the running forward."""
    registry = getattr(_ACTIVE, "registry", None)
    if registry is None or type(t) is not torch.Tensor:
        return t
    source = registry.find(t)
    if source is None:
        return t
    return Handle(source, tuple(t.size()), tuple(t.stride()), t.storage_offset())


def unpack(saved: Any) -> Any:
    """The tensor ``pack`` kept: a handle's view, gathered again (once per gathered value)."""
    if not isinstance(saved, Handle):
        return saved
    return saved.source.gathered().as_strided(saved.size, saved.stride, saved.offset)


@contextlib.contextmanager
def forward_run(enabled: bool = True) -> Iterator[None]:
    """Saves the ``all_gather_rs`` outputs of the forward it wraps as their shards (see the module doc)."""
    if not enabled:
        yield
        return
    registry = _Registry()
    outer = getattr(_ACTIVE, "registry", None)
    _ACTIVE.registry = registry
    try:
        with observe_gathers(registry.add), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        _ACTIVE.registry = outer
