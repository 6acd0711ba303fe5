"""ZeRO's flat layout of one rank's parameters over the dp axis.

The layout (``zero_layout``) is a pure function of the rank's trainable
parameters (names, local shapes, dtypes), the stage and the dp size, so the
compiler (``passes.zero_graphs``) and every rank's runtime (``runtime.zero``) compute
the same one. Each ``FlatGroup`` lays its parameters end to end, padded to a
multiple of the dp size ``n``; dp rank ``i`` owns elements
``[i * shard, (i + 1) * shard)``. Stages 1 and 2 group by gradient bucket
(reverse parameter order, as backward produces gradients; a small first bucket,
then ``bucket_bytes``, as ``core.buckets`` cuts them); stage 3 groups by layer
(the path up to the first list index, ``transformer.h.3``), so one all-gather
fetches one layer.

Under expert parallelism the routed experts' parameters (``routed``) are laid out
in groups of their own, over the ``ep_replicate`` sub-axis (``ep_shard`` under hybrid sharding; ``routed_n`` ranks
hold the same experts) instead of dp: such a group's ``axis`` names it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

import torch

from autopar.core.buckets import assign_buckets

STAGES = (1, 2, 3)


@dataclass(frozen=True)
class FlatGroup:
    """Parameters laid end to end in one flat buffer, padded to a multiple of ``n`` and split into ``n`` shards."""

    name: str
    params: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    n: int
    axis: str = ""  # the mesh axis its shards span ("": the layout's ZeRO axis; else routed experts': ep_replicate
    # or, under hybrid sharding, ep_shard)

    @cached_property
    def numels(self) -> tuple[int, ...]:
        out = []
        for shape in self.shapes:
            size = 1
            for s in shape:
                size *= s
            out.append(size)
        return tuple(out)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out, at = [], 0
        for numel in self.numels:
            out.append(at)
            at += numel
        return tuple(out)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def padded(self) -> int:
        return -(-self.numel // self.n) * self.n

    @property
    def shard(self) -> int:
        return self.padded // self.n

    @property
    def nbytes(self) -> int:
        return self.padded * self.dtype.itemsize

    def split_sizes(self) -> list[int]:
        """Sizes that cut the flat buffer into the parameters (and the padding, when there is any)."""
        pad = self.padded - self.numel
        return [*self.numels, pad] if pad else list(self.numels)

    def describe(self) -> dict:
        return {"name": self.name, "params": list(self.params), "shapes": [list(s) for s in self.shapes],
                "dtype": str(self.dtype), "n": self.n,
                **({"axis": self.axis} if self.axis else {})}


@dataclass(frozen=True)
class ZeroLayout:
    """Every flat group of one rank, for one ZeRO stage over ``n`` dp ranks."""

    stage: int
    n: int
    groups: tuple[FlatGroup, ...]

    def describe(self) -> dict:
        return {"stage": self.stage, "n": self.n, "groups": [g.describe() for g in self.groups]}

    def by_axis(self) -> dict[str, ZeroLayout]:
        """The groups of each axis (``""``: the ZeRO axis; another: routed experts') as layouts of their
        own, each with its groups' shard count."""
        out: dict[str, list[FlatGroup]] = {}
        for g in self.groups:
            out.setdefault(g.axis, []).append(g)
        return {axis: ZeroLayout(self.stage, groups[0].n if axis else self.n, tuple(groups))
                for axis, groups in out.items()}

    def largest_gathered(self, prefetch: int) -> int:
        """Stage 3: the most bytes of gathered layers alive at once, ``1 + prefetch`` consecutive layers."""
        sizes = [g.nbytes for g in self.groups]
        width = min(len(sizes), 1 + prefetch)
        return max((sum(sizes[i : i + width]) for i in range(len(sizes) - width + 1)), default=0)


def layer_of(name: str) -> str:
    """The layer a parameter belongs to: its path up to the first list index, else its module's path."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or parts[0]


def zero_layout(params: list[tuple[str, tuple[int, ...], torch.dtype]], *, stage: int, n: int,
                bucket_bytes: int, alone: set[str] | frozenset[str] = frozenset(),
                routed: set[str] | frozenset[str] = frozenset(), routed_n: int = 1,
                routed_axis: str = "ep_replicate") -> ZeroLayout:
    """The flat groups of ``params`` (name, local shape, dtype) for ``stage`` over ``n`` dp ranks.

    Each parameter in ``alone`` gets a group of its own (named after it), ahead of the others. The parameters
    in ``routed`` (routed experts) get groups of their own over ``routed_n`` ranks of ``routed_axis``
    (``ep_replicate``, or ``ep_shard`` under hybrid sharding), after the others (stages 1-2: ``expert_bucket<k>``;
    stage 3: ``<layer>:experts``).
    """
    if stage not in STAGES:
        raise ValueError(f"zero={stage!r}: a layout exists for stages 1, 2 and 3")
    if n < 1:
        raise ValueError(f"dp size {n} must be >= 1")
    if routed:
        dense = zero_layout([p for p in params if p[0] not in routed], stage=stage, n=n, bucket_bytes=bucket_bytes,
                            alone=alone)
        experts = zero_layout([p for p in params if p[0] in routed], stage=stage, n=routed_n,
                              bucket_bytes=bucket_bytes)
        return ZeroLayout(stage, n, dense.groups + tuple(_routed(g, routed_axis) for g in experts.groups))
    groups = [_group(name, [(name, shape)], dtype, n) for name, shape, dtype in params if name in alone]
    params = [p for p in params if p[0] not in alone]
    if stage == 3:
        layers: OrderedDict[tuple[str, torch.dtype], list] = OrderedDict()
        for name, shape, dtype in params:
            layers.setdefault((layer_of(name), dtype), []).append((name, shape))
        dtypes_of: dict[str, int] = {}
        for layer, _ in layers:
            dtypes_of[layer] = dtypes_of.get(layer, 0) + 1
        for (layer, dtype), members in layers.items():
            label = layer if dtypes_of[layer] == 1 else f"{layer}:{str(dtype).removeprefix('torch.')}"
            groups.append(_group(label, members, dtype, n))
        return ZeroLayout(stage, n, tuple(groups))
    order = list(reversed(params))  # backward produces the last parameters' gradients first
    spans = assign_buckets([_numel(shape) * dtype.itemsize for _, shape, dtype in order],
                           [dtype for _, _, dtype in order], bucket_bytes)
    for k, span in enumerate(spans):
        groups.append(_group(f"bucket{k}", [order[i][:2] for i in span], order[span[0]][2], n))
    return ZeroLayout(stage, n, tuple(groups))


def _routed(group: FlatGroup, axis: str) -> FlatGroup:
    """``group`` of routed experts' parameters, named and placed as such (on mesh axis ``axis``)."""
    name = f"expert_{group.name}" if group.name.startswith("bucket") else f"{group.name}:experts"
    return FlatGroup(name, group.params, group.shapes, group.dtype, group.n, axis)


def _group(name: str, members: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, n: int) -> FlatGroup:
    return FlatGroup(name, tuple(m for m, _ in members), tuple(tuple(s) for _, s in members), dtype, n)


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out
