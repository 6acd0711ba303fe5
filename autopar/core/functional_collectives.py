"""Tensor parallelism's collectives inside compiled regions, as torch's functional collectives.

A compiled region (``autopar/core/inductor.py``) may hold the collectives of ``FUNCTIONAL``: tp's all-reduce of
partial sums (``all_reduce``) and the identity whose backward all-reduces (``grad_all_reduce``). AOTAutograd
traces them with their autograd formulas; ``decompositions(groups)`` then writes each all-reduce, forward's and
backward's, as ``_c10d_functional.all_reduce`` followed by ``wait_tensor`` on the axis's process group, so that
inductor sees an asynchronous collective it may schedule compute around, and ``grad_all_reduce``'s forward as the
copy it is. The process groups are named at compile time: a compiled function holds them, and the cache keys it
by their names (``group_names``).

``Tally`` is what a region communicates, read from its graph: the runtime's counts and bytes
(``pm.communication()``) record it at each forward call, and at the backward call for what backward sends, as the
eager ops record their own.

Invariant: the functional all-reduce runs the backend's all-reduce on the same tensor as ``autopar::all_reduce``
(the same sum, bit for bit); every rank of a group compiles the same region, so its collectives are issued in the
same order on each.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from autopar.core import collectives as _ops  # noqa: F401  (declares the autopar::* collectives)
from autopar.core.collectives import Binding

autopar = torch.ops.autopar
c10d = torch.ops._c10d_functional
# op -> (what it records, in forward or backward)
FUNCTIONAL = {
    autopar.all_reduce.default: ("all_reduce", "forward"),
    autopar.grad_all_reduce.default: ("all_reduce", "backward"),
}


def axes(gm: fx.GraphModule) -> tuple[str, ...]:
    """The mesh axes the collectives of ``gm`` run on, in order of first use."""
    return tuple(dict.fromkeys(n.args[1] for n in gm.graph.nodes if n.target in FUNCTIONAL))


def group_names(binding: Binding, on: tuple[str, ...]) -> tuple[str, ...]:
    """The registered names of the process groups of axes ``on`` (what a compiled function holds)."""
    return tuple(binding.group(axis).group_name for axis in on)


def decompositions(names: dict[str, str]) -> dict[torch._ops.OpOverload, Callable]:
    """The decompositions that write ``FUNCTIONAL``'s ops as functional collectives on the groups ``names``
    (axis -> process group name)."""
    def all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
        return c10d.wait_tensor(c10d.all_reduce(x.contiguous(), "sum", names[axis]))

    return {autopar.all_reduce.default: all_reduce,
            autopar.grad_all_reduce.default: lambda x, axis: x.clone()}


@dataclass(frozen=True)
class Tally:
    """What a region communicates per call: (op, axis, bytes) of forward's collectives and of backward's."""

    forward: tuple[tuple[str, str, int], ...] = ()
    backward: tuple[tuple[str, str, int], ...] = ()

    @staticmethod
    def of(gm: fx.GraphModule) -> Tally:
        rows: dict[str, list[tuple[str, str, int]]] = {"forward": [], "backward": []}
        for node in gm.graph.nodes:
            if node.target in FUNCTIONAL:
                op, when = FUNCTIONAL[node.target]
                val = node.meta["val"]
                rows[when].append((op, node.args[1], val.numel() * val.element_size()))
        return Tally(tuple(rows["forward"]), tuple(rows["backward"]))

    def record(self, binding: Binding | None, when: str) -> None:
        if binding is None:
            return
        for op, axis, size in getattr(self, when):
            binding.counts[(op, axis)] += 1
            binding.bytes[(op, axis)] += size

    def record_backward_with(self, outputs: object, binding: Binding | None) -> None:
        """Records backward's collectives when the first gradient of ``outputs`` (a region call's) arrives,
        which is when the region's backward runs."""
        if not self.backward or binding is None:
            return
        grads = [t for t in (outputs if isinstance(outputs, (tuple, list)) else [outputs])
                 if isinstance(t, torch.Tensor) and t.requires_grad]
        if not grads:
            return
        done = [False]

        def hook(_grad: torch.Tensor) -> None:
            if not done[0]:
                done[0] = True
                self.record(binding, "backward")

        for t in grads:
            t.register_hook(hook)
