"""The programs of one model, by input shapes: compiled once each, all cut and sharded alike.

The first program fixes the pipeline cuts (``split_points``) and the tp
placements of the parameters; every later one (another batch shape, the
forward-only graph) is compiled with them pinned, so the runtime built for the
first keeps holding the right parameters on the right ranks.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.tensor import Placement
from torch.utils import _pytree as pytree

from autopar.core.mesh import Mesh
from autopar.rank.model_storage import full_size_for_capture
from autopar.options import Options
from autopar.compiler.driver import compile_program
from autopar.compiler.program import Program, capture_device
from autopar.rank.inputs import split_parts
from autopar.runtime.batch import signature
from autopar.runtime.rank import RankRuntime


class ProgramCache:
    """Compiles ``model`` for ``mesh`` per global-batch signature; ``last`` is the most recent program."""

    def __init__(self, model: torch.nn.Module, mesh: Mesh, options: Options) -> None:
        self.model = model
        self.mesh = mesh
        self.options = options
        self.programs: dict[tuple, Program] = {}
        self.last: Program | None = None
        self.split_points: list[str] | None = None
        self.placements: dict[str, Placement] | None = None

    def compile(self, batch: tuple[tuple, dict, Any], *, with_loss: bool, rt: RankRuntime | None) -> Program:
        """The program for the global ``batch = (args, kwargs, target)``; with a started runtime ``rt``, the
        capture sees full parameter shapes while the ranks keep their shards."""
        local = self.split(batch)[0]
        key = (with_loss, signature(local))
        if key not in self.programs:
            device = capture_device(self.model)  # the inputs join the parameters there (the ranks' later on)
            local = pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, local)
            full_zero = rt.zero.full_size_parameters() if rt and rt.zero else contextlib.nullcontext()
            with full_zero, full_size_for_capture(self.model, rt.full_shapes if rt else {}):
                self.programs[key] = compile_program(self.model, self.mesh, self.options, local,
                                                     with_loss=with_loss, split_points=self.split_points,
                                                     placements=self.placements)
            self.split_points = self.programs[key].split_points  # every later graph is cut the same way
            self.placements = self.placements or self.programs[key].placements  # ... and sharded the same way
        self.last = self.programs[key]
        return self.last

    def require(self) -> Program:
        """The most recently compiled program; an error naming the fix when there is none."""
        if self.last is None:
            raise RuntimeError(
                "nothing is compiled yet: pass example_inputs=(...) to parallelize, or call pm.step / pm(...) once"
            )
        return self.last

    def split(self, tree: Any) -> list[Any]:
        """``tree`` in its parts along dim 0: a global batch in dp * microbatches (dp rank-major), a local one
        (``batch="local"``) in microbatches."""
        return split_parts(tree, self.mesh, self.options.microbatches, self.options.batch)
