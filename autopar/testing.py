"""Equivalence testing: the parallel run must equal single-device training.

``assert_equivalent`` trains ``make_model()`` on one device and, on real ranks,
the ``parallelize``-d copy, then compares the loss of every step, the forward
output after training, and every parameter; a mismatch is reported by
parameter name and step with the worst error.

In float64 it also asserts exactness: the relative error of every parameter's
*update* (its change over the run, ``||parallel - single|| / ||single - initial||``,
so a small gradient error is not hidden by a large weight), of every loss and
of the output is at most ``update_rtol`` (default 1e-12 when the model is float64).
Elements whose gradient on one device is rounding noise cannot meet a relative
bound and are checked by ``rtol``/``atol`` alone: those whose gradient is at
most ``NOISE`` times the largest gradient element of the model in every step
(the key bias of attention, to which softmax is invariant; Adam turns that
noise into an update of its own). So are frozen parameters and buffers.

Some models compute parts in float32 on purpose (norms, a scan, the loss).
Their float32 sums round differently on a smaller batch, so a run that splits
the batch (dp, microbatches) cannot match the whole-batch run better than the
model itself does on that split. ``control=True`` compares the parallel run at
``update_rtol`` with the *control*: the single-device model on the same split
(each dp shard and microbatch on its own, losses averaged and gradients
accumulated as autopar does), and the whole-batch run at ``rtol``/``atol``, the
model's own bound (``Report.control_error`` measures it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from autopar.core.mesh import Mesh
from autopar.parallel import parallelize
from autopar.runtime.batch import split_batch
from autopar.runtime.launch import launch

NOISE = 1e-10  # a gradient element this many times smaller than the largest one is rounding noise


@dataclass
class Run:
    """What one training run produced (single-device runs also keep the start and the gradients' sizes)."""

    losses: list[float]
    output: Any
    state: dict[str, torch.Tensor]
    initial: dict[str, torch.Tensor] = field(default_factory=dict)
    grad_max: dict[str, torch.Tensor] = field(default_factory=dict)  # largest |gradient| over the steps, per element


@dataclass
class Report:
    """Worst relative errors of a parallel run (float64 exactness), and the model's own bound on a split batch."""

    update_error: float  # worst over parameters, losses and the output, against the comparison run
    worst: str  # what it was measured on
    control_error: float | None = None  # the control against the whole-batch run (None: no control)


def reference_run(make_model: Callable, inputs: tuple, target: Any, loss_fn: Callable | None,
                  optimizer: Callable, steps: int, kwargs: dict | None = None,
                  max_grad_norm: float | None = None, split: tuple[int, int] | None = None) -> Run:
    """Single-device training on the global batch (gradients clipped to ``max_grad_norm`` when given).

    ``split=(dp, microbatches)``: the control. The batch is cut as autopar cuts it; each part's
    loss is divided by the number of parts and back-propagated on its own; the loss is their mean.
    """
    from autopar.capture import model_loss

    model = make_model()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = optimizer([p for _, p in trainable])
    kwargs = kwargs or {}
    parts = [((inputs, kwargs), target)]
    if split is not None:
        parts = split_batch(((inputs, kwargs), target), split[0] * split[1], dp=split[0], microbatches=split[1])
    losses, grad_max = [], {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in trainable}
    for _ in range(steps):
        total = 0.0
        for (args, kw), tgt in parts:
            out = model(*args, **kw)
            loss = loss_fn(out, tgt) if loss_fn is not None else model_loss(out)
            (loss / len(parts)).backward()
            total += float(loss.detach()) / len(parts)
        for n, p in trainable:
            if p.grad is not None:
                grad_max[n] = torch.maximum(grad_max[n], p.grad.detach().double().abs().cpu())
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for _, p in trainable], max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    with torch.no_grad():
        output = model(*inputs, **kwargs)
    return Run(losses, _detach(output), {k: v.detach().clone() for k, v in model.state_dict().items()},
               initial, grad_max)


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
    update_rtol: float | None = None,
    control: bool = False,
    report: list[Report] | None = None,
    **parallelize_kwargs: Any,
) -> list[Run]:
    """Raises AssertionError naming the worst mismatch if the parallel run differs from single-device.

    ``make_model`` must build the same model on every call (seed it).
    ``launcher(fn, nprocs, *args)`` runs the ranks (default ``autopar.launch``;
    a ``WorkerPool``'s ``launch`` reuses processes across calls).
    ``update_rtol``: the bound on relative errors of updates, losses and output (see the module
    docstring); default 1e-12 for a float64 model, none otherwise. ``control``: compare with the
    single-device run on autopar's split of the batch (module docstring). ``report``: a list that
    receives one ``Report`` per rank.
    """
    max_norm = parallelize_kwargs.get("max_grad_norm")
    ref = reference_run(make_model, inputs, target, loss_fn, optimizer, steps, kwargs, max_norm)
    exact_to = ref
    if control:
        split = (mesh.dp, parallelize_kwargs.get("microbatches", 1))
        exact_to = reference_run(make_model, inputs, target, loss_fn, optimizer, steps, kwargs, max_norm, split)
    if update_rtol is None and _all_float64(ref.initial):
        update_rtol = 1e-12
    runs = parallel_run(make_model, mesh, inputs, target, loss_fn, optimizer, steps, kwargs, launcher,
                        **parallelize_kwargs)
    bound = relative_errors(ref, exact_to)[0] if control else None
    for rank, run in enumerate(runs):
        _compare(ref, run, rank, rtol, atol)
        worst, what = relative_errors(exact_to, run)
        rep = Report(worst, what, bound)
        if report is not None:
            report.append(rep)
        if update_rtol is not None and worst > update_rtol:
            against = "the single-device run on the same split of the batch" if control else "single-device training"
            raise AssertionError(f"rank {rank} is not exact: relative error {worst:.3e} of {what} against {against} "
                                 f"(bound {update_rtol:.0e}); a lower-precision intermediate or a changed computation")
    return runs


def relative_errors(ref: Run, run: Run) -> tuple[float, str]:
    """The worst relative error of ``run`` against ``ref``: each loss, the output, each parameter's update."""
    worst = [(abs(a - b) / max(abs(a), 1e-300), f"the loss at step {i}")
             for i, (a, b) in enumerate(zip(ref.losses, run.losses))]
    for i, (a, b) in enumerate(zip(pytree.tree_leaves(ref.output), pytree.tree_leaves(run.output))):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.shape == b.shape:
            worst.append((_norm(a - b) / max(_norm(a), 1e-300), f"output leaf {i}"))
    top = max((float(g.max()) for g in ref.grad_max.values() if g.numel()), default=0.0)
    for name, g in ref.grad_max.items():
        a, b, start = ref.state.get(name), run.state.get(name), ref.initial.get(name)
        if a is None or b is None or start is None or a.shape != b.shape:
            continue  # a mismatch _compare reports
        signal = g > NOISE * top  # elements whose gradient is more than rounding noise
        if signal.any():
            a, b, start = a.double()[signal], b.double()[signal], start.double()[signal]
            worst.append((_norm(a - b) / max(_norm(a - start), 1e-300), f"the update of {name!r}"))
    return max(worst, default=(0.0, "nothing"))


def _norm(t: torch.Tensor) -> float:
    return float(t.double().norm())


def _all_float64(state: dict[str, torch.Tensor]) -> bool:
    floats = [t for t in state.values() if t.is_floating_point()]
    return bool(floats) and all(t.dtype == torch.float64 for t in floats)


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
