"""Mixed-precision runs checked parameter by parameter (``tests/test_precision.py``, ``tests/test_precision_mixed.py``).

``assert_equivalent`` bounds the update of all parameters together (``MixedBounds.update``), so a bug confined
to a few small tensors (a missing tp reduction of the norm weights' gradients) moves that sum by little.
``assert_mixed`` adds a bound on each parameter's own update. Under SGD a parameter's update is its
gradient (with momentum), so the bound also catches a gradient off by a constant factor, which AdamW
normalises away: the cases it checks use SGD.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from autopar import Mesh
from autopar.testing import Run, assert_equivalent, reference_run

# Each parameter's relative update error under SGD, three steps: measured 2e-3 to 1.4e-2 on GPT-2, LLaMA and
# BERT over dp, tp, pp and ZeRO (the largest on 32-element norm weights and biases); a missing reduction or a
# doubled gradient moves a parameter's update by its own size (error 0.5 to 1).
PER_PARAMETER = 0.1
# A parameter whose update is below this fraction of its share of the whole update is rounding noise
# (attention's key bias, to which softmax is invariant: 3e-7 of its share, every other tensor above 9e-5);
# its error is measured against that fraction of its share instead of its own update.
NOISE_SHARE = 1e-4


def update_errors(ref: Run, run: Run) -> dict[str, float]:
    """Each trainable parameter's ``||run - ref|| / ||ref - initial||``, the denominator at least ``NOISE_SHARE``
    of the parameter's share of the update of all parameters (``||update|| * sqrt(its elements / all)``)."""
    names = [n for n in ref.grad_max if n in run.state and ref.state[n].shape == run.state[n].shape]
    moved = {n: float((ref.state[n].double() - ref.initial[n].double()).norm()) for n in names}
    total, elements = sum(m * m for m in moved.values()) ** 0.5, sum(ref.state[n].numel() for n in names)
    errors = {}
    for n in names:
        share = total * (ref.state[n].numel() / elements) ** 0.5
        diff = float((ref.state[n].double() - run.state[n].double()).norm())
        errors[n] = diff / max(moved[n], NOISE_SHARE * share, 1e-300)
    return errors


def assert_mixed(make_model: Callable, mesh: Mesh, inputs: tuple, target: Any, loss_fn: Callable,
                 optimizer: Callable, steps: int, launcher: Callable, precision: str, **options: Any) -> None:
    """``assert_equivalent`` under ``precision``; with SGD, also each parameter's update within ``PER_PARAMETER``
    of the same policy run eagerly (every rank). Under AdamW single small tensors are not bounded: their
    updates differ by 10-80% between two correct bf16 runs (``MixedBounds``)."""
    runs = assert_equivalent(make_model, mesh, inputs, target, loss_fn, optimizer, steps=steps, launcher=launcher,
                             precision=precision, **options)
    if not _is_sgd(optimizer):
        return
    ref = reference_run(make_model, inputs, target, loss_fn, optimizer, steps,
                        max_grad_norm=options.get("max_grad_norm"), precision=precision)
    for rank, run in enumerate(runs):
        errors = update_errors(ref, run)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= PER_PARAMETER, (
            f"rank {rank}: the update of {worst!r} is {errors[worst]:.2e} off the reference's, relative to its "
            f"own size (bound {PER_PARAMETER}); the next worst: "
            + ", ".join(f"{n} {e:.1e}" for n, e in sorted(errors.items(), key=lambda kv: -kv[1])[1:4]))


def _is_sgd(optimizer: Callable) -> bool:
    """Whether ``optimizer`` builds SGD (whose updates are its gradients, so a factor shows)."""
    return isinstance(optimizer([torch.zeros(1, requires_grad=True)]), torch.optim.SGD)
