"""``RankRuntime``: what one rank holds while it runs a program.

The runtime functions that read a rank's state (``clip``, ``checkpoint``, the
full-state gather) take this type; ``autopar/rank/build.py`` builds it once,
at the first step or forward, from the program and the job's process groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

import torch
import torch.distributed as dist

from autopar.core.collectives import Binding
from autopar.runtime.grad_sync import BucketedAllReduce, GradSyncs
from autopar.runtime.master import Masters
from autopar.runtime.groups import Groups
from autopar.runtime.memory import MemoryAccount
from autopar.runtime.progress import Progress
from autopar.runtime.step_executor import Executor
from autopar.runtime.zero import ZeroRuntime


class NoParameters:
    """The optimizer of a rank whose pipeline stages hold no trainable parameter: nothing to update."""

    def __init__(self) -> None:
        self.param_groups: list = []
        self.state: dict = {}
        self._hooks: list[Callable] = []

    def register_step_post_hook(self, hook: Callable) -> None:
        self._hooks.append(hook)

    def step(self) -> None:
        for hook in self._hooks:
            hook(self, (), {})

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state: dict) -> None:
        pass


Optimizer = Union[torch.optim.Optimizer, NoParameters]
GradSync = Union[BucketedAllReduce, GradSyncs, ZeroRuntime]  # ZeRO reduce-scatters the gradients it owns


@dataclass
class RankRuntime:
    """One rank's process groups, parameters and buffers, optimizer, gradient sync and step executor."""

    groups: Groups
    state: dict[str, torch.Tensor]  # canonical name -> this rank's tensor (parameters and buffers)
    params: list[torch.nn.Parameter]  # what the optimizer updates (ZeRO: the flat shards' parameters)
    optimizer: Optimizer | None  # None: built without an optimizer factory (forward only)
    grad_sync: GradSync | None  # None: no dp axis
    binding: Binding  # the autopar::* collectives' process groups, with their call and byte counts
    full_shapes: dict[str, tuple[int, ...]]  # parameter -> its shape before tp sharding
    memory: MemoryAccount
    executor: Executor  # runs the program's step schedule
    zero: ZeroRuntime | None = None  # ZeRO over dp (zero=1|2|3): also the optimizer's owner and the grad sync
    shared: list[tuple[torch.Tensor, dist.ProcessGroup]] = field(default_factory=list)  # params on several pp ranks
    holders: dict[str, int] = field(default_factory=dict)  # parameter -> pp ranks holding it, when several
    rng_base: int | None = None  # the seed tp ranks agree on (``seed_rng``), and the calls since
    rng_calls: int = 0
    masters: Masters | None = None  # precision="mixed": the float32 masters of ``params`` the optimizer steps
    progress: Progress | None = None  # which call this rank is in, in the job's store (runtime/progress.py)

    def master_of(self, t: torch.Tensor) -> torch.Tensor:
        """What stands for stored tensor ``t`` in states and checkpoints: its master, or ``t`` itself."""
        return self.masters.of(t) if self.masters is not None else t
