"""Parameters without a gradient inside a ZeRO flat group: the optimizer step must leave them as they are.

On one device a parameter that receives no gradient in a step (unused in forward, as DDP's
``find_unused_parameters`` cases; used only through a detached path) keeps ``grad=None``, so the optimizer
skips it: no weight decay, no momentum, no state. ZeRO steps flat shards, where such a parameter's elements sit
beside those of parameters that did receive one; the shard's gradient holds zeros there, and an optimizer
with weight decay (AdamW's default 0.01), L2 regularisation or momentum from earlier steps would move them.

``HeldElements`` snapshots those elements of each stepped tensor (the shard, its float32 master under mixed
precision) and of the optimizer's state of the same shape before the step, and writes them back after it;
state the step created there is set to zero (one device has none). Every rank of a ZeRO group skips the same
parameters (they run the same graph), so the shards stay those of one model.

``StepCounts`` names a parameter skipped in some steps and stepped in others under an optimizer that counts
steps (Adam's bias correction): the flat shard's count counts every step, one device's counts the parameter's
own steps, so its updates differ from then on; a warning says so, once per parameter.

Invariant: after ``restore`` the held elements of every stepped tensor and of its state equal their values
before the step.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from autopar.core.zero_layout import FlatGroup


def local_spans(spec: FlatGroup, index: int, members: list[int]) -> list[tuple[int, int]]:
    """The ranges, in rank ``index``'s shard of ``spec``, of the elements of the parameters at ``members``
    (positions in ``spec.params``); empty ranges are left out."""
    lo, hi = index * spec.shard, (index + 1) * spec.shard
    spans = []
    for i in members:
        start, end = max(spec.offsets[i], lo), min(spec.offsets[i] + spec.numels[i], hi)
        if start < end:
            spans.append((start - lo, end - lo))
    return spans


def _mask(numel: int, spans: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    mask = torch.zeros(numel, dtype=torch.bool, device=device)
    for start, end in spans:
        mask[start:end] = True
    return mask


class HeldElements:
    """Elements of flat tensors that one optimizer step must not change (see the module docstring)."""

    def __init__(self) -> None:
        self._held: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (tensor, mask, values)
        self._stepped: list[tuple[torch.Tensor, torch.Tensor, set[str]]] = []  # (stepped, mask, state keys before)

    def hold(self, optimizer: Any, tensors: list[torch.Tensor], stepped: torch.Tensor,
             spans: list[tuple[int, int]]) -> None:
        """Snapshots ``spans`` of ``tensors`` (flat, shaped as ``stepped``) and of ``optimizer``'s state of
        ``stepped`` (the tensor it steps)."""
        if not spans:
            return
        mask = _mask(stepped.numel(), spans, stepped.device)
        state = optimizer.state.get(stepped, {})
        for t in [*tensors, *(_flat_state(state, stepped).values())]:
            self._held.append((t, mask, t.detach()[mask].clone()))
        self._stepped.append((stepped, mask, set(_flat_state(state, stepped))))

    @torch.no_grad()
    def restore(self, optimizer: Any) -> None:
        """Writes the held elements back; state the step created at them is zeroed. Forgets them."""
        for t, mask, values in self._held:
            t[mask] = values
        for stepped, mask, before in self._stepped:
            for key, t in _flat_state(optimizer.state.get(stepped, {}), stepped).items():
                if key not in before:
                    t[mask] = 0
        self._held.clear()
        self._stepped.clear()


class StepCounts:
    """Which parameters were skipped and which stepped so far; names those that have been both."""

    def __init__(self) -> None:
        self._skipped: set[str] = set()
        self._stepped: set[str] = set()
        self._named: set[str] = set()

    def record(self, names: list[str], skipped: set[int], counted: bool) -> None:
        """Notes one step of a group of parameters (``names``, ``skipped`` the positions without a gradient);
        warns for each newly mixed one where the optimizer's state of the shard counts steps (``counted``)."""
        for i, name in enumerate(names):
            (self._skipped if i in skipped else self._stepped).add(name)
        mixed = sorted((self._skipped & self._stepped) - self._named)
        if mixed and counted:
            self._named.update(mixed)
            warnings.warn(f"parameter(s) {', '.join(mixed[:4])} got a gradient in some steps and none in others: "
                          f"under ZeRO the optimizer's step count is their flat shard's, which counts every step, "
                          f"where one device counts each parameter's own steps, so the bias correction of Adam-like "
                          f"optimizers differs for them from here on; read them in every step (a zero-weighted "
                          f"term), or run without ZeRO", stacklevel=3)


def _flat_state(state: dict[str, Any], stepped: torch.Tensor) -> dict[str, torch.Tensor]:
    """The entries of an optimizer's state of ``stepped`` that hold one value per element (not ``step``)."""
    return {k: v for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.shape == stepped.shape and v.is_floating_point()}
