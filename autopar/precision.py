"""Mixed precision: the policy, its checks and the capture in the compute dtype.

``precision="bf16"`` trains as FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` does: the model's parameters stay float32 and are the
master copy the optimizer steps (its state float32 too, sharded as ZeRO says);
forward and backward compute in bfloat16, so saved activations, tensor-parallel
collectives and pipeline hops are bfloat16; ZeRO-3 all-gathers bfloat16 copies;
gradients reach the parameters in float32, where microbatches accumulate, and
are reduced over dp in ``reduce_dtype`` (float32 by default); the loss is float32.

How: the model is captured with fake bfloat16 parameters (and floating inputs),
so its own dtype logic (a norm's ``.to(float32)`` and back) runs as it does
under FSDP2; tensor parallelism and pipeline cuts work on that graph; then
``passes/mixed_precision.py`` gives every rank's graph float32 parameter
placeholders with a cast at their first use, and a float32 loss
(``autopar/compiler/precision_program.py`` applies it to a program).

``precision="mixed"`` is the ZeRO paper's layout (DeepSpeed's and Megatron-LM's
bf16 training): the runtime stores the trainable parameters in bfloat16 (2
bytes), their gradients are bfloat16 and accumulate over microbatches in it (2
bytes), and the optimizer steps float32 master copies of them, kept with its
state and sharded with it under ZeRO (4 + 8 bytes for Adam): 2 + 2 + 12 bytes per
parameter. Gradients are reduced over dp in ``reduce_dtype``: bfloat16 by default
(their own dtype, as in the paper and DeepSpeed; the planner prices that), or
"fp32". The masters are what ``state_dict`` and checkpoints hold
(``runtime/master.py``). Frozen parameters stay float32 and are cast at use.

``precision="fp32"`` (the default) runs the model in its own dtype, unchanged.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from autopar.core.plan import dtype_name
from autopar.runtime.groups import job_device

NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MIXED = "mixed"  # bf16 parameters and gradients, fp32 masters in the optimizer (the ZeRO paper's 2 + 2 + 12)
FP16 = ("precision='fp16' needs a loss scaler (fp16 gradients underflow without one), which autopar does not have; "
        "use precision='bf16' (the same memory and speed on GPUs since Ampere, and no scaling needed)")


@dataclass(frozen=True)
class Policy:
    """What each dtype is: master parameters, compute, gradient reduction over dp, and the trainable
    parameters as the runtime stores them (``stored``: ``master``, or the compute dtype when the optimizer
    keeps the masters apart)."""

    compute: torch.dtype
    reduce: torch.dtype
    master: torch.dtype = torch.float32
    stored: torch.dtype = torch.float32

    @property
    def separate_masters(self) -> bool:
        """Whether the optimizer steps master copies of parameters stored in another dtype."""
        return self.stored != self.master

    def describe(self) -> str:
        compute, master = dtype_name(self.compute), dtype_name(self.master)
        if self.separate_masters:
            stored = dtype_name(self.stored)
            return (f"{stored} trainable parameters and gradients (microbatches accumulate in {stored}); "
                    f"{master} master parameters and optimizer state, kept by the optimizer; {compute} compute, "
                    f"activations, tp collectives and pipeline hops; gradients reduced over dp in "
                    f"{dtype_name(self.reduce)}; ZeRO-3 gathers {compute}; loss {master}")
        return (f"{compute} compute, activations, tp collectives and pipeline hops; {master} master parameters, "
                f"gradients and optimizer state; gradients reduced over dp in {dtype_name(self.reduce)}; ZeRO-3 "
                f"gathers {compute}; loss {master}")


def _dtype(value: Any, option: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if value not in NAMES:
        names = [*NAMES, MIXED] if option == "precision" else NAMES
        raise ValueError(f"{option}={value!r} must be one of {', '.join(map(repr, names))}")
    return NAMES[value]


def policy(precision: str, reduce_dtype: Any = None) -> Policy | None:
    """The policy of ``parallelize(precision=, reduce_dtype=)``; None for "fp32" (the model's own dtype)."""
    if precision == MIXED:  # gradients are reduced in their own dtype unless asked (the ZeRO paper, DeepSpeed)
        bf16 = policy("bf16", "bf16" if reduce_dtype is None else reduce_dtype)
        return dataclasses.replace(bf16, stored=bf16.compute)
    compute = _dtype(precision, "precision")
    if compute == torch.float16:
        raise ValueError(FP16)
    if compute == torch.float32:
        if reduce_dtype is not None:
            raise ValueError(f"reduce_dtype={reduce_dtype!r} applies to precision='bf16' or 'mixed'; with "
                             "precision='fp32' gradients are reduced in the model's own dtype")
        return None
    reduce = torch.float32 if reduce_dtype is None else _dtype(reduce_dtype, "reduce_dtype")
    if reduce not in (torch.float32, torch.bfloat16):
        raise ValueError(f"reduce_dtype={reduce_dtype!r}: gradients are reduced in 'fp32' (the default) or 'bf16'")
    return Policy(compute=compute, reduce=reduce)


def bf16_supported(device: torch.device) -> bool:
    """Whether ``device`` computes in bfloat16 natively (CUDA: compute capability 8.0 and later)."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 8
    try:
        x = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        return bool((x @ x).sum().item() == 8)
    except (RuntimeError, TypeError):
        return False


def check_model(model: torch.nn.Module, pol: Policy | None, device: torch.device | None = None) -> None:
    """Raises unless ``model`` can train under ``pol``: float32 parameters to keep as masters (under "mixed"
    trainable ones may already be stored in bf16: their masters start from those values), a bf16 device."""
    if pol is None:
        return
    wrong = [(n, p.dtype) for n, p in model.named_parameters()
             if p.is_floating_point() and p.dtype not in (pol.master, stored_dtype(p, pol))]
    if wrong:
        name, dtype = wrong[0]
        compute, master = dtype_name(pol.compute), dtype_name(pol.master)
        option = MIXED if pol.separate_masters else compute
        raise ValueError(
            f"precision='{option}' keeps {master} master parameters, but {name!r} (and {len(wrong) - 1} more) is "
            f"{dtype}; call model.float() first to train in {compute} with {master} masters, or keep "
            "precision='fp32', which trains in the model's own dtype")
    device = device if device is not None else job_device()  # where this process's rank will compute
    if pol.compute == torch.bfloat16 and not bf16_supported(device):
        what = device.type
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            what = f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
        raise ValueError(f"precision='bf16' needs bfloat16 support on the training device, and {what} has none; "
                         "use precision='fp32' (the default), or a device with bfloat16 (CPU, or a GPU of compute "
                         "capability 8.0 or later: A100, H100, ...)")


def stored_dtype(p: torch.nn.Parameter, pol: Policy | None) -> torch.dtype:
    """The dtype the runtime stores parameter ``p`` in under ``pol``: trainable floating ones in ``pol.stored``."""
    if pol is not None and p.requires_grad and p.is_floating_point():
        return pol.stored
    return p.dtype


def _fake(t: torch.Tensor, mode: FakeTensorMode, dtype: torch.dtype) -> torch.Tensor:
    with mode:
        fake = torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=t.device)
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(fake, requires_grad=t.requires_grad)
    return fake


@contextlib.contextmanager
def in_compute_dtype(model: torch.nn.Module, dtype: torch.dtype, inputs: Any,
                     target: Any) -> Iterator[tuple[Any, Any]]:
    """Inside the block ``model`` has fake ``dtype`` parameters (buffers fake, their own dtype); yields fake
    ``inputs`` (floating ones in ``dtype``, as FSDP2 casts forward inputs) and a fake ``target`` (its own dtype).

    Nothing is allocated; the model is itself again (the same tensor objects) when the block ends.
    """
    mode = FakeTensorMode()
    fakes: dict[int, torch.Tensor] = {}
    saved: list[tuple[dict, str, torch.Tensor]] = []
    for module in model.modules():
        for table, cast in ((module._parameters, True), (module._buffers, False)):
            for name, t in table.items():
                if t is not None:
                    saved.append((table, name, t))
                    to = dtype if cast and t.is_floating_point() else t.dtype
                    table[name] = fakes.setdefault(id(t), _fake(t, mode, to))

    def fake(x: Any, cast: bool) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return _fake(x, mode, dtype if cast and x.is_floating_point() else x.dtype)

    try:
        yield (pytree.tree_map(lambda x: fake(x, True), inputs), pytree.tree_map(lambda x: fake(x, False), target))
    finally:
        for table, name, t in saved:
            table[name] = t


def widened(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with its floating tensors narrower than ``dtype`` cast to ``dtype`` (model outputs before a loss)."""
    return pytree.tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
                           and x.dtype.itemsize < dtype.itemsize else x, tree)
