"""Training under a learning-rate schedule, on the ranks of a job and on one device (checkpoint and ZeRO tests).

The schedule is ``StepLR(step_size=1, gamma)``: the learning rate times
``gamma`` after every step. On the ranks, its state travels in a checkpoint's
``extra``, so a resumed run continues the schedule where the saved one left it.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch

from autopar import ParallelModel

GAMMA = 0.8


def scheduled_steps(pm: ParallelModel, inputs: tuple, target: Any, steps: int, *, path: str = "", load: bool = False,
                    save: bool = False, gamma: float = GAMMA) -> list[float]:
    """The losses of ``steps`` steps of ``pm`` on the global batch, the learning rate scheduled.

    ``load``: first resume from the checkpoint in ``path`` (the scheduler's state from its ``extra``);
    ``save``: after the steps, write a checkpoint to ``path`` with the scheduler's state in ``extra``.
    """
    sched = torch.optim.lr_scheduler.StepLR(pm.optimizer, step_size=1, gamma=gamma)
    if load:
        sched.load_state_dict(pm.load(path)["scheduler"])
    losses = []
    for _ in range(steps):
        losses.append(pm.step(*inputs, target=target))
        sched.step()
    if save:
        pm.save(path, extra={"scheduler": sched.state_dict()})
    return losses


def scheduled_reference(model: torch.nn.Module, optimizer: Callable[[list], Any], loss_fn: Callable, inputs: tuple,
                        target: Any, steps: int, *, gamma: float = GAMMA) -> tuple[list[float], dict[str, Any]]:
    """The same training on one device: the loss of each step and the state after the last."""
    opt = optimizer(list(model.parameters()))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=gamma)
    losses = []
    for _ in range(steps):
        loss = loss_fn(model(*inputs), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def assert_resumes_like_one_run(launcher: Callable, leg: Callable, legs: list[tuple[Any, tuple]], make: Callable,
                                inputs: tuple, target: Any, loss_fn: Callable, optimizer: Callable[[list], Any],
                                path: str) -> None:
    """Runs ``leg(make, mesh, *args, path, load=, save=)`` for each ``(mesh, args)`` of ``legs`` in turn, each
    resuming from the checkpoint the one before saved, and checks the losses and the last leg's state (its rank
    0's ``"state"``) against one uninterrupted single-device run within 1e-11."""
    losses: list[float] = []
    for i, (mesh, args) in enumerate(legs):
        runs = launcher(functools.partial(leg, make, mesh, *args, path, load=i > 0, save=i < len(legs) - 1),
                        mesh.size)
        losses += runs[0]["losses"]
    want_losses, want_state = scheduled_reference(make(seed=0), optimizer, loss_fn, inputs, target, len(losses))
    assert losses == pytest.approx(want_losses, rel=1e-11, abs=1e-13)
    for key, value in want_state.items():
        torch.testing.assert_close(runs[0]["state"][key], value, rtol=1e-11, atol=1e-13, msg=lambda m: f"{key}: {m}")
