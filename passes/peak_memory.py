"""The peak bytes of one forward and backward of a graph, simulated on fake tensors (no memory, no compute).

``simulated_peak(gm, grads, loss, axis_sizes)`` runs ``gm`` on fake tensors
shaped as its placeholders' ``meta["val"]`` (those ``grads`` marks require
gradients), holds its outputs until backward has run (as the executor does),
runs backward from output ``loss`` and returns the most bytes the operators'
outputs held alive at once beyond the placeholders: activations, what autograd
and recomputation keep, gradients. Collectives take their shapes from
``axis_sizes``, as at compile time, and communicate nothing.

Invariant: the simulation runs the operators and the autograd graph a real run
of ``gm`` runs, in the same order, so it allocates and frees the same storages
at the same points: two variants of one graph (a layer recomputed or not)
compare as their measured peaks would. What kernels allocate inside themselves
and what the optimizer allocates are not part of it. A graph whose operators
cannot run on fake tensors (data-dependent shapes) raises.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autopar.core.collectives import fake_axis_sizes


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages operators return that are still alive (each once), and the most at once."""

    def __init__(self, ignored: list[torch.Tensor]) -> None:
        super().__init__()
        self._ignored = {id(t.untyped_storage()) for t in ignored}
        self._refs: dict[int, weakref.ref] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t.untyped_storage())
        self.peak = max(self.peak, self.now)
        return out

    def _count(self, storage: Any) -> None:
        key = id(storage)
        known = self._refs.get(key)
        if key in self._ignored or (known is not None and known() is storage):
            return
        size = storage.nbytes()
        self._refs[key] = weakref.ref(storage, lambda _, size=size: self._freed(size))
        self.now += size

    def _freed(self, size: int) -> None:
        self.now -= size


def _fake(val: Any, requires_grad: bool) -> Any:
    """A fake tensor shaped as the placeholder's ``meta["val"]`` (anything else passes as it is)."""
    if not isinstance(val, torch.Tensor):
        return val
    t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype)
    return t.requires_grad_(requires_grad and t.is_floating_point())


def simulated_peak(gm: fx.GraphModule, grads: list[bool], loss: int, axis_sizes: dict[str, int]) -> int:
    """The most bytes one forward of ``gm`` and the backward of its output ``loss`` hold alive at once, beyond
    its placeholders (``grads[i]``: placeholder ``i`` requires a gradient; ``axis_sizes``: each mesh axis's
    size, which collectives and local replacements read); see the module doc."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with FakeTensorMode(allow_non_fake_inputs=True), fake_axis_sizes(axis_sizes):
        args = [_fake(n.meta.get("val"), g) for n, g in zip(placeholders, grads, strict=True)]
        with _LiveBytes([a for a in args if isinstance(a, torch.Tensor)]) as live:
            outputs = gm(*args)
            outputs[loss].backward()
            del outputs
        return live.peak
