"""Dropout on a cp rank's tokens that drops what one device drops: the rows of the whole sequence's mask.

A cp rank holds a balanced pair of chunks of each sequence (``ring_attention.positions``). Dropout drawn on the
rank's own ``(..., local, ...)`` value would take numbers no device draws for those tokens. ``cp_dropout``
draws the noise of the whole sequence instead, ``empty(whole).bernoulli_(1 - p).div_(1 - p)`` as
``aten.dropout`` does on one device, and keeps the rows at the rank's global positions. Every cp rank draws
the same numbers: the runtime seeds the ranks of a cp group alike (``rank_runtime.seed_rng``), so together
they drop exactly what one device seeded alike drops. The kept rows are the op's second output, which
backward multiplies the gradient by; a recomputed region draws them again from the same generator state.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from autopar.core.collectives import axis_index, current
from autopar.core.ring_attention import positions


@torch.library.custom_op("autopar::cp_dropout", mutates_args=())
def cp_dropout(x: torch.Tensor, p: float, dim: int, axis: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x`` times this rank's rows along ``dim`` of the whole sequence's dropout noise, those rows)."""
    cp = dist.get_world_size(current().group(axis))
    shape = list(x.shape)
    local = shape[dim]
    shape[dim] = local * cp
    noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p).div_(1 - p)
    rows = noise.index_select(dim, positions(local, cp, axis_index(axis), x.device))
    return x * rows, rows


cp_dropout.register_fake(lambda x, p, dim, axis: (torch.empty_like(x), torch.empty_like(x)))


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(output[1])


def _backward(ctx: Any, dout: torch.Tensor, _drows: torch.Tensor | None) -> tuple:
    (rows,) = ctx.saved_tensors
    return dout * rows, None, None, None


cp_dropout.register_autograd(_backward, setup_context=_setup)
