"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): written sharded, committed atomically, loaded on any mesh.

A checkpoint folder holds complete versions (``ckpt-<time>-<id>/``, each a DCP
checkpoint) and a ``LATEST`` file naming the newest complete one. ``save``
writes a new version, waits for every rank, then rank 0 replaces ``LATEST``
atomically (write, fsync, ``os.replace``) and only then deletes older versions.
Invariant: ``LATEST`` always names a version every rank finished writing, so a
save killed at any point leaves the previous checkpoint loadable.

What is saved does not depend on the mesh: every parameter and buffer under
``model/<name>`` (the model's own key, tied aliases once) at its full logical
shape and in the model's element order; every per-element optimizer state of
a parameter (Adam's ``exp_avg``, SGD's ``momentum_buffer``) the same way under
``optim/<name>/<key>``; per parameter, an object ``optim/<name>`` with its
optimizer group's settings (the LR after a scheduler included) and its scalar
state (Adam's ``step``); ``meta/format`` and the caller's ``extra``. Each rank
writes only the boxes of those tensors that it stores and is the writer of
(``runtime/reshard.py``: tp shards, ZeRO flat shards, fused layouts), so no rank
ever gathers a full tensor; replicas (dp without ZeRO) write identical boxes
that DCP's planner writes once.

``load`` checks, on every rank and before any data moves, that the checkpoint
holds this model (the same keys, shapes and dtypes) and names the first key
that differs; then each rank reads exactly the boxes its own layout needs,
whatever mesh and ZeRO stage wrote them. A rank's ``RankState`` (built by
``autopar/rank/state.py``) says what it stores.
"""
from __future__ import annotations

import os
import pickle
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from autopar.runtime.checkpoint_optim import optimizer_items, optimizer_targets, restore_optimizer
from autopar.runtime.reshard import Entry, LoadPlanner, SavePlanner

if TYPE_CHECKING:
    from autopar.runtime.rank import RankRuntime

LATEST = "LATEST"
PREFIX = "ckpt-"
FORMAT = 2  # 1: per-mesh keys (before checkpoints resharded); 2: logical keys, resharded at load


@dataclass(frozen=True)
class RankState:
    """What one rank stores, and what every checkpoint of this model holds (the same on every rank)."""

    entries: tuple[Entry, ...]  # the tensors this rank holds
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]]  # every saved key: logical shape and dtype, model order
    trainable: frozenset[str]  # the keys that have optimizer state
    describe: str  # e.g. "zero=3 on Mesh(dp=2, pp=2)", for messages


def save(root: str, rt: RankRuntime, state: RankState, extra: Any = None) -> str:
    """Writes a new version of this rank's part of the state under ``root`` and commits it; returns its folder."""
    rank = dist.get_rank()
    names = [f"{PREFIX}{int(time.time())}-{uuid.uuid4().hex[:8]}" if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    version = os.path.join(root, names[0])
    items: dict[str, Any] = {f"model/{e.name}": e.pieces(e.tensor.detach()) for e in state.entries if e.writes}
    if rt.optimizer is not None:
        items.update(optimizer_items(rt.optimizer, [e for e in state.entries if e.writes and e.trainable]))
    if rank == 0:
        items["meta/format"] = {"format": FORMAT, "written on": state.describe}
        items["meta/extra"] = pickle.dumps(extra)
    dcp.save(items, checkpoint_id=version, planner=SavePlanner())
    dist.barrier()  # every rank has written its part
    if rank == 0:
        _commit(root, names[0])
    dist.barrier()
    return version


def load(root: str, rt: RankRuntime, state: RankState) -> Any:
    """Loads the version ``root/LATEST`` names into this rank's tensors and optimizer; returns the saved ``extra``."""
    version = latest(root)
    stored = dcp.FileSystemReader(version).read_metadata().state_dict_metadata
    _agree(_mismatch(version, stored, state, with_optimizer=rt.optimizer is not None))
    items: dict[str, Any] = {f"model/{e.name}": e.pieces(e.tensor.detach()) for e in state.entries}
    trainable = [e for e in state.entries if e.trainable]
    tensors = optimizer_targets(rt.optimizer, trainable, stored, items) if rt.optimizer is not None else {}
    items["meta/extra"] = b""
    dcp.load(items, checkpoint_id=version, planner=LoadPlanner())
    problem = None
    if rt.optimizer is not None:
        problem = restore_optimizer(rt.optimizer, trainable, items, tensors)
    _agree(problem)
    if rt.masters is not None:  # mixed precision: the masters were loaded; the stored tensors are their rounding
        rt.masters.round_to_stored()
    if rt.zero is not None and rt.zero.stage < 3:  # stages 1-2 keep full parameters: gather the loaded shards
        for work in [fs.all_gather_in_place() for fs in rt.zero.shards]:
            if work is not None:
                work.wait()
    return pickle.loads(items["meta/extra"])


def latest(root: str) -> str:
    """The folder of the newest complete version in ``root``."""
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no complete checkpoint in {root!r}: {path} is missing (a save writes it last); "
                                f"save one with pm.save({root!r}) first")
    with open(path) as f:
        return os.path.join(root, f.read().strip())


def _commit(root: str, name: str) -> None:
    tmp = os.path.join(root, f"{LATEST}.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    for other in os.listdir(root):  # older versions, and any a killed save left half-written
        if other.startswith(PREFIX) and other != name:
            shutil.rmtree(os.path.join(root, other), ignore_errors=True)


def _agree(problem: str | None) -> None:
    """Raises the same error on every rank when any rank found a problem (so no rank waits in a collective)."""
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, problem)
    for rank, text in enumerate(found):
        if text is not None:
            raise ValueError(text if text == problem else f"rank {rank}: {text}")


def _mismatch(version: str, stored: dict[str, Any], state: RankState, *, with_optimizer: bool) -> str | None:
    """Why the checkpoint does not fit this model (the first differing key, with its shapes), or None."""
    if "meta/format" not in stored:
        return (f"the checkpoint {version} was written in an older format (tensors keyed per mesh) that "
                "cannot be resharded; resume it on the mesh that wrote it with the autopar version that wrote "
                "it, or move the state with pm.state_dict() / pm.load_state_dict()")
    problems = _model_problems(stored, state)
    if not problems and with_optimizer and any(k.startswith("optim/") for k in stored):
        problems = _optimizer_problems(stored, state)
    if not problems:
        return None
    n = len(problems) - 1
    more = f" ({n} more {'key differs' if n == 1 else 'keys differ'})" if n else ""
    return (f"the checkpoint {version} does not match this model: {problems[0]}{more}; load a checkpoint "
            "written by this model (same architecture, sizes and dtypes)")


def _model_problems(stored: dict[str, Any], state: RankState) -> list[str]:
    problems = []
    for name, (shape, dtype) in state.expected.items():
        md = stored.get(f"model/{name}")
        if not isinstance(md, TensorStorageMetadata):
            problems.append(f"{name!r} (shape {tuple(shape)}) is not in the checkpoint")
        elif tuple(md.size) != tuple(shape):
            problems.append(f"{name!r} has shape {tuple(md.size)} in the checkpoint and {tuple(shape)} in this model")
        elif md.properties.dtype != dtype:
            problems.append(f"{name!r} is {md.properties.dtype} in the checkpoint and {dtype} in this model")
    for key, md in stored.items():
        name = key.removeprefix("model/")
        if key.startswith("model/") and name not in state.expected:
            problems.append(f"the checkpoint holds {name!r} (shape {tuple(md.size)}), which this model does not have")
    return problems


def _optimizer_problems(stored: dict[str, Any], state: RankState) -> list[str]:
    problems = [f"the checkpoint has no optimizer state for {name!r}, which this model trains"
                for name in state.expected if name in state.trainable and f"optim/{name}" not in stored]
    for key in stored:
        name = key.removeprefix("optim/")
        if key.startswith("optim/") and "/" not in name and name not in state.trainable:
            problems.append(f"the checkpoint has optimizer state for {name!r}, which this model does not train")
    return problems
