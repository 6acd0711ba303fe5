"""Where a parameter's elements live: tensor-parallel local shapes and the interleaved storage of fused weights.

``local_shape`` is the shape a tp rank stores for a parameter with a given
placement (``torch.distributed.tensor``'s ``Shard(dim)`` / ``Replicate()``).
A fused projection's weight (q|k|v, gate|up) is stored interleaved
(``Interleave``) so that a plain ``Shard`` hands each rank the blocks of its own
heads; ``to_storage`` / ``from_storage`` convert between the model's layout and
the stored one (``passes.fused_projections`` chooses it, the runtime applies it
when it shards and when it gathers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Shard


def local_shape(shape: tuple[int, ...], placement: Any, n: int, index: int) -> tuple[int, ...]:
    """The shape tp rank ``index`` of ``n`` stores for a parameter of full ``shape`` (as ``model_storage.shard_for_tp`` cuts it)."""
    if not isinstance(placement, Shard) or n == 1:
        return tuple(shape)
    return tuple(torch.empty(shape, device="meta").chunk(n, placement.dim)[index].shape)


@dataclass(frozen=True)
class Interleave:
    """Dim ``dim`` holds blocks of widths ``sizes``, stored interleaved for ``n`` ranks."""

    dim: int
    sizes: tuple[int, ...]
    n: int

    @property
    def blocks(self) -> int:
        return len(self.sizes)


def to_storage(t: torch.Tensor, lay: Interleave) -> torch.Tensor:
    """(block, rank, column) order along ``lay.dim`` -> (rank, block, column)."""
    pieces = [block.chunk(lay.n, lay.dim) for block in t.split(list(lay.sizes), lay.dim)]
    return torch.cat([p[r] for r in range(lay.n) for p in pieces], lay.dim)


def from_storage(t: torch.Tensor, lay: Interleave) -> torch.Tensor:
    """(rank, block, column) order along ``lay.dim`` -> (block, rank, column)."""
    local = [s // lay.n for s in lay.sizes]
    per_rank = [r.split(local, lay.dim) for r in t.chunk(lay.n, lay.dim)]
    return torch.cat([per_rank[r][b] for b in range(lay.blocks) for r in range(lay.n)], lay.dim)
