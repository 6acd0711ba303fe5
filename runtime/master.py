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


def build_optimizer(factory: Callable[[list], Any] | None, params: list[torch.Tensor],
                    masters: Masters | None) -> Any:
    """The optimizer of this rank: the user's ``factory`` on ``params``, or on their ``masters`` when given."""
    if factory is None:
        return None
    if masters is None:
        return factory(params)
    return MasterOptimizer(masters, factory)
