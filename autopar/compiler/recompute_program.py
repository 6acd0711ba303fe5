"""Activation recomputation on a compiled program: every rank's graphs (or pipeline stages) rewritten, the plan told.

It runs after every other pass (tensor parallelism, pipeline cuts, ZeRO-3's
gathers), so that each region holds its layer's operators as the rank runs
them: its tp collectives (kept, never run again) and its ZeRO-3 all-gather
(run again in backward). Under ZeRO-3 each dp group's graphs are rewritten when
first asked for, as ``zero_compile`` makes them.

Where a step runs its one microbatch's backward right after its forward (no
pipeline, one microbatch, gradients made by the step rather than held in dp
buckets), the last layer's backward follows its forward directly, and
recomputing it saves memory only if the step's peak lies between the two.
``kept_last_layer`` simulates the step both ways on fake tensors
(``passes.peak_memory``) and keeps that layer's activations when the peak does
not rise, saving one layer's recomputation; the plan says so.

Invariant: a rank's rewritten graphs compute what its graphs computed, value
for value (``passes.recompute``); the layers and modes in ``plan.recompute``
are those its graphs run with; a layer asked to recompute is kept only where
the simulated peak of the step stays as it was.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch.fx as fx

from autopar.core.graph import SlotKind
from autopar.core.plan import RecomputePlan
from autopar.core.recompute_modes import mode_of, unmatched_keys
from autopar.core.schedule import B, F, REDUCE_GRAD, Action, Schedule
from autopar.compiler.log import log_pass
from autopar.options import Options
from autopar.passes.expert_parallel import recomputed_exchanges
from autopar.passes.peak_memory import simulated_peak
from autopar.passes.recompute import layers, recompute
from autopar.compiler.program import Program


class _Rewrite:
    """``passes.recompute`` with the program's layer modes, once per graph (tp ranks may share one)."""

    def __init__(self, modes: dict[str, str], *, lazy: bool) -> None:
        self.modes = modes
        self.lazy = lazy  # rewritten after the plan was made (ZeRO-3): a skipped layer is reported as a warning
        self.done: dict[int, fx.GraphModule] = {}
        self.skipped: dict[str, str] = {}

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        if id(gm) not in self.done:
            result = recompute(gm, lambda layer: self.modes.get(layer, "none"))
            for layer, why in result.skipped.items():
                if self.lazy and layer not in self.skipped:
                    warnings.warn(f"layer {layer} is not recomputed: {why}", stacklevel=2)
                self.skipped[layer] = why
            self.done[id(gm)] = result.gm
        return self.done[id(gm)]


def layer_modes(gm: fx.GraphModule, choice: Any) -> dict[str, str]:
    """The mode of every layer of ``gm`` under ``recompute=choice``; a key naming no layer is an error."""
    names = layers(gm)
    unknown = unmatched_keys(choice, names)
    if unknown:
        shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
        raise ValueError(f"recompute names {unknown[0]!r}, which matches no layer of the model; its layers are "
                         f"{shown or 'none (no module list)'}; use those names or patterns such as "
                         f"'{names[0].rpartition('.')[0] if names else 'layers'}.*'")
    return {layer: mode_of(choice, layer) for layer in names}


def backward_follows_forward(step: Schedule | None) -> bool:
    """Whether ``step`` runs one forward and then its backward, with gradients the step itself allocates: one
    rank, one stage, one microbatch, no dp reduction (whose buckets hold gradients between steps)."""
    if step is None or len(step.actions) != 1:
        return False
    actions = step.actions[0]
    return ([a for a in actions if a.is_compute] == [Action(0, F, 0), Action(0, B, 0)]
            and all(a.kind != REDUCE_GRAD for a in actions))


def kept_last_layer(program: Program, modes: dict[str, str]) -> tuple[str, str] | None:
    """``(layer, why)`` when the graph's last layer should keep its activations although ``modes`` recomputes it:
    its backward follows its forward directly and the step's simulated peak does not rise (module doc)."""
    if program.pipelined or not backward_follows_forward(program.step):
        return None
    graphs = [st.gm for st in program.graphs.distinct()]  # (tp ranks may share one)
    names = layers(graphs[0])
    if not names or modes.get(names[-1], "none") == "none":
        return None
    last = names[-1]
    grads = [s.kind is SlotKind.PARAM and s.name in program.trainable for s in program.captured.slots]
    loss = len(program.captured.mutated_buffers)
    sizes = dict(program.plan.mesh.axes)
    variants = (modes, {**modes, last: "none"})
    peaks = []
    with log_pass(f"recompute: peak with and without {last} recomputed (simulated)") as info:
        for gm in graphs:
            try:
                peaks.append([simulated_peak(recompute(gm, lambda la: v.get(la, "none")).gm, grads, loss, sizes)
                              for v in variants])
            except Exception as e:  # an operator fake tensors cannot run: no proof, so recompute as asked
                info["detail"] = f"not simulated ({type(e).__name__}: {e})"
                return None
        info["detail"] = ", ".join(f"{r:,} bytes recomputed, {k:,} kept" for r, k in peaks)
    if any(k > r for r, k in peaks):
        return None
    return last, (f"its backward runs right after its forward, so its activations are kept: the step's peak stays "
                  f"at {max(r for r, _ in peaks) / 2**20:.1f} MiB of activations and gradients (simulated)")


def apply_recompute(program: Program, options: Options) -> Program:
    """``program`` with the layers ``options.recompute`` chooses recomputed on every rank, and the plan's record."""
    if options.recompute == "none":
        return program
    modes = layer_modes(program.captured.gm, options.recompute)
    if all(mode == "none" for mode in modes.values()):
        return program
    lazy = program.graphs.per_group  # ZeRO-3's groups have graphs of their own, made when first asked for
    kept = None if lazy else kept_last_layer(program, modes)
    if kept is not None:
        modes = {**modes, kept[0]: "none"}
    stages = tuple((st.index, tuple(layers(st.gm))) for st in program.pipeline_stages)
    rewrite = _Rewrite(modes, lazy=lazy)
    if kept is not None:
        rewrite.skipped[kept[0]] = kept[1]
    program.graphs.rewrite(lambda st: dataclasses.replace(st, gm=rewrite(st.gm)))
    applied = tuple((layer, "none" if layer in rewrite.skipped else mode) for layer, mode in modes.items())
    program.plan.recompute = RecomputePlan(applied, stages, tuple(rewrite.skipped.items()))
    program.plan.collectives += recomputed_exchanges(program.plan, {la for la, mode in applied if mode != "none"})
    return program
