"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), committed atomically.

A checkpoint folder holds complete versions (``ckpt-<time>-<id>/``, each a DCP
checkpoint) and a ``LATEST`` file naming the newest complete one. ``save``
writes a new version, waits for every rank, then rank 0 replaces ``LATEST``
atomically (write, fsync, ``os.replace``) and only then deletes older versions.
Invariant: ``LATEST`` always names a version every rank finished writing, so a
save killed at any point leaves the previous checkpoint loadable.

What is saved: buffers (and frozen parameters) as replicated tensors; under
ZeRO each flat group's shard as a ``DTensor`` sharded over the dp ranks
(``zero/<group>``), with the optimizer state of that shard beside it
(``optim/<group>/<key>``); without ZeRO the parameters and per-parameter
optimizer state, replicated. The optimizer's param groups (LR after a
scheduler included), the layout and the caller's ``extra`` are saved as
objects. ``load`` refuses a checkpoint written for another mesh or stage and
names the fix (load a full state with ``pm.load_state_dict``).

With pipeline or tensor parallelism (a ``Scope``), each rank saves only the
tensors its stages hold, and every key whose value differs between pp or tp
ranks (tp shards, ZeRO groups, optimizer groups, the layout) carries the
rank's coordinates (``@pp1.tp0``); replicated keys are written once.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

LATEST = "LATEST"
PREFIX = "ckpt-"


@dataclass(frozen=True)
class Scope:
    """What one rank saves: the tensors it holds (None: all), and the keys that differ across pp/tp ranks."""

    where: str = ""  # "@pp<i>.tp<j>" on a mesh with pp or tp, else ""
    held: frozenset[str] | None = None  # names of the parameters and buffers this rank saves
    tp_local: frozenset[str] = frozenset()  # names stored as tp shards: their keys carry ``where``

    def key(self, name: str) -> str:
        return name + self.where if name in self.tp_local else name


def save(root: str, rt: Any, model: torch.nn.Module, extra: Any = None, scope: Scope = Scope()) -> str:
    """Writes a new version of ``rt``'s state under ``root`` and commits it; returns the version's folder."""
    rank = dist.get_rank()
    names = [f"{PREFIX}{int(time.time())}-{uuid.uuid4().hex[:8]}" if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    version = os.path.join(root, names[0])
    state = _state(rt, model, scope)
    state["meta/extra"] = pickle.dumps(extra)
    dcp.save(state, checkpoint_id=version)
    dist.barrier()  # every rank has written its part
    if rank == 0:
        _commit(root, names[0])
    dist.barrier()
    return version


def load(root: str, rt: Any, model: torch.nn.Module, scope: Scope = Scope()) -> Any:
    """Loads the version ``root/LATEST`` names into ``rt`` (same mesh and stage); returns the saved ``extra``."""
    version = latest(root)
    stored = dcp.FileSystemReader(version).read_metadata().state_dict_metadata
    layout_key = "meta/layout" + scope.where
    if layout_key not in stored:  # written on another mesh: report what it was written for
        layout_key = min(key for key in stored if key.startswith("meta/layout"))
    meta = {layout_key: b""}
    dcp.load(meta, checkpoint_id=version)
    found = meta[layout_key]
    want = _layout(rt)
    if found != want:
        raise ValueError(
            f"the checkpoint {version} was written for {_summary(found)}, but this model runs "
            f"{_summary(want)}; resume on the same mesh and zero stage, or load a full state with "
            "pm.load_state_dict(state) (pm.state_dict() of the old job, saved with torch.save)"
        )
    state = _state(rt, model, scope)
    opt_state = _optimizer_template(rt, model, stored, state, scope)
    state["meta/extra"] = b""
    dcp.load(state, checkpoint_id=version)
    _restore_optimizer(rt, model, state, opt_state, scope)
    if rt.zero is not None and rt.zero.stage < 3:
        for work in [fs.all_gather_in_place() for fs in rt.zero.shards]:
            if work is not None:
                work.wait()
    return pickle.loads(state["meta/extra"])


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


def _layout(rt: Any) -> bytes:
    desc = {"mesh": repr(rt.groups.mesh), "zero": rt.zero.stage if rt.zero is not None else 0,
            "layout": rt.zero.layout.describe() if rt.zero is not None else None}
    return json.dumps(desc, sort_keys=True).encode()


def _summary(layout: bytes) -> str:
    try:
        desc = json.loads(layout.decode())
    except ValueError:
        return layout.decode()
    names = [g["name"] for g in (desc.get("layout") or {}).get("groups", [])]
    text = f"zero={desc.get('zero')} on {desc.get('mesh')}"
    if names:
        text += f" in {len(names)} flat groups ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
    return text


def _owners(rt: Any, model: torch.nn.Module, scope: Scope) -> list[tuple[str, torch.Tensor]]:
    """The optimizer's parameters in its own order, each with a stable name (its flat group, or its parameter)."""
    if rt.zero is not None:
        by_id = {id(fs.shard): fs.spec.name + scope.where for fs in rt.zero.shards}
    else:
        by_id = {id(p): scope.key(n) for n, p in model.named_parameters()}
    return [(by_id[id(p)], p) for g in rt.optimizer.param_groups for p in g["params"]]


def _padded(rt: Any, p: torch.Tensor) -> int | None:
    """The global length of a flat group whose shard is ``p`` (None without ZeRO)."""
    return p._zero.spec.padded if rt.zero is not None else None


def _dp_mesh(rt: Any) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(rt.groups["dp"], rt.groups.device.type, mesh_dim_names=("dp",))


def _sharded(local: torch.Tensor, padded: int, mesh: Any) -> Any:
    """``local`` (this rank's slice) as a DTensor of global shape ``(padded,)`` sharded over dp."""
    if mesh is None:
        return local
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(padded,), stride=(1,))


def _state(rt: Any, model: torch.nn.Module, scope: Scope) -> dict[str, Any]:
    """The model's part of the checkpoint, aliasing the live tensors (so DCP loads in place)."""
    state: dict[str, Any] = {"meta/layout" + scope.where: _layout(rt)}
    zero = rt.zero
    sharded = {n for fs in zero.shards for n in fs.spec.params} if zero is not None else set()
    aliases = _aliases(model)
    for name, t in model.state_dict(keep_vars=True).items():
        canonical = aliases.get(name, name)
        if canonical in sharded or (scope.held is not None and canonical not in scope.held):
            continue  # a tied alias of a sharded parameter is saved once, in its flat group
        state[f"model/{scope.key(canonical)}"] = t.detach()
    if zero is not None:
        mesh = _dp_mesh(rt) if rt.groups["dp"] is not None else None
        for fs in zero.shards:
            state[f"zero/{fs.spec.name}{scope.where}"] = _sharded(fs.shard.detach(), fs.spec.padded, mesh)
    if rt.optimizer is not None:
        owners = _owners(rt, model, scope)
        name_of = {id(p): owner for owner, p in owners}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [name_of[id(p)] for p in g["params"]]}
                  for g in rt.optimizer.param_groups]
        state["optim/param_groups" + scope.where] = pickle.dumps(groups)
        state.update(_optimizer_entries(rt, owners))
    return state


def _aliases(model: torch.nn.Module) -> dict[str, str]:
    from autopar.capture import tied_aliases

    return tied_aliases(model)


def _optimizer_entries(rt: Any, owners: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """``optim/<owner>/<key>`` for every value of the optimizer state (shard-shaped tensors as DTensors)."""
    out: dict[str, Any] = {}
    mesh = _dp_mesh(rt) if rt.zero is not None and rt.groups["dp"] is not None else None
    for owner, p in owners:
        for key, value in rt.optimizer.state.get(p, {}).items():
            if not isinstance(value, torch.Tensor):
                out[f"optim/{owner}/{key}"] = pickle.dumps(value)
            elif rt.zero is not None and value.dim() == 1 and value.shape == p.shape:
                out[f"optim/{owner}/{key}"] = _sharded(value, _padded(rt, p), mesh)
            else:
                out[f"optim/{owner}/{key}"] = value
    return out


def _optimizer_template(rt: Any, model: torch.nn.Module, stored: dict, state: dict,
                        scope: Scope) -> dict[str, dict[str, Any]]:
    """Fresh tensors, in ``state``, for the optimizer state the checkpoint holds (the optimizer may have none yet)."""
    if rt.optimizer is None:
        return {}
    mesh = _dp_mesh(rt) if rt.zero is not None and rt.groups["dp"] is not None else None
    out: dict[str, dict[str, Any]] = {}
    for owner, p in _owners(rt, model, scope):
        prefix = f"optim/{owner}/"
        for key, md in stored.items():
            if not key.startswith(prefix):
                continue
            name = key[len(prefix):]
            if not isinstance(md, TensorStorageMetadata):
                state[key] = b""
                out.setdefault(owner, {})[name] = key  # unpickled after loading
                continue
            size, dtype = tuple(md.size), md.properties.dtype
            if rt.zero is not None and len(size) == 1 and size[0] == _padded(rt, p):
                local = torch.zeros(p.shape, dtype=dtype, device=p.device)
                state[key] = _sharded(local, size[0], mesh)
            else:
                local = torch.zeros(size, dtype=dtype, device=p.device if size else "cpu")
                state[key] = local
            out.setdefault(owner, {})[name] = local
    return out


def _restore_optimizer(rt: Any, model: torch.nn.Module, state: dict, template: dict[str, dict[str, Any]],
                       scope: Scope) -> None:
    """Hands the loaded optimizer state to the optimizer, matching parameters by name."""
    key = "optim/param_groups" + scope.where
    if rt.optimizer is None or key not in state:
        return
    owners = _owners(rt, model, scope)
    index = {owner: i for i, (owner, _) in enumerate(owners)}
    groups = pickle.loads(state[key])
    current = [sorted(name for name, p in owners if any(p is q for q in g["params"]))
               for g in rt.optimizer.param_groups]
    if sorted(sorted(g["params"]) for g in groups) != sorted(current):
        raise ValueError(f"the checkpoint's optimizer groups {[g['params'] for g in groups]} do not match this "
                         f"optimizer's {current}; build the optimizer the same way as the job that saved it")
    per_param = {index[owner]: {k: pickle.loads(state[v]) if isinstance(v, str) else v for k, v in entries.items()}
                 for owner, entries in template.items()}
    saved = {tuple(sorted(g["params"])): g for g in groups}
    ordered = []
    for names, g in zip(current, rt.optimizer.param_groups):  # torch matches groups by position
        hyper = dict(saved[tuple(names)])
        hyper["params"] = [index[name_of] for name_of, p in owners if any(p is q for q in g["params"])]
        ordered.append(hyper)
    rt.optimizer.load_state_dict({"state": per_param, "param_groups": ordered})
