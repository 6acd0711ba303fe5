"""Where the tensor one rank stores lies in the model's tensor: the boxes a resharding checkpoint writes and reads.

A checkpoint keeps every parameter (and its per-element optimizer state) under
the model's own key at its full, *logical* shape, in the model's own element
order, as a set of boxes (``ChunkStorageMetadata``: offsets and sizes) that
``torch.distributed.checkpoint`` (DCP) writes and reads by offset. One rank's
copy of a parameter is described by a ``Geometry``, the composition of three
maps, applied from the inside out:

1. ZeRO (``flat``): the rank owns the elements ``[lo, hi)`` of the flattened
   tensor it stores (the part of its flat group's dp shard that falls on this
   parameter; the group's padding belongs to no parameter). ``flat_boxes`` cuts
   such a range into at most ``2 * ndim - 1`` boxes that are each contiguous in
   the flat shard (a partial row, whole rows, a partial row, recursively), so a
   box is a view of the shard, never a copy.
2. Tensor parallelism (``dim``, ``start``): the stored tensor is the chunk of
   the parameter (in storage order) that starts at ``start`` along ``dim``; a
   box moves by ``start`` along ``dim``.
3. Fused projections (``interleave``): storage order along a dim is
   (rank, block, column), the model's order (block, rank, column)
   (``passes/fused_projections.py``). A run of ``h / n`` storage columns is
   contiguous in the model's order too, so a box is cut at those runs and each
   run moves to its column in the model's layout.

Every resulting box is a view of the stored tensor, so saving writes from it
and loading copies into it in place. Two ranks never write overlapping boxes
(the caller picks one writer among replicas), and DCP checks when it saves
that the boxes of every key tile the whole tensor exactly. At load, DCP
intersects the boxes a rank asks for with the boxes on disk and reads only
those sub-ranges, so any mesh loads a checkpoint written on any other one,
and no rank ever holds more than its own part.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclass(frozen=True)
class Geometry:
    """Where one rank's stored copy of a tensor lies in the logical tensor (see the module docstring)."""

    shape: tuple[int, ...]  # the logical (full) shape
    local: tuple[int, ...]  # the shape of the tensor this rank stores (its tp chunk)
    dim: int | None = None  # the tp Shard dim, None when the rank stores every element
    start: int = 0  # where the stored chunk starts along ``dim`` (storage order)
    interleave: tuple[int, tuple[int, ...], int] | None = None  # (dim, block widths, n): stored (rank, block, column)
    flat: tuple[int, int] | None = None  # ZeRO: only elements [lo, hi) of the flattened stored tensor

    def pieces(self, data: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """``(logical offsets, view of data)`` for every box of this copy; ``data`` is the stored tensor, or
        with ``flat`` a 1-D tensor of its elements ``[lo, hi)``."""
        if self.flat is None:
            boxes = [(data, (0,) * len(self.local))]
        else:
            lo, hi = self.flat
            boxes = [(data[at - lo: at - lo + math.prod(sizes)].view(sizes), offsets)
                     for at, (offsets, sizes) in flat_boxes(lo, hi, self.local)]
        out = []
        for view, offsets in boxes:
            if self.dim is not None:
                offsets = tuple(o + self.start if d == self.dim else o for d, o in enumerate(offsets))
            out += self._unshuffle(view, offsets)
        return out

    def _unshuffle(self, view: torch.Tensor, offsets: tuple[int, ...]) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """A box in storage order cut into runs that are contiguous in the model's order, moved there."""
        if self.interleave is None:
            return [(offsets, view)]
        d, sizes, n = self.interleave
        local = [s // n for s in sizes]  # one rank's columns of each block
        starts = [sum(sizes[:b]) for b in range(len(sizes))]  # each block's first column in the model's order
        out, at, end = [], offsets[d], offsets[d] + view.shape[d]
        while at < end:
            rank, rest = divmod(at, sum(local))
            block = next(b for b in range(len(local)) if rest < sum(local[: b + 1]))
            col = rest - sum(local[:block])
            run = min(local[block] - col, end - at)
            moved = tuple(starts[block] + rank * local[block] + col if i == d else o for i, o in enumerate(offsets))
            out.append((moved, view.narrow(d, at - offsets[d], run)))
            at += run
        return out


def flat_boxes(lo: int, hi: int, shape: tuple[int, ...]) -> list[tuple[int, Box]]:
    """Boxes covering the row-major elements ``[lo, hi)`` of a tensor of ``shape``, each contiguous in memory,
    with the flat index of its first element."""
    if lo >= hi:
        return []
    if not shape:
        return [(0, ((), ()))]
    inner = math.prod(shape[1:])
    first, last = lo // inner, hi // inner  # the rows [lo, hi) starts and ends in
    out = []
    if lo % inner:  # the end of row ``first``
        out += _in_row(first, inner, lo - first * inner, min(hi, (first + 1) * inner) - first * inner, shape)
        first += 1
    if last > first:  # whole rows
        out.append((first * inner, ((first, *[0] * (len(shape) - 1)), (last - first, *shape[1:]))))
    if hi % inner and last >= first:  # the start of row ``last``
        out += _in_row(last, inner, 0, hi - last * inner, shape)
    return out


def _in_row(row: int, inner: int, lo: int, hi: int, shape: tuple[int, ...]) -> list[tuple[int, Box]]:
    """The boxes of elements ``[lo, hi)`` of row ``row`` (``inner`` elements each)."""
    return [(row * inner + at, ((row, *offsets), (1, *sizes)))
            for at, (offsets, sizes) in flat_boxes(lo, hi, shape[1:])]


class Pieces:
    """A tensor of logical ``size`` of which this rank writes, or reads into, the boxes ``parts``.

    DCP's hooks for checkpointable objects (``torch.distributed._checkpointable``): write items and
    chunk lists from the boxes, and the view of a box for DCP to read from or copy into.
    """

    def __init__(self, size: tuple[int, ...], dtype: torch.dtype,
                 parts: list[tuple[tuple[int, ...], torch.Tensor]]) -> None:
        self.shape = torch.Size(size)
        self.dtype = dtype
        self.parts = {tuple(offsets): view for offsets, view in parts}

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, _obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=_chunk(offsets, view),
                                                      properties=TensorProperties(dtype=self.dtype),
                                                      size=self.shape))
                for offsets, view in self.parts.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [_chunk(offsets, view) for offsets, view in self.parts.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.parts[tuple(index.offset)]


def _chunk(offsets: tuple[int, ...], view: torch.Tensor) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=view.shape)


class SavePlanner(DefaultSavePlanner):
    """DCP's planner, taught to find the boxes of ``Pieces`` (flat keys: no nesting to flatten)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's planner, taught to find the boxes of ``Pieces``; loaded objects land in the caller's dict."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        # as DefaultLoadPlanner's, less its pass that would replace objects it does not know (``Pieces``)
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else super().lookup_tensor(index)


@dataclass(frozen=True)
class Entry:
    """One parameter or buffer as this rank stores it."""

    name: str  # the model's (canonical) key
    geometry: Geometry  # where this rank's copy lies in the logical tensor
    tensor: torch.Tensor  # what the rank stores: the parameter or buffer, or under ZeRO its group's flat shard
    window: tuple[int, int] | None = None  # ZeRO: the part of ``tensor`` that holds this parameter's elements
    writes: bool = True  # False on a replica whose elements another rank writes (tp or pp copies)
    trainable: bool = False  # ``tensor`` is a parameter of the optimizer

    def data(self, like: torch.Tensor) -> torch.Tensor:
        """This entry's elements of ``like``, a tensor shaped as ``tensor`` (it, or one of its optimizer states)."""
        return like[self.window[0]: self.window[1]] if self.window is not None else like

    def pieces(self, like: torch.Tensor) -> Pieces:
        """``like``'s part of the logical tensor, as the boxes DCP writes from or reads into (views, no copies)."""
        return Pieces(self.geometry.shape, like.dtype, self.geometry.pieces(self.data(like)))
