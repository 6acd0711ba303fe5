"""Activation recomputation on a compiled program: every rank's graphs (or pipeline stages) rewritten, the plan told.

It runs after every other pass (tensor parallelism, pipeline cuts, ZeRO-3's
gathers), so that each region holds its layer's operators as the rank runs
them: its tp collectives (kept, never run again) and its ZeRO-3 all-gather
(run again in backward). Under ZeRO-3 each dp group's graphs are rewritten when
first asked for, as ``zero_compile`` makes them.

Invariant: a rank's rewritten graphs compute what its graphs computed, value
for value (``passes.recompute``); the layers and modes in ``plan.recompute``
are those its graphs run with.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch.fx as fx

from autopar.core.plan import RecomputePlan
from autopar.core.recompute import mode_of, unmatched_keys
from autopar.options import Options
from autopar.passes.recompute import layers, recompute
from autopar.zero_compile import PerDpGroup


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


def apply_recompute(program: Any, options: Options) -> Any:
    """``program`` with the layers ``options.recompute`` chooses recomputed on every rank, and the plan's record."""
    if options.recompute == "none":
        return program
    modes = layer_modes(program.captured.gm, options.recompute)
    if all(mode == "none" for mode in modes.values()):
        return program
    mesh = program.plan.mesh
    stages = tuple((st.index, tuple(layers(st.gm))) for st in program.stages) if program.stages is not None else ()
    rewrite = _Rewrite(modes, lazy=isinstance(program.graphs, PerDpGroup))
    if program.rank_stages is not None:  # ZeRO-3 with a pipeline: each dp group's own stages
        zero_stages = program.rank_stages

        def stages_of(ranks: list[int]) -> list:
            mine = program.schedule.stages_of(mesh.coords(ranks[0])["pp"])
            return [dataclasses.replace(st, gm=rewrite(st.gm)) if st.index in mine else st
                    for st in zero_stages[ranks[0]]]

        program.rank_stages = PerDpGroup(mesh, stages_of)
        program.graphs = PerDpGroup(mesh, lambda ranks: program.rank_stages[ranks[0]][mesh.coords(ranks[0])["pp"]].gm)
    elif isinstance(program.graphs, PerDpGroup):  # ZeRO-3
        zero_graphs = program.graphs
        program.graphs = PerDpGroup(mesh, lambda ranks: rewrite(zero_graphs[ranks[0]]))
    elif program.stages is not None:
        program.stage_sets = [[dataclasses.replace(st, gm=rewrite(st.gm)) for st in stages]
                              for stages in program.stage_sets]
        program.stages = program.stage_sets[0]
        program.graphs = {r: program.stage_sets[mesh.coords(r)["tp"]][mesh.coords(r)["pp"]].gm
                          for r in range(mesh.size)}
    else:
        program.graphs = {r: rewrite(gm) for r, gm in program.graphs.items()}
    applied = tuple((layer, "none" if layer in rewrite.skipped else mode) for layer, mode in modes.items())
    program.plan.recompute = RecomputePlan(applied, stages, tuple(rewrite.skipped.items()))
    return program
