"""What autopar knows of each optimizer class: the state it keeps per parameter element, and whether it
updates every element from that element alone (so that ZeRO may step flat shards).

``optimizer_kind(opt)`` reads the registry by class (the first registered class in its MRO). A class of the
user's own declares the same on itself: ``state_elements`` (an int, or a function of the optimizer's
``defaults``) and ``elementwise = True``; anything else is refused with the fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class OptimizerKind:
    states: Callable[[dict], int]  # tensors of the parameter's shape in its state, from the optimizer's defaults
    elementwise: bool = True


def _fixed(n: int) -> Callable[[dict], int]:
    return lambda defaults: n


OPTIMIZERS: dict[type, OptimizerKind] = {
    torch.optim.SGD: OptimizerKind(lambda d: 1 if d.get("momentum") else 0),
    torch.optim.Adam: OptimizerKind(lambda d: 3 if d.get("amsgrad") else 2),
    torch.optim.AdamW: OptimizerKind(lambda d: 3 if d.get("amsgrad") else 2),
    torch.optim.Adamax: OptimizerKind(_fixed(2)),
    torch.optim.NAdam: OptimizerKind(_fixed(2)),
    torch.optim.RAdam: OptimizerKind(_fixed(2)),
    torch.optim.Adagrad: OptimizerKind(_fixed(1)),
    torch.optim.RMSprop: OptimizerKind(lambda d: 1 + bool(d.get("momentum")) + bool(d.get("centered"))),
    torch.optim.Rprop: OptimizerKind(_fixed(2)),
    torch.optim.Adadelta: OptimizerKind(_fixed(2)),
    torch.optim.ASGD: OptimizerKind(_fixed(1)),
}


def optimizer_kind(opt: Any) -> OptimizerKind:
    """The registered kind of ``opt``'s class, or the one it declares; a ValueError naming the fix otherwise."""
    for cls in type(opt).__mro__:
        if cls in OPTIMIZERS:
            return OPTIMIZERS[cls]
    declared = getattr(type(opt), "state_elements", None)
    if declared is not None:
        return OptimizerKind(declared if callable(declared) else _fixed(int(declared)),
                             bool(getattr(type(opt), "elementwise", False)))
    known = ", ".join(c.__name__ for c in OPTIMIZERS)
    raise ValueError(f"autopar does not know the state of optimizer {type(opt).__name__} (needed for its memory "
                     f"account); the known ones are {known}. Declare it on your class: `state_elements = 2` (tensors "
                     f"of each parameter's shape it keeps) and, if it updates each element from that element alone, "
                     f"`elementwise = True`")


def state_elements(opt: Any) -> int:
    """Tensors of each parameter's shape ``opt`` keeps in its state."""
    return optimizer_kind(opt).states(getattr(opt, "defaults", {}))
