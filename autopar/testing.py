"""Equivalence testing: the parallel run must equal single-device training.

``assert_equivalent`` trains ``make_model()`` on one device and, on real ranks,
the ``parallelize``-d copy, then compares the loss of every step, the forward
output after training, and every parameter; a mismatch is reported by
parameter name and step with the worst error.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from autopar.mesh import Mesh
from autopar.parallel import parallelize
from runtime.launch import launch


@dataclass
class Run:
    """What one training run produced."""

    losses: list[float]
    output: Any
    state: dict[str, torch.Tensor]


def reference_run(make_model: Callable, inputs: tuple, target: Any, loss_fn: Callable | None,
                  optimizer: Callable, steps: int, kwargs: dict | None = None,
                  max_grad_norm: float | None = None) -> Run:
    """Single-device training on the global batch (gradients clipped to ``max_grad_norm`` when given)."""
    from autopar.capture import model_loss

    model = make_model()
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    kwargs = kwargs or {}
    losses = []
    for _ in range(steps):
        out = model(*inputs, **kwargs)
        loss = loss_fn(out, target) if loss_fn is not None else model_loss(out)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    with torch.no_grad():
        output = model(*inputs, **kwargs)
    return Run(losses, _detach(output), {k: v.detach().clone() for k, v in model.state_dict().items()})


def _parallel_rank(make_model: Callable, mesh: Mesh, inputs: tuple, target: Any, loss_fn: Callable | None,
                   optimizer: Callable, steps: int, kwargs: dict, options: dict) -> Run:
    pm = parallelize(make_model(), mesh, loss_fn=loss_fn, optimizer=optimizer, **options)
    losses = [pm.step(*inputs, target=target, **kwargs) for _ in range(steps)]
    output = _detach(pm(*inputs, **kwargs))
    return Run(losses, output, pm.state_dict())


def parallel_run(make_model: Callable, mesh: Mesh, inputs: tuple, target: Any, loss_fn: Callable | None,
                 optimizer: Callable, steps: int, kwargs: dict | None = None,
                 launcher: Callable | None = None, **options: Any) -> list[Run]:
    """The parallel run on ``mesh.size`` local ranks; one ``Run`` per rank."""
    launcher = launcher or launch
    return launcher(_parallel_rank, mesh.size, make_model, mesh, inputs, target, loss_fn, optimizer, steps,
                    kwargs or {}, options)


def assert_equivalent(
    make_model: Callable[[], torch.nn.Module],
    mesh: Mesh,
    inputs: tuple,
    target: Any,
    loss_fn: Callable | None,
    optimizer: Callable[[list], Any],
    steps: int = 2,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    *,
    kwargs: dict | None = None,
    launcher: Callable | None = None,
    **parallelize_kwargs: Any,
) -> list[Run]:
    """Raises AssertionError naming the worst mismatch if the parallel run differs from single-device.

    ``make_model`` must build the same model on every call (seed it).
    ``launcher(fn, nprocs, *args)`` runs the ranks (default ``autopar.launch``;
    a ``WorkerPool``'s ``launch`` reuses processes across calls).
    """
    ref = reference_run(make_model, inputs, target, loss_fn, optimizer, steps, kwargs,
                        parallelize_kwargs.get("max_grad_norm"))
    runs = parallel_run(make_model, mesh, inputs, target, loss_fn, optimizer, steps, kwargs, launcher,
                        **parallelize_kwargs)
    for rank, run in enumerate(runs):
        _compare(ref, run, rank, rtol, atol)
    return runs


def _compare(ref: Run, run: Run, rank: int, rtol: float, atol: float) -> None:
    problems = []
    for step, (a, b) in enumerate(zip(ref.losses, run.losses)):
        if not abs(a - b) <= atol + rtol * abs(a):
            problems.append((abs(a - b), f"loss at step {step}: single-device {a!r}, parallel {b!r}"))
    ref_out, out = pytree.tree_leaves(ref.output), pytree.tree_leaves(run.output)
    if len(ref_out) != len(out):
        problems.append((float("inf"), f"output has {len(out)} leaves, single-device {len(ref_out)}"))
    for i, (a, b) in enumerate(zip(ref_out, out)):
        problems += _tensor_problem(f"output leaf {i}", a, b, rtol, atol)
    missing = sorted(set(ref.state) ^ set(run.state))
    if missing:
        problems.append((float("inf"), f"state_dict keys differ: {missing[:5]}"))
    for name in ref.state:
        if name in run.state:
            problems += _tensor_problem(f"parameter {name!r} after {len(ref.losses)} steps",
                                        ref.state[name], run.state[name], rtol, atol)
    if problems:
        problems.sort(key=lambda p: -p[0])
        lines = "\n  ".join(text for _, text in problems[:8])
        raise AssertionError(f"rank {rank} differs from single-device training in {len(problems)} place(s); worst first:\n  {lines}")


def _tensor_problem(what: str, a: Any, b: Any, rtol: float, atol: float) -> list[tuple[float, str]]:
    if not isinstance(a, torch.Tensor):
        return [] if a == b else [(float("inf"), f"{what}: {a!r} != {b!r}")]
    if a.shape != b.shape:
        return [(float("inf"), f"{what}: shape {tuple(b.shape)}, single-device {tuple(a.shape)}")]
    if a.is_floating_point():
        err = (a.double() - b.double()).abs()
        bad = err > atol + rtol * a.double().abs()
        if bad.any():
            worst = float(err.max())
            return [(worst, f"{what}: max abs error {worst:.3e} ({int(bad.sum())} of {a.numel()} elements beyond tolerance)")]
        return []
    return [] if torch.equal(a, b) else [(float("inf"), f"{what}: values differ")]


def _detach(tree: Any) -> Any:
    return pytree.tree_map(lambda x: x.detach().cpu().clone() if isinstance(x, torch.Tensor) else x, tree)
