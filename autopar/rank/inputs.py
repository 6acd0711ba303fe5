"""What a rank feeds its program at each step: its microbatches as flat graph inputs, with the loss's counts.

``batch="global"`` (the default): every rank passes the same global batch; dp
rank i takes slice i of dim 0 and splits it into microbatches; under context
parallelism cp rank j then takes its pair of chunks of every sequence (dim 1). Every rank sees
every part, so it counts the loss's items over the whole batch by itself.

``batch="local"``: each rank passes its data-parallel shard, as DDP, FSDP2,
torchtitan and DeepSpeed users feed a job (``DistributedSampler(num_replicas=
pm.dp_size, rank=pm.dp_rank)``): the tp ranks of one replica pass the same
shard, and a pipeline rank whose stages read no input (``pm.reads_batch`` is
False) may pass nothing. The promise is training on the concatenation of the
shards in dp order. Shards must have one shape on every rank: each step
compares a digest of the shapes over the world, and a mismatch is an error on
every rank naming each rank's shapes. The loss's counts are summed over the
ranks' parts with an all-reduce over dp on the ranks that compute the loss.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from autopar.core.graph import SlotKind
from autopar.core.mesh import Mesh
from autopar.compiler.program import Program
from autopar.runtime.batch import cp_shard, shift_left, signature, split_batch
from autopar.runtime.rank import RankRuntime

MODES = ("global", "local")


def split_parts(tree: Any, mesh: Mesh, microbatches: int, mode: str) -> list[Any]:
    """A global batch in ``dp * microbatches`` parts (dp rank-major), or a local one in ``microbatches``."""
    dp = mesh.dp if mode == "global" else 1
    return split_batch(tree, dp * microbatches, dp=dp, microbatches=microbatches)


def is_empty(batch: Any) -> bool:
    """Nothing passed: no tensor anywhere in ``batch``."""
    return not any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(batch))


def reads_batch(program: Program, rank: int) -> bool:
    """Whether a stage ``rank`` computes reads a user input or the target (its rank must pass its batch)."""
    return any(s.kind is SlotKind.INPUT for st in program.own_stages(rank) for s in st.slots)


def rank_inputs(program: Program, batch: Any, rt: RankRuntime, mesh: Mesh, microbatches: int,
                mode: str) -> list[list]:
    """This rank's microbatches of ``batch`` as flat graph inputs on its device, each followed by the loss's
    counts over the whole batch (``autopar/core/loss_count.py``) where the loss has them."""
    if mode == "local":
        _check_same_shapes(None if is_empty(batch) else signature(batch), rt)
        if is_empty(batch):
            return [[] for _ in range(microbatches)]
    batch = pytree.tree_map(lambda x: x.to(rt.groups.device) if isinstance(x, torch.Tensor) else x, batch)
    trees = split_parts(batch, mesh, microbatches, mode)
    parts = [pytree.tree_leaves(p) for p in trees]
    counts = program.captured.counts
    extra = []
    if counts is not None and mode == "global":  # counted on whole sequences, each cp rank's loss a 1/cp part
        extra = [c / mesh.cp for c in counts.inputs(parts, rt.groups.device)]
    elif counts is not None and _computes_loss(program, rt):
        total = sum(counts.count(flat) for flat in parts)
        if rt.groups["dp"] is not None:
            dist.all_reduce(total, group=rt.groups["dp"])
        extra = counts.per_part(total, mesh.dp * microbatches)
    if mesh.cp > 1:  # this cp rank's chunks of every sequence, labels shifted on the whole sequence first
        parts = [cp_shard(shift_left(flat, program.cp_shifted), mesh.cp, rt.groups.coords.cp) for flat in parts]
    mine = parts if mode == "local" else parts[rt.groups.coords.dp * microbatches:][:microbatches]
    return [[*flat, *extra] for flat in mine]


def _computes_loss(program: Program, rt: RankRuntime) -> bool:
    if program.schedule is None:
        return True
    last = program.schedule.n_stages - 1
    return program.schedule.stage_to_rank[last] == rt.groups.coords.pp


def _check_same_shapes(sig: tuple | None, rt: RankRuntime) -> None:
    """Every rank that passes a batch passes one of the same shapes; else an error on every rank."""
    if dist.get_world_size() == 1:
        return
    digest = int.from_bytes(hashlib.sha256(repr(sig).encode()).digest()[:7], "little") if sig is not None else -1
    mine = torch.tensor([digest], dtype=torch.int64, device=rt.groups.device)
    digests = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(digests, mine)
    passed = {int(d) for d in digests} - {-1}
    if len(passed) <= 1:
        return
    sigs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(sigs, sig)
    shapes = "; ".join(f"rank {r}: {_shapes(s)}" for r, s in enumerate(sigs) if s is not None)
    raise ValueError(f"batch='local': ranks pass local batches of different shapes ({shapes}); every data-parallel "
                     f"rank must pass a shard of one shape (a DistributedSampler with drop_last=True, or pad the "
                     f"last batch)")


def _shapes(sig: tuple) -> str:
    return ", ".join(str(list(x[0])) for x in sig[1:] if isinstance(x, tuple) and x and x[0] != "v")
