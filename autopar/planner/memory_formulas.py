"""Bytes per parameter: the precisions training runs in, optimizer states, and what ZeRO divides.

The planner's memory accounting (``cost_model`` reads it; ``PRECISIONS`` names
what ``autopar plan --precision`` offers).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    """Bytes per element of what training keeps: parameters, gradients, the optimizer's master copy and state."""

    name: str
    param: int
    grad: int
    master: int  # the optimizer's fp32 copy of the parameters (mixed precision), 0 when it steps the params
    state: int  # one optimizer-state element (Adam keeps two per parameter)
    activation: int
    gather: int = 0  # a ZeRO-3 gathered parameter element (0: ``param``)
    copy: int = 0  # the compute copy of a parameter element each microbatch's forward makes and backward keeps

    def step_bytes(self, optimizer_states: int) -> int:
        """Bytes the optimizer step reads and writes per trainable element.

        The stepped copy (master or parameter) read and written, the gradient
        read, each state element read and written, and with a master copy the
        low-precision parameter written back: Adam 28 in fp32 and in mixed precision.
        """
        stepped = self.master or self.param
        return 2 * stepped + self.grad + 2 * optimizer_states * self.state + (self.param if self.master else 0)


PRECISIONS = {
    "fp32": Precision("fp32", 4, 4, 0, 4, 4),
    # bf16 weights, gradients (reduced over dp in bf16) and activations; fp32 master weights and Adam moments
    # (the ZeRO paper's K = 12): what precision="mixed" runs
    "mixed": Precision("mixed", 2, 2, 4, 4, 2),
    "fp64": Precision("fp64", 8, 8, 0, 8, 8),
    # autopar's precision="bf16" (FSDP2's policy): the fp32 parameters are the masters, fp32 gradients, bf16
    # activations and ZeRO-3 gathers; below stage 3 each microbatch in flight keeps bf16 copies of the weights
    "bf16": Precision("bf16", 4, 4, 0, 4, 2, gather=2, copy=2),
}
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd-momentum": 1, "sgd": 0}


def precision_of(dtype: torch.dtype) -> Precision:
    """The precision a model trains in when run as it is (no mixed precision): its parameter dtype."""
    size = torch.empty((), dtype=dtype).element_size()
    name = {4: "fp32", 8: "fp64"}.get(size, "half")
    return PRECISIONS.get(name, Precision(name, size, size, 0, size, size))


def state_bytes(params: float, trainable: float, precision: Precision, optimizer_states: int, *, zero: int,
                dp: int) -> dict[str, float]:
    """Bytes per device of parameters, gradients and optimizer state under ZeRO ``zero`` over ``dp`` ranks.

    The ZeRO paper's accounting (Rajbhandari et al. 2020, section 5): stage 1 shards the optimizer state,
    stage 2 also the gradients, stage 3 also the parameters; frozen parameters are never sharded, have no gradient.
    """
    frozen = params - trainable
    return {
        "parameters": frozen * precision.param + trainable * precision.param / (dp if zero == 3 else 1),
        "gradients": trainable * precision.grad / (dp if zero >= 2 else 1),
        "optimizer": trainable * (precision.master + optimizer_states * precision.state) / (dp if zero >= 1 else 1),
    }
