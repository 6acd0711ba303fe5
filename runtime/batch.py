"""Splitting the global batch: dp slices, then microbatches, all along dim 0."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree


def batch_size(tree: Any) -> int:
    """Dim 0 of the first tensor with at least one dim; 1 when there is none."""
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    return 1


def split_batch(tree: Any, parts: int, *, dp: int, microbatches: int) -> list[Any]:
    """``tree`` cut into ``parts`` equal pieces along dim 0 of every batched tensor.

    A tensor is batched when its dim 0 equals the batch size; 0-dim tensors and
    tensors whose dim 0 is 1 (broadcast over the batch) go whole to every piece.
    """
    size = batch_size(tree)
    if size % parts:
        hint = f"pass a batch that is a multiple of {parts}"
        good_m = [m for m in range(1, size + 1) if size % (dp * m) == 0]
        if microbatches > 1 and good_m:
            hint += f" or set microbatches to one of {good_m}"
        raise ValueError(
            f"batch {size} does not divide by dp*microbatches = {dp}*{microbatches} = {parts}; {hint}"
        )
    flat, spec = pytree.tree_flatten(tree)
    pieces: list[list[Any]] = [[] for _ in range(parts)]
    for path_i, leaf in enumerate(flat):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == size and size > 1:
            for piece, chunk in zip(pieces, leaf.chunk(parts)):
                piece.append(chunk)
        elif isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] not in (1, size):
            raise ValueError(
                f"input tensor #{path_i} has dim 0 of size {leaf.shape[0]} but the batch is {size}; "
                "every batched input must have the batch along dim 0 (size 1 broadcasts)"
            )
        else:
            for piece in pieces:
                piece.append(leaf)
    return [pytree.tree_unflatten(p, spec) for p in pieces]


def signature(tree: Any) -> tuple:
    """A hashable key of shapes, dtypes and non-tensor values: a new one means a new capture."""
    flat, spec = pytree.tree_flatten(tree)
    return (str(spec), *((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("v", repr(x)) for x in flat))
