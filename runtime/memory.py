"""Per-rank memory account: bytes of the parameter, gradient and optimizer-state tensors that exist.

Invariant: every number is measured from live tensors, summing each distinct
storage once (a view into a flat buffer costs nothing extra); nothing is
estimated. The account is taken right after each optimizer step, the steady
state where parameters, gradients and optimizer state all exist; stage 3 adds
the peak bytes of gathered layers seen during that step.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``None`` entries are skipped)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Every tensor in a ``torch.optim.Optimizer``'s per-parameter state, and the master weights it steps
    (``runtime/master.py``) when it keeps them."""
    if optimizer is None:
        return []
    masters = getattr(optimizer, "masters", None)
    return [*(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)),
            *(masters.tensors if masters is not None else ())]


class MemoryAccount:
    """Measures a rank's tensors after every optimizer step; ``read()`` returns the latest account."""

    def __init__(self, parameters: Callable[[], list[torch.Tensor]], gradients: Callable[[], list[torch.Tensor | None]],
                 optimizer: Any, gathered: Callable[[], int] | None = None, *, on_step: bool = True) -> None:
        self._parameters = parameters
        self._gradients = gradients
        self._optimizer = optimizer
        self._gathered = gathered
        self._last: dict[str, int] | None = None
        if optimizer is not None and on_step:
            optimizer.register_step_post_hook(lambda *_: self.snapshot())

    def measure(self) -> dict[str, int]:
        out = {
            "parameters": storage_bytes(self._parameters()),
            "gradients": storage_bytes(self._gradients()),
            "optimizer": storage_bytes(optimizer_tensors(self._optimizer)),
        }
        if self._gathered is not None:
            out["gathered"] = self._gathered()
        out["total"] = sum(out.values())
        return out

    def snapshot(self) -> None:
        self._last = self.measure()

    def read(self) -> dict[str, int]:
        """The account taken after the last optimizer step, or one measured now before any step."""
        return dict(self._last if self._last is not None else self.measure())


class NewStorages(TorchDispatchMode):
    """Bytes of the storages that operators allocate while the mode is on (not views of their inputs): alive now
    (``live()``) and the most alive at once (``peak``), each storage counted once, checked after every operator
    (a storage whose memory was released, e.g. ZeRO's ``resize_(0)``, counts as freed).

    Activation bytes of a forward: the ``live()`` bytes right after it, what autograd (or a recomputation's
    checkpoint) keeps for backward.
    """

    def __init__(self, *, track_peak: bool = True) -> None:
        super().__init__()
        self._live: dict[int, weakref.ref] = {}
        self.track_peak = track_peak
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage.data_ptr() in inputs:  # a view of an input: not a new allocation
                    continue
                known = self._live.get(storage.data_ptr())
                if storage.nbytes() and (known is None or known() is not storage):
                    self._live[storage.data_ptr()] = weakref.ref(storage)
        if self.track_peak:
            self.peak = max(self.peak, self.live())
        return out

    def live(self) -> int:
        alive = {}
        for ptr, ref in list(self._live.items()):
            storage = ref()
            if storage is None or not storage.nbytes() or storage.data_ptr() != ptr:
                del self._live[ptr]
            else:
                alive[ptr] = storage.nbytes()
        return sum(alive.values())
