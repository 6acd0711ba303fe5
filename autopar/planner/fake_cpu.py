"""A model on the meta device (or an accelerator) seen as a CPU model of fake tensors, for the planner's captures.

The planner reads a model from graphs it captures, then re-runs them on fake
CPU tensors to find what autograd saves. Model code picks its path by device
(Hugging Face's rotary embedding moves ``inv_freq`` with ``.to(x.device)``,
its mixture-of-experts router calls ``histc`` on integers except on the CPU,
``scaled_dot_product_attention`` chooses its kernel by device), so a graph
captured on the meta device does not run on the CPU. ``as_fake_cpu`` swaps
the model's parameters and buffers for fake CPU tensors of the same shapes,
dtypes and strides (tied ones stay tied) while the graphs are captured, and
``fake_inputs`` makes the inputs alike: every capture, and every re-run, then
sees the model exactly as a CPU model of that size, with no memory.

Invariant: the model is itself again (the same parameter and buffer objects)
when the ``with`` block ends; a CPU model is left untouched.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from autopar.planner.example_inputs import model_device


@contextlib.contextmanager
def as_fake_cpu(model: torch.nn.Module) -> Iterator[FakeTensorMode | None]:
    """``model`` with fake CPU parameters and buffers inside the block; yields their mode (None: a CPU model)."""
    if model_device(model).type == "cpu":
        yield None
        return
    mode = FakeTensorMode()
    fakes: dict[int, torch.Tensor] = {}
    saved: list[tuple[dict, str, torch.Tensor]] = []
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    saved.append((table, name, t))
                    table[name] = fakes.setdefault(id(t), _fake_like(t, mode))
    try:
        yield mode
    finally:
        for table, name, t in saved:
            table[name] = t


def fake_inputs(tree: Any, mode: FakeTensorMode | None) -> Any:
    """``tree`` with every tensor replaced by a fake CPU tensor of ``mode`` (unchanged when ``mode`` is None)."""
    if mode is None:
        return tree
    return pytree.tree_map(lambda x: _fake_like(x, mode) if isinstance(x, torch.Tensor) else x, tree)


def _fake_like(t: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    with mode:
        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(fake, requires_grad=t.requires_grad)
    return fake
