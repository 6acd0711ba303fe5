"""Splitting the global batch: dp slices, then microbatches, all along dim 0; under context parallelism each
piece's sequences (dim 1) in cp ranks' balanced pairs of chunks."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from autopar.core.errors import UnsupportedError
from autopar.core.ring_attention import positions


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
                "every batched input must have the batch along dim 0 (size 1 broadcasts); a tensor that every "
                "sample shares (a table, a codebook) belongs to the model: register it as a buffer"
            )
        else:
            for piece in pieces:
                piece.append(leaf)
    return [pytree.tree_unflatten(p, spec) for p in pieces]


def signature(tree: Any) -> tuple:
    """A hashable key of shapes, dtypes and non-tensor values: a new one means a new capture."""
    flat, spec = pytree.tree_flatten(tree)
    return (str(spec), *((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("v", repr(x)) for x in flat))


# -- context parallelism: every sequence cut into balanced pairs of chunks along dim 1 --------------------------
def sequence_length(tree: Any) -> int | None:
    """Dim 1 of the first tensor with at least two dims (the sequence of (batch, sequence, ...) inputs)."""
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 1:
            return leaf.shape[1]
    return None


def cp_shard(tree: Any, cp: int, index: int) -> Any:
    """What cp rank ``index`` of ``cp`` holds of ``tree``: of each tensor whose dim 1 is the sequence, chunks
    ``index`` and ``2 * cp - 1 - index`` of ``2 * cp`` along dim 1 (``autopar/core/ring_attention.py``)."""
    length = sequence_length(tree)
    if cp == 1 or length is None:
        return tree
    if length % (2 * cp):
        raise UnsupportedError(
            f"sequence length {length} does not divide by 2 x cp = {2 * cp}: context parallelism gives each of "
            f"cp={cp} ranks two of {2 * cp} equal chunks (a head and a tail, to balance causal attention); pad "
            f"the sequences to a multiple of {2 * cp} (e.g. {-(-length // (2 * cp)) * 2 * cp}, labels padded "
            f"with ignore_index) or choose a cp for which 2 x cp divides {length}")
    _check_sequence_in_dim_one(tree, length, cp)
    pos = positions(length // cp, cp, index)

    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 1 and x.shape[1] == length:
            return x.index_select(1, pos.to(x.device))
        return x
    return pytree.tree_map(cut, tree)


def later_sequence_dims(tree: Any, length: int) -> list[tuple[str, tuple[int, ...]]]:
    """(where, shape) of each input of ``tree`` that holds the sequence length in a dim after dim 1 (cp leaves
    those dims whole)."""
    paths, _ = pytree.tree_flatten_with_path(tree)
    return [(pytree.keystr(path), tuple(x.shape)) for path, x in paths
            if isinstance(x, torch.Tensor) and x.dim() > 2 and length in x.shape[2:]]


def _check_sequence_in_dim_one(tree: Any, length: int, cp: int) -> None:
    """Refuses an input that holds the sequence in a later dim but not in dim 1, e.g. a (batch, 1, sequence,
    sequence) attention mask: cp cuts dim 1 only, so it would reach one rank's chunks whole."""
    paths, _ = pytree.tree_flatten_with_path(tree)
    for path, x in paths:
        if isinstance(x, torch.Tensor) and x.dim() > 2 and x.shape[1] != length and length in x.shape[2:]:
            raise UnsupportedError(
                f"the input at {pytree.keystr(path)} of shape {tuple(x.shape)} holds the sequence length {length} in dim "
                f"{list(x.shape).index(length, 2)} but not in dim 1: context parallelism (cp={cp}) cuts every "
                f"input's sequence along dim 1 only, so this input would reach each rank's chunks whole; pass the "
                f"padding as a (batch, sequence) mask and let the model build its (query, key) mask, or put the "
                f"sequence in dim 1")


def shift_left(flat: list[Any], shifted: dict[int, float]) -> list[Any]:
    """``flat`` with each input ``i`` of ``shifted`` moved one place left along dim 1, its last position
    ``shifted[i]`` (a causal LM's labels, shifted on the whole sequence before it is cut)."""
    out = list(flat)
    for i, fill in shifted.items():
        x = out[i]
        out[i] = torch.cat([x[:, 1:], torch.full_like(x[:, :1], fill)], dim=1)
    return out


def cp_unshard(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The whole sequence (dim 1) from each cp rank's pair of chunks, in cp order."""
    cp, local = len(pieces), pieces[0].shape[1]
    out = torch.empty(pieces[0].shape[0], cp * local, *pieces[0].shape[2:], dtype=pieces[0].dtype,
                      device=pieces[0].device)
    for index, piece in enumerate(pieces):
        out[:, positions(local, cp, index).to(out.device)] = piece
    return out
