"""Gradient clipping by the global norm, over gradients spread across dp, pp and tp ranks.

``global_grad_norm`` returns the 2-norm of the gradient of the whole model, as
``torch.nn.utils.clip_grad_norm_`` computes it on one device, from what each
rank holds after the gradient sync: every rank sums the squares of its gradient
elements, each weighted by one over the number of ranks holding an identical
copy of that element, and one all-reduce over all ranks adds the sums. Copies:

- dp: without ZeRO every dp rank holds the same averaged gradient (weight
  1/dp); under ZeRO each dp rank holds a disjoint slice (weight 1); under
  hybrid sharding each slice is held by the dp_replicate ranks of its shard
  (weight 1/dp_replicate).
- tp: a tp-sharded parameter's slices are disjoint; a replicated one is the
  same on every tp rank (weight 1/tp).
- pp: a parameter used by stages on k pp ranks (tied embeddings) holds the
  same summed gradient on each of them (weight 1/k).
- ep: an expert's parameter is held by the dp / ep ranks of its ``ep_replicate``
  group only (weight ep/dp); under ZeRO its slices are disjoint over the ranks
  holding the expert in one replica, so held as the dp ones are (weight
  1/dp_replicate).

Invariant: ``clip`` scales every gradient the optimizer will read by
``min(1, max_norm / (norm + 1e-6))``, torch's coefficient, so the update equals
single-device training with ``clip_grad_norm_``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

if TYPE_CHECKING:
    from autopar.runtime.rank import RankRuntime


def _pieces(rt: RankRuntime, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(parameter name, gradient elements of it this rank holds)`` for every gradient the optimizer reads."""
    if rt.zero is not None:
        for fs in rt.zero.shards:
            grad = fs.shard.grad
            if grad is None:
                continue
            lo, hi = fs.index * fs.spec.shard, (fs.index + 1) * fs.spec.shard
            for name, offset, numel in zip(fs.spec.params, fs.spec.offsets, fs.spec.numels):
                a, b = max(lo, offset), min(hi, offset + numel)
                if a < b:
                    yield name, grad[a - lo : b - lo]
        return
    names = {id(p): n for n, p in model.named_parameters()}
    for p in rt.params:
        if p.grad is not None:
            yield names[id(p)], p.grad


def global_grad_norm(rt: RankRuntime, model: torch.nn.Module, placements: dict[str, Any], holders: dict[str, int],
                     experts: frozenset[str] = frozenset()) -> float:
    """The 2-norm of the whole model's gradient (every rank calls it; see the module doc).

    ``placements``: tp placement by parameter; ``holders``: pp ranks per parameter held by several;
    ``experts``: the parameters of routed experts spread over ep.
    """
    mesh = rt.groups.mesh
    total = torch.zeros((), dtype=torch.float64, device=rt.groups.device)
    for name, grad in _pieces(rt, model):
        copies = holders.get(name, 1)
        copies *= mesh.dp if rt.zero is None else mesh.dp_replicate
        copies //= mesh.ep if name in experts and rt.zero is None else 1  # (ZeRO: a slice of one replica)
        if not isinstance(placements.get(name), Shard):
            copies *= mesh.tp
        total += grad.detach().double().square().sum() / copies
    if mesh.size > 1:
        dist.all_reduce(total)
    return float(total.sqrt())


def clip(rt: RankRuntime, norm: float, max_norm: float) -> None:
    """Scales the gradients the optimizer reads by ``min(1, max_norm / (norm + 1e-6))``."""
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef == 1.0:
        return
    tensors = [fs.shard for fs in rt.zero.shards] if rt.zero is not None else rt.params
    with torch.no_grad():
        for t in tensors:
            if t.grad is not None:
                t.grad.mul_(coef)
