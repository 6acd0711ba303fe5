"""Tensor parallelism's collectives inside compiled regions, as torch's functional collectives.

A compiled region (``autopar/core/inductor.py``) may hold the collectives of ``FUNCTIONAL``: tp's all-reduce of
partial sums (``all_reduce``), the identity whose backward all-reduces (``grad_all_reduce``), and sequence
parallelism's reduce-scatter and plain all-gather. AOTAutograd traces them with their autograd formulas;
``decompositions(groups)`` then writes each one, forward's and backward's, as ``_c10d_functional`` ops followed
by ``wait_tensor`` on the axis's process group, so that inductor sees asynchronous collectives it may schedule
compute around: an all-reduce as ``all_reduce``, an all-gather as ``all_gather_into_tensor`` (along dim 0, then
the pieces laid along the gathered dim), a reduce-scatter as ``reduce_scatter_tensor`` or, on gloo, as the
all-reduce and local chunk the eager op runs there, and the local ``chunk`` and ``grad_all_reduce``'s forward
as the copies they are. A compiled function holds its groups' names, sizes and this rank's index in each: the
cache keys it by them (``Group``).

``Tally`` is what a region communicates, read from its graph: the runtime's counts and bytes
(``pm.communication()``) record it at each forward call, and at the backward call for what backward sends, as the
eager ops record their own.

Invariant: each functional collective runs the backend's collective on the tensor the ``autopar::*`` op runs it
on (the same sums, bit for bit); every rank of a group compiles the same region, so its collectives are issued in
the same order on each.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from autopar.core import collectives as _ops  # noqa: F401  (declares the autopar::* collectives)
from autopar.core.collectives import Binding

autopar = torch.ops.autopar
c10d = torch.ops._c10d_functional
# op -> what it records: (the collective, forward or backward, the bytes of its input or of its output)
FUNCTIONAL: dict[torch._ops.OpOverload, tuple[tuple[str, str, str], ...]] = {
    autopar.all_reduce.default: (("all_reduce", "forward", "out"),),
    autopar.grad_all_reduce.default: (("all_reduce", "backward", "out"),),
    autopar.reduce_scatter.default: (("reduce_scatter", "forward", "out"), ("all_gather", "backward", "out")),
    autopar.all_gather.default: (("all_gather", "forward", "in"),),
}

# the ops whose decompositions read this rank's index in its group (the rest compile alike on every rank)
BY_INDEX = (autopar.chunk.default, autopar.reduce_scatter.default)


@dataclass(frozen=True)
class Group:
    """What a compiled collective holds of an axis's process group."""

    name: str  # as registered: the functional collectives resolve it when they run
    size: int
    index: int  # this rank's
    gloo: bool


def axes(gm: fx.GraphModule) -> tuple[str, ...]:
    """The mesh axes the collectives of ``gm`` run on, in order of first use."""
    return tuple(dict.fromkeys(n.args[1] for n in gm.graph.nodes if n.target in FUNCTIONAL))


def groups(binding: Binding, on: tuple[str, ...]) -> tuple[Group, ...]:
    """The process groups of axes ``on``, as a compiled function holds them."""
    found = []
    for axis in on:
        g = binding.group(axis)
        found.append(Group(g.group_name, dist.get_world_size(g), dist.get_rank(g), dist.get_backend(g) == "gloo"))
    return tuple(found)


def decompositions(of: dict[str, Group]) -> dict[torch._ops.OpOverload, Callable]:
    """The decompositions that write the ops of ``FUNCTIONAL`` (and the local ``chunk`` of an all-gather's
    backward) as functional collectives on the groups ``of`` each axis."""
    def all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
        return c10d.wait_tensor(c10d.all_reduce(x.contiguous(), "sum", of[axis].name))

    def all_gather(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
        g = of[axis]
        out = c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), g.size, g.name))
        return out if dim == 0 else torch.cat(out.chunk(g.size, 0), dim)

    def chunk(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
        return x.chunk(of[axis].size, dim)[of[axis].index].contiguous()

    def reduce_scatter(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
        g = of[axis]
        if g.gloo:  # (as the eager op: gloo has no reduce-scatter)
            return chunk(all_reduce(x, axis), axis, dim)
        stacked = x if dim == 0 else torch.cat(x.chunk(g.size, dim), 0)  # piece i along dim -> along dim 0
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(stacked.contiguous(), "sum", g.size, g.name))

    return {autopar.all_reduce.default: all_reduce, autopar.grad_all_reduce.default: lambda x, axis: x.clone(),
            autopar.all_gather.default: all_gather, autopar.chunk.default: chunk,
            autopar.reduce_scatter.default: reduce_scatter}


@dataclass(frozen=True)
class Tally:
    """What a region communicates per call: (op, axis, bytes) of forward's collectives and of backward's."""

    forward: tuple[tuple[str, str, int], ...] = ()
    backward: tuple[tuple[str, str, int], ...] = ()

    @staticmethod
    def of(gm: fx.GraphModule) -> Tally:
        rows: dict[str, list[tuple[str, str, int]]] = {"forward": [], "backward": []}
        for node in gm.graph.nodes:
            for op, when, which in FUNCTIONAL.get(node.target, ()):
                val = node.meta["val"] if which == "out" else node.args[0].meta["val"]
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
