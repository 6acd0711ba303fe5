"""What a training step did at run time, observed from outside the runtime.

The plan and the rewritten graphs say what a step should do; these probes see what it did, so that a feature
that silently stops working (no recomputation, no W actions, fp32 where bf16 was planned) fails a test:

- ``saved_tensors()``: the storages autograd keeps for backward while the block runs, with their dtypes;
- ``sent_bytes()``: the bytes the pipeline's hops send (``torch.distributed.isend``), by dtype;
- ``StepProbe``: a dispatch mode counting the operators only a forward runs that run inside backward
  (recomputation), and with ``memory=True`` the bytes the step allocated that are alive when backward
  begins (what the forward kept for it);
- ``probed(launcher)``: a launcher whose ranks record, for every ``pm.step``, the actions executed, the weight
  gradients ``W`` actions computed and the ``StepProbe`` counts, on each returned ``Run`` as ``.probe``.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from autopar.core import weight_grad
from autopar.core.schedule import W, Action
from autopar.parallel import ParallelModel
from autopar.runtime import regather
from autopar.runtime.memory import NewStorages

aten = torch.ops.aten
# operators that a forward runs and no backward formula calls (backward has its own kernels: tanh_backward, ...)
FORWARD_ONLY = {aten.native_layer_norm, aten.tanh, aten.gelu, aten.silu, aten.rsqrt, aten._softmax,
                aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_efficient_attention}


class SavedTensors:
    """The storages saved for backward (parameters aside): data pointer -> (dtype, bytes)."""

    def __init__(self) -> None:
        self.storages: dict[int, tuple[torch.dtype, int]] = {}

    def note(self, t: Any) -> Any:
        kept = t.source.shard if isinstance(t, regather.Handle) else t  # sequence parallelism keeps the shard
        if isinstance(kept, torch.Tensor):
            base = kept._base if kept._base is not None else kept
            if not (base.is_leaf and base.requires_grad):
                self.storages[base.untyped_storage().data_ptr()] = (kept.dtype, base.untyped_storage().nbytes())
        return t

    def bytes(self, dtype: torch.dtype | None = None) -> int:
        return sum(n for d, n in self.storages.values() if dtype is None or d == dtype)

    def floating(self) -> int:
        return sum(n for d, n in self.storages.values() if d.is_floating_point)


@contextlib.contextmanager
def saved_tensors() -> Iterator[SavedTensors]:
    """What autograd saves while the block runs. The runtime's own saved-tensor hooks (sequence parallelism's
    ``regather``) run inside these: what they keep is counted through ``regather.pack``."""
    saved = SavedTensors()
    runtime_pack = regather.pack
    regather.pack = lambda t: saved.note(runtime_pack(t))
    try:
        with torch.autograd.graph.saved_tensors_hooks(saved.note, lambda t: t):
            yield saved
    finally:
        regather.pack = runtime_pack


@contextlib.contextmanager
def sent_bytes() -> Iterator[Counter]:
    """Bytes sent by ``torch.distributed.isend`` (the pipeline's hops) while the block runs, by dtype."""
    sent: Counter = Counter()
    isend = dist.isend

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent[tensor.dtype] += tensor.numel() * tensor.element_size()
        return isend(tensor, *args, **kwargs)

    dist.isend = counting
    try:
        yield sent
    finally:
        dist.isend = isend


class StepProbe(NewStorages):
    """Counts the ``FORWARD_ONLY`` operators that run while autograd runs a backward node (``recomputed``, by
    name): without recomputation none do. With ``memory``, ``at_backward`` is the bytes of the storages
    allocated under the mode that are alive at the first operator of backward."""

    def __init__(self, *, memory: bool = False) -> None:
        super().__init__(track_peak=False)
        self.memory = memory
        self.recomputed: Counter = Counter()
        self.at_backward: int | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if torch._C._current_autograd_node() is not None:
            if self.memory and self.at_backward is None:
                self.at_backward = self.live()
            if func.overloadpacket in FORWARD_ONLY:
                self.recomputed[func.overloadpacket.__name__] += 1
        if self.memory:
            return super().__torch_dispatch__(func, types, args, kwargs)
        return func(*args, **(kwargs or {}))


@dataclass
class Probe:
    """What a rank's ``pm.step`` calls did: per step the actions run, and over all steps the weight gradients
    ``W`` actions computed and the operators recomputed in backward."""

    actions: list[list[str]] = field(default_factory=list)
    weight_gradients: int = 0  # computed by ``W`` actions
    outside_w: Counter = field(default_factory=Counter)  # recorded weight gradients computed by other actions
    recomputed: Counter = field(default_factory=Counter)

    def kinds(self) -> set[str]:
        """The kinds of action run (``"F"``, ``"B"``, ``"W"``, ...)."""
        return {Action.parse(a).kind for step in self.actions for a in step}


def _probed_rank(fn: Callable, *args: Any) -> Any:
    probe = Probe()
    step, run = ParallelModel.step, weight_grad.WeightGradients.run
    stepping: list[ParallelModel] = []  # the model whose step runs
    computed: list[tuple[int, int]] = []  # this step's (index of the running action, weight gradients computed)

    def probed_step(self: ParallelModel, *a: Any, **k: Any) -> Any:
        stepping.append(self)
        try:
            with StepProbe() as mode:
                loss = step(self, *a, **k)
        finally:
            stepping.pop()
        actions = [action for action, _, _ in self.timeline()]
        probe.actions.append(actions)
        probe.recomputed.update(mode.recomputed)
        for index, count in computed:  # the action running is the one after those the executor has timed
            kind = Action.parse(actions[index]).kind
            if kind == W:
                probe.weight_gradients += count
            else:
                probe.outside_w[actions[index]] += count
        computed.clear()
        return loss

    def probed_run(self: weight_grad.WeightGradients, *a: Any, **k: Any) -> None:
        if stepping:
            computed.append((len(stepping[-1].runtime.executor.timeline), len(self.pending)))
        run(self, *a, **k)

    ParallelModel.step, weight_grad.WeightGradients.run = probed_step, probed_run
    try:
        out = fn(*args)
    finally:
        ParallelModel.step, weight_grad.WeightGradients.run = step, run
    out.probe = probe
    return out


def assert_split_backward_ran(runs: list[Any]) -> None:
    """Every rank of a ``probed`` run executed ``W`` actions, they computed weight gradients, and no other action
    computed a recorded one (a ``B`` that runs its weight gradients at once leaves ``W`` nothing to defer)."""
    for rank, run in enumerate(runs):
        assert W in run.probe.kinds() and run.probe.weight_gradients > 0, (
            f"rank {rank} ran {sorted(run.probe.kinds())} and W computed {run.probe.weight_gradients} weight "
            "gradients: the split backward did not run")
        assert not run.probe.outside_w, (
            f"rank {rank} computed recorded weight gradients outside W: {dict(run.probe.outside_w)}")


def probed(launcher: Callable) -> Callable:
    """``launcher`` whose ranks record what every ``pm.step`` did (``Probe``) on the object ``fn`` returns."""
    return lambda fn, nprocs, *args: launcher(_probed_rank, nprocs, fn, *args)
