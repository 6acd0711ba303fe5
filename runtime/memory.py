"""Per-rank memory account: bytes of the parameter, gradient and optimizer-state tensors that exist.

Invariant: every number is measured from live tensors, summing each distinct
storage once (a view into a flat buffer costs nothing extra); nothing is
estimated. The account is taken right after each optimizer step, the steady
state where parameters, gradients and optimizer state all exist; stage 3 adds
the peak bytes of gathered layers seen during that step.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch


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
    """Every tensor in a ``torch.optim.Optimizer``'s per-parameter state."""
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


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
