"""Master weights for ``precision="mixed"``: the optimizer steps float32 copies of bfloat16 parameters.

The runtime stores each trainable tensor it steps (a parameter's tp shard, or
under ZeRO a flat shard) in bfloat16, and its gradient too. ``Masters`` keeps
one float32 copy of each, built from the model's float32 values before they
were rounded, so the masters are the state training carries from step to step.
``MasterOptimizer`` wraps the user's optimizer, built on the masters: a step
widens each gradient into its master's ``.grad``, steps, and rounds the masters
back into the stored tensors; its ``param_groups`` and ``state`` are the user's
optimizer's (LR schedulers, checkpoints), keyed by the masters.

Invariant: after every step (and every load) each stored tensor equals its
master rounded to the stored dtype, so the bf16 weights never drift from the
fp32 ones. State dicts and checkpoints read and write the masters.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from autopar.core.errors import UnsupportedError


class Masters:
    """Float32 copies of the tensors the optimizer steps, in the same order."""

    def __init__(self, stored: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """``stored``: the low-precision tensors; ``values``: their full-precision values (same shapes)."""
        for s, v in zip(stored, values, strict=True):
            if s.shape != v.shape:
                raise RuntimeError(f"internal error: a master of shape {tuple(v.shape)} for a tensor of "
                                   f"{tuple(s.shape)}")
        self.stored = list(stored)
        self.tensors = [torch.nn.Parameter(v.detach().to(torch.float32, copy=True)) for v in values]
        self._of = {id(s): m for s, m in zip(self.stored, self.tensors)}

    def of(self, stored: torch.Tensor) -> torch.Tensor:
        """The master of ``stored`` (``stored`` itself when it has none: a frozen or buffer tensor)."""
        return self._of.get(id(stored), stored)

    @torch.no_grad()
    def round_to_stored(self) -> None:
        """Each stored tensor takes its master's value, rounded (after a step or a load into the masters)."""
        for s, m in zip(self.stored, self.tensors):
            s.copy_(m)


class MasterOptimizer(torch.optim.Optimizer):
    """The user's optimizer stepping ``masters``; gradients come from the stored tensors (see the module doc)."""

    def __init__(self, masters: Masters, factory: Callable[[list], Any]) -> None:
        self.masters = masters
        self.inner = factory(masters.tensors)
        super().__init__(masters.tensors, dict(self.inner.defaults))
        self.param_groups = self.inner.param_groups  # one list: schedulers and checkpoints see the user's groups
        self.state = self.inner.state

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> Any:  # noqa: D102
        if closure is not None:
            raise ValueError("precision='mixed' steps the masters after autopar's own backward; no closure")
        for s, m in zip(self.masters.stored, self.masters.tensors):
            m.grad = None if s.grad is None else s.grad.to(m.dtype)
        self.inner.step()
        for m in self.masters.tensors:
            m.grad = None
        self.masters.round_to_stored()

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        for s in self.masters.stored:
            if s.grad is not None:
                if set_to_none:
                    s.grad = None
                else:
                    s.grad.zero_()

    def state_dict(self) -> dict[str, Any]:  # noqa: D102
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: D102
        self.inner.load_state_dict(state_dict)
        self.state = self.inner.state
        self.param_groups = self.inner.param_groups


FUSED_KERNELS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def fused_steps(factory: Callable[[list], Any]) -> Callable[[list], Any]:
    """``factory`` whose optimizer, when it is one of torch's with a fused kernel (``FUSED_KERNELS``, the class
    itself and not a subclass) and a group leaves both ``fused`` and ``foreach`` unset, steps that group's
    tensors in the fused kernel: one pass over every tensor instead of a loop of ops per tensor, the same update
    up to rounding. It is ``compile=True``'s optimizer step (docs/decisions.md); a group that names either
    setting keeps it."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = set(_get_fused_kernels_supported_devices())

    def build(params: list) -> Any:
        opt = factory(params)
        if type(opt) not in FUSED_KERNELS or opt.defaults.get("differentiable"):
            return opt
        for group in opt.param_groups:
            if group.get("fused") is None and group.get("foreach") is None and all(
                    t.is_floating_point() and t.device.type in devices for t in group["params"]):
                group["fused"] = True
        return opt

    return build


def build_optimizer(factory: Callable[[list], Any] | None, params: list[torch.Tensor],
                    masters: Masters | None) -> Any:
    """The optimizer of this rank: the user's ``factory`` on ``params``, or on their ``masters`` when given."""
    if factory is None:
        return None
    if masters is None:
        return factory(params)
    return MasterOptimizer(masters, factory)



def check_groups_unsharded(factory: Callable[[list], Any], params: list[torch.Tensor],
                           full: list[tuple[int, ...]]) -> None:
    """Refuses a ``factory`` that groups this rank's tp shards ``params`` otherwise than the whole parameters
    (shapes ``full``): its groups read the shapes (``numel() >= n``), which tp changed, so a shard would train
    with another group's settings than on one device. (A factory that cannot build on meta tensors is not
    checked.)"""
    local = [tuple(p.shape) for p in params]
    if local == [tuple(f) for f in full]:
        return

    def groups(shapes: list[tuple[int, ...]]) -> list[int]:
        made = [torch.nn.Parameter(torch.empty(shape, device="meta")) for shape in shapes]
        where = {id(p): i for i, g in enumerate(factory(made).param_groups) for p in g["params"]}
        return [where.get(id(p), -1) for p in made]

    try:
        mine, whole = groups(local), groups([tuple(f) for f in full])
    except Exception:  # noqa: BLE001 - a factory that needs real tensors: no claim
        return
    moved = [i for i, (a, b) in enumerate(zip(mine, whole)) if a != b]
    if moved:
        i = moved[0]
        raise UnsupportedError(f"the optimizer puts parameter {i} (shape {tuple(full[i])}, this tp rank's shard "
                               f"{local[i]}) in group {mine[i]} on the shard but in group {whole[i]} on the whole "
                               f"parameter: its groups read the parameters' shapes, which tensor parallelism "
                               f"shards; group by what a shard keeps (p.dim(), or the parameter's identity) or run "
                               f"without tp")
