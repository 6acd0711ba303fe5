"""The optimizer's part of a resharding checkpoint, keyed by the model's parameters, not by the optimizer's.

An optimizer steps *owners*: a parameter (its tp shard), or under ZeRO a flat
shard that spans several parameters. An owner's state splits into per-element
tensors shaped as the owner (Adam's ``exp_avg``/``exp_avg_sq``, SGD's
``momentum_buffer``), saved per parameter as logical tensors like the
parameter itself (``optim/<name>/<key>``), and the rest: scalar state (Adam's
``step``) and the settings of the owner's param group, saved per parameter as
one object (``optim/<name>``). At load a new owner gathers its parameters'
boxes of each per-element tensor (zeros on ZeRO padding, which no parameter
owns) and takes its scalars from its first parameter that has any (parameters
stepped together share them). Invariant: the optimizer then steps every
element exactly as the optimizer that saved it would have.
"""
from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from autopar.runtime.reshard import Entry

SCALAR_KEYS = frozenset({"step", "eta", "mu", "mu_product"})  # torch optimizers' 0-d per-parameter state
KERNEL_KEYS = ("fused", "foreach")  # how a group steps, not what it computes: a loaded group keeps its own


def optimizer_items(opt: Any, entries: list[Entry]) -> dict[str, Any]:
    """What ``entries`` (the parameters this rank writes) contribute: per-element boxes and per-parameter objects."""
    settings = {id(p): _settings(g) for g in opt.param_groups for p in g["params"]}
    out: dict[str, Any] = {}
    for e in entries:
        if id(e.tensor) not in settings:
            continue  # a parameter the optimizer factory left out
        scalars = {}
        for key, value in opt.state.get(e.tensor, {}).items():
            if _per_element(key, value, e.tensor):
                out[f"optim/{e.name}/{key}"] = e.pieces(value.detach())
            else:
                scalars[key] = value
        out[f"optim/{e.name}"] = {"group": settings[id(e.tensor)], "state": scalars}
    return out


def optimizer_targets(opt: Any, entries: list[Entry], stored: dict[str, Any],
                      items: dict[str, Any]) -> dict[int, dict[str, torch.Tensor]]:
    """Adds to ``items`` what to read for ``entries``; returns, per owner (``id``), the per-element tensors the
    read fills (created here: the optimizer may have no state yet)."""
    keys: dict[str, list[tuple[str, TensorStorageMetadata]]] = {}
    for key, md in stored.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "optim" and isinstance(md, TensorStorageMetadata):
            keys.setdefault(parts[1], []).append((parts[2], md))
    tensors: dict[int, dict[str, torch.Tensor]] = {}
    for e in entries:
        if f"optim/{e.name}" not in stored:
            continue
        items[f"optim/{e.name}"] = None  # an object, filled by the read
        owned = tensors.setdefault(id(e.tensor), {})
        for key, md in keys.get(e.name, []):
            if key not in owned:
                owned[key] = torch.zeros(e.tensor.shape, dtype=md.properties.dtype, device=e.tensor.device)
            items[f"optim/{e.name}/{key}"] = e.pieces(owned[key])
    return tensors


def restore_optimizer(opt: Any, entries: list[Entry], items: dict[str, Any],
                      tensors: dict[int, dict[str, torch.Tensor]]) -> str | None:
    """Hands the loaded state to ``opt``; returns a problem (its groups do not fit the saved settings) or None."""
    by_owner: dict[int, list[Entry]] = {}
    for e in entries:
        by_owner.setdefault(id(e.tensor), []).append(e)
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group in opt.param_groups:
        saved = [[(e.name, items[f"optim/{e.name}"]) for e in by_owner.get(id(p), []) if f"optim/{e.name}" in items]
                 for p in group["params"]]
        settings = _group_settings(opt, group, [named for per_owner in saved for named in per_owner])
        if isinstance(settings, str):
            return settings
        for p, per_owner in zip(group["params"], saved):
            owner_state = _owner_state([obj for _, obj in per_owner], tensors.get(id(p), {}))
            if owner_state:
                state[index] = owner_state
            index += 1
        own = {k: group[k] for k in KERNEL_KEYS if k in group}  # (compile=True's fused step, docs/decisions.md)
        groups.append({**settings, **own, "params": list(range(index - len(group["params"]), index))})
    if state or any(f"optim/{e.name}" in items for e in entries):
        opt.load_state_dict({"state": state, "param_groups": groups})
    return None


def _group_settings(opt: Any, group: dict, saved: list[tuple[str, dict]]) -> dict | str:
    """The settings saved for the parameters of ``group`` (its own when none are), or why they do not fit."""
    if not saved:
        return _settings(group)
    first, settings = saved[0][0], saved[0][1]["group"]
    for name, obj in saved[1:]:
        if pickle.dumps(obj["group"]) != pickle.dumps(settings):
            return (f"{first!r} and {name!r} were saved in optimizer groups with different settings "
                    f"({settings} and {obj['group']}), but share one group here; build the optimizer "
                    "with the same groups as the job that saved it")
    missing = sorted(set(_settings(group)) - set(settings))
    if missing:
        return (f"the checkpoint's optimizer settings for {first!r} lack {missing}, which this "
                f"{type(opt).__name__} has; build the optimizer as the job that saved it did")
    return settings


def _owner_state(saved: list[dict], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """An owner's state: its per-element tensors, and the scalars of its first parameter that has any."""
    scalars = next((obj["state"] for obj in saved if obj["state"]), {})
    return {**scalars, **tensors}


def _per_element(key: str, value: Any, owner: torch.Tensor) -> bool:
    """Whether a state value holds one number per element of ``owner`` (0-d owners: all but known scalars)."""
    return (isinstance(value, torch.Tensor) and value.shape == owner.shape
            and not (value.dim() == 0 and key in SCALAR_KEYS))


def _settings(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}
