"""Backward on a thread of its own: what it reaches (process groups, ZeRO-3 groups, counts) it carries from forward.

On CUDA, autograd runs backward on its own device threads, where nothing the step
bound (``core/collectives.py``'s binding) is visible. Here every backward of a step
runs on a fresh thread, with no context of the step's, and the step's losses, counts
and parameters must be those of the same steps run as usual: the collectives'
backward, a recomputed region (tp collectives, ZeRO-3's gather of the layer) and
sequence parallelism's re-gathered activations all run on the forward's binding.
"""
from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import models
from autopar import Mesh, parallelize

IDS = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(2))


def _on_another_thread(backward: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> None:
        errors: list[BaseException] = []

        def target() -> None:
            try:
                backward(*args, **kwargs)
            except BaseException as e:  # re-raised on the step's thread
                errors.append(e)

        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
        if errors:
            raise errors[0]
    return run


def _steps(mesh: dict[str, int], options: dict[str, Any]) -> list[tuple[list[float], dict, list[torch.Tensor]]]:
    """Losses, collective counts and parameters after two steps: backward elsewhere, then as usual."""
    real = torch.autograd.backward
    out = []
    for elsewhere in (True, False):
        torch.manual_seed(0)
        pm = parallelize(models.gpt2(), Mesh(**mesh), loss_fn=models.lm_loss, optimizer=models.adamw, **options)
        torch.autograd.backward = _on_another_thread(real) if elsewhere else real  # (Tensor.backward calls it)
        try:
            losses = [pm.step(IDS, target=TARGET) for _ in range(2)]
        finally:
            torch.autograd.backward = real
        out.append((losses, dict(pm.communication(calls=True)), [p.detach().clone() for p in pm.parameters()]))
    return out


@pytest.mark.parametrize("mesh, options", [
    pytest.param({"tp": 2}, {"sequence_parallel": True, "recompute": "full"}, id="tp-sequence-parallel-recompute"),
    pytest.param({"dp": 2}, {"zero": 3, "recompute": "full"}, id="zero3-recompute", marks=pytest.mark.slow),
])
def test_backward_on_another_thread_runs_on_the_forwards_binding(launcher, mesh: dict, options: dict) -> None:
    for (losses, counts, params), (want_losses, want_counts, want_params) in launcher(_steps, 2, mesh, options):
        assert losses == want_losses
        assert counts == want_counts
        assert all(torch.equal(p, q) for p, q in zip(params, want_params))
