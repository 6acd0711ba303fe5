"""Equivalence testing: the parallel run must equal single-device training.

``assert_equivalent`` trains ``make_model()`` on one device and, on real ranks,
the ``parallelize``-d copy, then compares the loss of every step, the forward
output after training, and every parameter; a mismatch is reported by
parameter name and step with the worst error.

In float64 it also asserts exactness: the relative error of every parameter's
*update* (its change over the run, ``||parallel - single|| / ||single - initial||``,
so a small gradient error is not hidden by a large weight), of every loss and
of the output's float64 tensors is at most ``update_rtol`` (default 1e-12 when the model is float64).
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
(each dp shard and microbatch on its own, its loss weighted by its share of
the items the loss counts, gradients accumulated, outputs concatenated, as
autopar does), and the whole-batch run at ``rtol``/``atol``, the model's own
bound (``Report.control_error`` measures it; ``control_rtol`` bounds it).

Under ``precision="bf16"`` the single-device run is ``MixedPrecisionReference``
(the same policy as a plain eager loop: fp32 masters, a bf16 copy for forward
and backward, the loss in fp32, fp32 gradients onto the masters), compared
within ``MixedBounds``, which states bf16's tolerances and why.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from autopar.core.mesh import Mesh
from autopar.parallel import parallelize
from autopar.precision import policy, widened
from autopar.runtime.batch import split_batch
from autopar.runtime.launch import launch

def __getattr__(name: str) -> Any:
    """``autopar.testing.strategies``: hypothesis strategies (``autopar/strategies.py``), imported on first use."""
    if name == "strategies":
        import autopar.strategies

        return autopar.strategies
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
                  max_grad_norm: float | None = None, split: tuple[int, int] | None = None,
                  precision: str = "fp32", device: str | torch.device = "cpu") -> Run:
    """Single-device training on the global batch (gradients clipped to ``max_grad_norm`` when given).

    ``split=(dp, microbatches)``: the control. The batch is cut as autopar cuts it; each part's
    loss is weighted by its share of the batch (``part_weights``) and back-propagated on its own; the
    loss is their weighted sum.
    ``precision="bf16"``: the mixed-precision policy as a plain eager loop (``MixedPrecisionReference``).
    ``device``: where the model trains; the run's tensors are returned on the CPU, as ``parallel_run``'s.
    """
    from autopar.compiler.capture import model_loss

    model = make_model().to(device)
    inputs, target, kwargs = _to((inputs, target, kwargs), device)
    initial = _to(model.state_dict(), "cpu")
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = optimizer([p for _, p in trainable])
    mixed = MixedPrecisionReference(model, precision) if policy(precision) is not None else None
    kwargs = kwargs or {}
    parts = [((inputs, kwargs), target)]
    weights = [1.0]
    if split is not None:
        parts = split_batch(((inputs, kwargs), target), split[0] * split[1], dp=split[0], microbatches=split[1])
        weights = part_weights(make_model, parts, loss_fn)
    losses, grad_max = [], {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in trainable}
    for _ in range(steps):
        total = 0.0
        for ((args, kw), tgt), weight in zip(parts, weights):
            if mixed is not None:
                loss = mixed.forward_backward(args, kw, tgt, loss_fn, weight)
            else:
                out = model(*args, **kw)
                loss = loss_fn(out, tgt) if loss_fn is not None else model_loss(out)
                (loss * weight).backward()
            total += float(loss.detach()) * weight
        if mixed is not None:
            mixed.gradients_to_masters()
        for n, p in trainable:
            if p.grad is not None:
                grad_max[n] = torch.maximum(grad_max[n], p.grad.detach().double().abs().cpu())
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for _, p in trainable], max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    with torch.no_grad():
        outs = [mixed.forward(args, kw) if mixed is not None else model(*args, **kw) for (args, kw), _ in parts]
    return Run(losses, _merged(outs, weights), _to(model.state_dict(), "cpu"), initial, grad_max)


def _merged(outs: list[Any], weights: list[float]) -> Any:
    """The parts' outputs as one: tensors concatenated along dim 0, scalars (a loss) summed with the weights."""
    if len(outs) == 1:
        return _detach(outs[0])
    flats = [pytree.tree_flatten(_detach(o)) for o in outs]
    leaves = [torch.cat(parts) if isinstance(parts[0], torch.Tensor) and parts[0].dim() > 0
              else sum(w * p for w, p in zip(weights, parts)) if isinstance(parts[0], torch.Tensor) else parts[0]
              for parts in zip(*(f for f, _ in flats))]
    return pytree.tree_unflatten(leaves, flats[0][1])


def part_weights(make_model: Callable, parts: list[Any], loss_fn: Callable | None) -> list[float]:
    """Each part's weight in the whole batch's loss: its share of the items the loss counts where the loss
    is one mean over a count of its inputs (``passes/global_count.py``, e.g. tokens not ignored), else equal."""
    from autopar.compiler.capture import capture
    from autopar.passes.global_count import normalize_by_global_count

    (args, kw), tgt = parts[0]
    captured = capture(make_model(), args, kw, with_loss=True, loss_fn=loss_fn, target=tgt)
    counts = normalize_by_global_count(captured)
    if counts is None or len(counts.sources) != 1:
        return [1 / len(parts)] * len(parts)
    found = [float(counts.count(pytree.tree_leaves(((a, k), t)))[0]) for (a, k), t in parts]
    return [c / sum(found) for c in found]


class MixedPrecisionReference:
    """The mixed-precision policy as a plain eager loop around an fp32 ``master`` model (FSDP2's, by hand).

    Each forward and backward runs on a copy of the model whose parameters are the masters cast to the
    compute dtype (buffers keep their own); floating inputs are cast to it, its floating outputs to float32
    before the loss (which is float32); the copy's
    gradients are added to the masters' in float32 (so microbatches accumulate in float32), where the
    caller's optimizer steps them. Under ``precision="mixed"`` (bf16 gradients) the parts' gradients
    accumulate in the copy, in bf16, and reach the masters in float32 once per step
    (``gradients_to_masters``), as DeepSpeed's and Megatron-LM's bf16 optimizers hand them over.
    """

    def __init__(self, master: torch.nn.Module, precision: str) -> None:
        self.master = master
        self.policy = policy(precision)
        self.copy = copy.deepcopy(master)
        for p in self.copy.parameters():
            p.data = p.data.to(self.policy.compute)

    def _sync(self) -> None:
        with torch.no_grad():
            for mine, theirs in zip(self.copy.parameters(), self.master.parameters()):
                mine.copy_(theirs)

    def _cast(self, tree: Any) -> Any:
        dtype = self.policy.compute
        return pytree.tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
                               else x, tree)

    def forward_backward(self, args: tuple, kwargs: dict, target: Any, loss_fn: Callable | None,
                         weight: float) -> torch.Tensor:
        """One part's loss (float32), back-propagated as ``loss * weight``; its gradients added to the masters'."""
        from autopar.compiler.capture import model_loss

        self._sync()
        args, kwargs = self._cast((args, kwargs))
        out = widened(self.copy(*args, **kwargs), self.policy.master)  # the loss is computed in float32
        loss = (loss_fn(out, target) if loss_fn is not None else model_loss(out)).float()
        (loss * weight).backward()
        if not self.policy.separate_masters:
            self.gradients_to_masters()
        return loss

    def gradients_to_masters(self) -> None:
        """The copy's gradients, widened, are added to the masters' (the copy's are dropped)."""
        for mine, theirs in zip(self.copy.parameters(), self.master.parameters()):
            if mine.grad is not None:
                grad = mine.grad.to(theirs.dtype)
                theirs.grad = grad if theirs.grad is None else theirs.grad + grad
                mine.grad = None

    def forward(self, args: tuple, kwargs: dict) -> Any:
        self._sync()
        args, kwargs = self._cast((args, kwargs))
        return self.copy(*args, **kwargs)


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
    rtol: float | None = None,
    atol: float | None = None,
    *,
    kwargs: dict | None = None,
    launcher: Callable | None = None,
    update_rtol: float | None = None,
    control: bool = False,
    control_rtol: float = 1e-5,
    report: list[Report] | None = None,
    **parallelize_kwargs: Any,
) -> list[Run]:
    """Raises AssertionError naming the worst mismatch if the parallel run differs from single-device.

    ``make_model`` must build the same model on every call (seed it).
    ``launcher(fn, nprocs, *args)`` runs the ranks (default ``autopar.launch``;
    a ``WorkerPool``'s ``launch`` reuses processes across calls).
    ``rtol``/``atol``: element-wise bounds (default 1e-5 / 1e-6; 0.1 / 0.1 under mixed precision,
    a check for gross errors only). ``update_rtol``: the bound on relative errors of updates, losses
    and output (see the module docstring); default 1e-12 for a float64 model, none otherwise; under
    mixed precision the bound on the update of all parameters together (``MIXED``). ``control``:
    compare with the single-device run on autopar's split of the batch (module docstring).
    ``report``: a list that receives one ``Report`` per rank. ``control_rtol``: the bound on the
    control's relative error against the whole-batch run (the model's own rounding on a split batch).

    ``precision="bf16"`` (passed on to ``parallelize``) compares with ``MixedPrecisionReference``, the
    same policy as a plain eager loop, within ``MIXED``'s bounds.
    """
    max_norm = parallelize_kwargs.get("max_grad_norm")
    precision = parallelize_kwargs.get("precision", "fp32")
    mixed = policy(precision) is not None
    rtol = rtol if rtol is not None else 0.1 if mixed else 1e-5
    atol = atol if atol is not None else 0.1 if mixed else 1e-6
    ref = reference_run(make_model, inputs, target, loss_fn, optimizer, steps, kwargs, max_norm, precision=precision)
    exact_to = ref
    if control:
        split = (mesh.dp, parallelize_kwargs.get("microbatches", 1))
        exact_to = reference_run(make_model, inputs, target, loss_fn, optimizer, steps, kwargs, max_norm, split,
                                 precision=precision)
    if update_rtol is None and _all_float64(ref.initial):
        update_rtol = 1e-12
    runs = parallel_run(make_model, mesh, inputs, target, loss_fn, optimizer, steps, kwargs, launcher,
                        **parallelize_kwargs)
    bound = relative_errors(ref, exact_to)[0] if control else None
    if bound is not None and bound > control_rtol:
        raise AssertionError(f"the single-device run on autopar's split of the batch differs from the whole-batch "
                             f"run by {bound:.3e} (bound {control_rtol:.0e}): the split itself changes the result")
    for rank, run in enumerate(runs):
        _compare(ref, run, rank, rtol, atol)
        if mixed:
            _check_mixed(exact_to, run, rank, MIXED if update_rtol is None else
                         dataclasses.replace(MIXED, update=update_rtol), report)
            continue
        worst, what = relative_errors(exact_to, run)
        rep = Report(worst, what, bound)
        if report is not None:
            report.append(rep)
        if update_rtol is not None and worst > update_rtol:
            against = "the single-device run on the same split of the batch" if control else "single-device training"
            raise AssertionError(f"rank {rank} is not exact: relative error {worst:.3e} of {what} against {against} "
                                 f"(bound {update_rtol:.0e}); a lower-precision intermediate or a changed computation")
    return runs


@dataclass(frozen=True)
class MixedBounds:
    """Relative bounds for a mixed-precision run against ``MixedPrecisionReference`` (the same policy eagerly).

    bfloat16 keeps 8 significant bits (a rounding error of up to 2^-9 = 2e-3 per operation). A parallel run
    rounds in other places than one device (tp partial sums, dp and microbatch means, a gradient rounded to
    bf16 per microbatch before it is accumulated in fp32), so its values differ by a few roundings:
    - ``loss``: the fp32 loss of each step (computed from bf16 logits widened to fp32): measured 5e-8 to
      1.5e-4 on GPT-2, LLaMA and BERT over dp, tp, pp and ZeRO-3, three steps;
    - ``output``: the forward output after training (bf16 logits), ``||a - b|| / ||a||``: measured 4e-3 to
      1.2e-2;
    - ``update``: every trainable parameter's change over the run, all parameters together,
      ``||parallel - reference|| / ||reference - initial||``: measured 2.5e-3 to 5e-3 with SGD, 2.6e-2 to
      3.3e-2 with AdamW (Adam divides each gradient element by its own running size, so an element whose
      gradient is near rounding noise, such as attention's key bias, moves by the learning rate either way).
    A wrong computation (a missing reduction, a wrong shard) moves updates by their own size (error ~1).
    Single small tensors (biases) are not bounded on their own: under Adam their updates differ by 10-80%
    between two correct bf16 runs.
    """

    loss: float = 1e-3
    output: float = 3e-2
    update: float = 8e-2


MIXED = MixedBounds()


def mixed_errors(ref: Run, run: Run) -> dict[str, float]:
    """The errors ``MixedBounds`` bounds: worst loss, the output, the update of all parameters together."""
    loss = max((abs(a - b) / max(abs(a), 1e-30) for a, b in zip(ref.losses, run.losses)), default=0.0)
    num = den = out_num = out_den = 0.0
    for a, b in zip(pytree.tree_leaves(ref.output), pytree.tree_leaves(run.output)):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.shape == b.shape:
            out_num, out_den = out_num + _norm(a - b) ** 2, out_den + _norm(a) ** 2
    for name in ref.grad_max:
        a, b, start = ref.state.get(name), run.state.get(name), ref.initial.get(name)
        if a is not None and b is not None and start is not None and a.shape == b.shape:
            num, den = num + _norm(a.double() - b.double()) ** 2, den + _norm(a.double() - start.double()) ** 2
    return {"loss": loss, "output": (out_num / max(out_den, 1e-300)) ** 0.5,
            "update": (num / max(den, 1e-300)) ** 0.5}


def _check_mixed(ref: Run, run: Run, rank: int, bounds: MixedBounds, report: list[Report] | None) -> None:
    errors = mixed_errors(ref, run)
    if report is not None:
        report.append(Report(errors["update"], ", ".join(f"{k} {v:.1e}" for k, v in errors.items())))
    over = [f"{k} {v:.2e} (bound {getattr(bounds, k):.0e})" for k, v in errors.items()
            if v > getattr(bounds, k)]
    if over:
        raise AssertionError(f"rank {rank} differs from the mixed-precision reference beyond bf16 rounding: "
                             f"{'; '.join(over)}")


def relative_errors(ref: Run, run: Run) -> tuple[float, str]:
    """The worst relative error of ``run`` against ``ref``: each loss, the output, each parameter's update."""
    worst = [(abs(a - b) / max(abs(a), 1e-300), f"the loss at step {i}")
             for i, (a, b) in enumerate(zip(ref.losses, run.losses))]
    for i, (a, b) in enumerate(zip(pytree.tree_leaves(ref.output), pytree.tree_leaves(run.output))):
        if isinstance(a, torch.Tensor) and a.dtype == torch.float64 and a.shape == b.shape:
            worst.append((_norm(a - b) / max(_norm(a), 1e-300), f"output leaf {i}"))  # (others: rtol/atol)
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
    return _to(tree, "cpu")


def _to(tree: Any, device: str | torch.device) -> Any:
    """``tree`` with its tensors detached and copied to ``device``."""
    return pytree.tree_map(lambda x: x.detach().to(device, copy=True) if isinstance(x, torch.Tensor) else x, tree)
