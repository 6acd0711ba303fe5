"""Every change autopar makes to the user's module's parameter storage (``p.data``), in one place.

``parallelize`` keeps the user's ``nn.Module`` and runs its parameters and
buffers in place: the captured graphs read them by name. A rank's runtime
therefore rewrites their storage, and only these functions do:

- ``place_on_rank``: parameters and buffers move to the rank's device and take
  rank 0's values;
- ``shard_for_tp``: parameters take the compiler's fused storage layout and,
  where the plan shards them over tp, this tp rank's chunk;
- ``store_trainable_in``: trainable parameters take the dtype the runtime stores
  them in (``precision="mixed"``: bfloat16, the optimizer keeping float32 masters);
- ``hold_experts``: expert parameters take what this rank's ep index holds of them (its experts' rows of
  stacked weights, its experts' whole tensors, nothing of other experts');
- ``release_other_stages``: parameters of pipeline stages this rank does not
  run become empty tensors;
- ``full_size_for_capture``: tp-sharded parameters take their full shapes
  (uninitialized) while a new input shape is captured, then get their shards back.

ZeRO's flat shards (``runtime/zero.py``) own the storage of the parameters they
shard; its ``full_size_parameters`` plays ``full_size_for_capture``'s part for them.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import Placement, Shard

from autopar.core.expert_layout import ExpertParam
from autopar.core.layout import Interleave, to_storage


def place_on_rank(model: torch.nn.Module, device: torch.device) -> None:
    """Moves every parameter and buffer to ``device`` with rank 0's values (every replica starts alike, as DDP)."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.data = t.data.to(device)
            dist.broadcast(t.data, src=0)


def shard_for_tp(model: torch.nn.Module, placements: dict[str, Placement], layouts: dict[str, Interleave],
                 tp: int, tp_index: int) -> dict[str, tuple[int, ...]]:
    """Each parameter takes its storage layout, then (sharded on tp by the plan) tp rank ``tp_index``'s chunk
    of ``tp``; returns every parameter's shape before, for ``full_size_for_capture`` and checkpoints."""
    full_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            placement = placements.get(name)
            if name in layouts:
                p.data = to_storage(p.data, layouts[name])
            if isinstance(placement, Shard):
                p.data = p.data.chunk(tp, placement.dim)[tp_index].clone()
    return full_shapes


def hold_experts(model: torch.nn.Module, placements: dict[str, ExpertParam], index: int) -> set[str]:
    """Expert parameters keep what ep index ``index`` holds of them; returns the names of those it holds none of."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in placements:
                p.data = placements[name].local(p.data, index).clone()
    return {n for n, e in placements.items() if not e.stacked and e.holder() != index}


def store_trainable_in(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Trainable floating parameters of another dtype take ``dtype``; returns their values before, by name."""
    before = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and p.is_floating_point() and p.dtype != dtype:
                before[name] = p.data
                p.data = p.data.to(dtype)
    return before


def release_other_stages(model: torch.nn.Module, kept: set[str]) -> None:
    """Parameters not named in ``kept`` (other pipeline stages') become empty; a capture gives them shapes again."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n not in kept:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def released(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The storage of the parameters ``release_other_stages`` emptied, by name."""
    return {n: p.data for n, p in model.named_parameters() if p.numel() == 0}


@contextlib.contextmanager
def full_size_for_capture(model: torch.nn.Module, full_shapes: dict[str, tuple[int, ...]]) -> Iterator[None]:
    """Parameters whose shape differs from ``full_shapes`` (tp shards) take that shape, uninitialized and
    without gradient, while the block runs; their shard and gradient come back after it."""
    shards = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in full_shapes and tuple(p.shape) != full_shapes[name]:
                shards[name] = (p.data, p.grad)  # (zero=1 keeps gradients, of the shard's shape)
                p.grad = None
                p.data = torch.empty(full_shapes[name], dtype=p.dtype, device=p.device)
    try:
        yield
    finally:
        for name, p in model.named_parameters():
            if name in shards:
                p.data, p.grad = shards[name]
