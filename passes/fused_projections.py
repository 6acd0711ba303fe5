"""Fused projections (GPT-2's ``c_attn``: one matmul producing q|k|v, then a split) made shardable.

A column-parallel shard of a fused weight would give rank 0 all of q and half
of k. This pass re-parameterizes such a weight for a tp axis of ``n``: it is
stored with its output columns ordered (rank, block, column) instead of
(block, rank, column), and the split is rewritten as a view to
``(..., n, blocks, H/n)`` and a ``select`` (then ``reshape``) per block. The rewritten graph computes
exactly what the original computes when given the re-ordered parameter, and a
plain ``Shard`` of the stored parameter hands each rank the q, k and v columns
of its own heads, so the solver finds the Megatron plan for it.

``to_storage`` / ``from_storage`` convert between the model's layout and the
stored one; the runtime applies them when it shards and when it gathers.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.capture import Captured

aten = torch.ops.aten
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


@dataclass(frozen=True)
class Interleave:
    """Dim ``dim`` holds ``blocks`` equal blocks, stored interleaved for ``n`` ranks."""

    dim: int
    blocks: int
    n: int


def to_storage(t: torch.Tensor, lay: Interleave) -> torch.Tensor:
    """(block, rank, column) order along ``lay.dim`` -> (rank, block, column)."""
    shape, d = t.shape, lay.dim
    h = shape[d] // lay.blocks
    return t.reshape(*shape[:d], lay.blocks, lay.n, h // lay.n, *shape[d + 1:]).transpose(d, d + 1).reshape(shape)


def from_storage(t: torch.Tensor, lay: Interleave) -> torch.Tensor:
    shape, d = t.shape, lay.dim
    h = shape[d] // lay.blocks
    return t.reshape(*shape[:d], lay.n, lay.blocks, h // lay.n, *shape[d + 1:]).transpose(d, d + 1).reshape(shape)


def _meta(shape: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=like.dtype, device="meta")


def interleave_fused_projections(cap: Captured, n: int) -> dict[str, Interleave]:
    """Rewrites every fused projection + split in ``cap.gm`` in place; the parameters to store interleaved."""
    slot_of = dict(zip([nd for nd in cap.gm.graph.nodes if nd.op == "placeholder"], cap.slots))
    layouts: dict[str, Interleave] = {}
    for split in [nd for nd in cap.gm.graph.nodes if nd.target == aten.split.Tensor]:
        found = _fused(split, slot_of, n)
        if found is None:
            continue
        params, blocks, size = found
        y = split.args[0]
        shape = list(y.meta["val"].shape)
        graph = cap.gm.graph
        with graph.inserting_after(split):
            y5 = graph.call_function(aten.view.default, (y, shape[:-1] + [n, blocks, size // n]))
        y5.meta = {**split.meta, "val": _meta(shape[:-1] + [n, blocks, size // n], y.meta["val"])}
        for user in list(split.users):
            with graph.inserting_before(user):
                part = graph.call_function(aten.select.int, (y5, len(shape), user.args[1]))  # the block dim
                part.meta = {**split.meta, "val": _meta(shape[:-1] + [n, size // n], y.meta["val"])}
                merged = graph.call_function(aten.reshape.default, (part, shape[:-1] + [size]))
                merged.meta = {**split.meta, "val": _meta(shape[:-1] + [size], y.meta["val"])}
            user.replace_all_uses_with(merged)
            graph.erase_node(user)
        graph.erase_node(split)
        for name, dim in params:
            layouts[name] = Interleave(dim, blocks, n)
    cap.gm.recompile()
    return layouts


def _fused(split: fx.Node, slot_of: dict, n: int) -> tuple[list[tuple[str, int]], int, int] | None:
    """(parameters and their output dim, blocks, block size) when ``split`` splits a projection's output."""
    src, size, dim = split.args[0], split.args[1], split.args[2] if len(split.args) > 2 else 0
    val = src.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(size, int) or dim % val.dim() != val.dim() - 1:
        return None
    blocks = val.shape[-1] // size
    if blocks < 2 or blocks * size != val.shape[-1] or size % n or len(src.users) != 1:
        return None
    if not all(u.target is operator.getitem for u in split.users):
        return None
    proj = src.args[0] if src.target in VIEWS else src
    if src.target in VIEWS and len(proj.users) != 1:
        return None
    if proj.target == aten.addmm.default:
        pairs = [(proj.args[2], 1), (proj.args[0], 0)]  # (in, out) weight, bias
    elif proj.target == aten.linear.default:
        pairs = [(proj.args[1], 0)] + ([(proj.args[2], 0)] if len(proj.args) > 2 and proj.args[2] is not None else [])
    else:
        return None
    params = []
    for node, d in pairs:
        slot = slot_of.get(node)
        if slot is None or slot.kind != "param" or len(node.users) != 1:
            return None
        params.append((slot.name, d))
    return params, blocks, size
