"""What autograd saves for backward when a graph runs: each saved tensor once, with the node that saved it and
the node that made it.

``saved_tensors(gm, params, trainable)`` runs ``gm`` on fake tensors (shapes as in
``node.meta["val"]``, no memory) with autograd on, under ``saved_tensors_hooks``, so
what any operator saves (a custom op's context too) is seen as autograd sees it.
The planner reads it for activation memory per segment; the sharding solver, to
price each strategy's saved bytes per rank.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.core.recompute_modes import COMMUNICATING, keeps


@dataclass
class Saved:
    saver: fx.Node
    producer: fx.Node | None  # None: made inside the saving op (e.g. attention probabilities)
    elements: Any
    floating: bool
    itemsize: int


def run_device(x: Any) -> Any:
    """The device of the fake run for a device the graph names: a meta-device model runs as fake CPU tensors.

    Every device constant is retargeted, keyword or positional (``aten.to.device(x, device, dtype)``
    from ``x.to(y.device)``, ``aten.arange(..., device=...)``), so no meta tensor meets a CPU one.
    """
    return torch.device("cpu") if isinstance(x, torch.device) and x.type == "meta" else x


class SavedTensors(fx.Interpreter):
    """Runs a graph on fake tensors with autograd on; records each tensor saved for backward once."""

    def __init__(self, gm: fx.GraphModule, params: set[fx.Node]) -> None:
        super().__init__(gm)
        self.params = params
        self.current: fx.Node | None = None
        self.producer: dict[int, fx.Node] = {}
        self.origin: dict[fx.Node, fx.Node] = {}  # node -> the node that made the storage its output views
        self.param_ids: set[int] = set()
        self.saved: dict[int, Saved] = {}
        self.kept: dict[fx.Node, list[Any]] = {}  # node -> elements of the outputs selective recomputation keeps
        self.keep: list[Any] = []

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        out = super().run_node(n)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.keep.append(t)
                base = t._base if t._base is not None else t
                if n.op == "placeholder" and n in self.params:
                    self.param_ids.add(id(base))
                self.producer.setdefault(id(base), n)
                self.origin.setdefault(n, self.producer[id(base)])
        return out

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        args, kwargs = pytree.tree_map(run_device, (args, kwargs))
        return super().call_function(target, args, kwargs)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        key = id(base)
        if key in self.param_ids or key in self.saved:
            return t
        self.keep.append(base)
        self.saved[key] = Saved(self.current, self.producer.get(key), base.numel(), base.is_floating_point(),
                                 base.element_size())
        return t


class _KeptOutputs(TorchDispatchMode):
    """Records, per graph node, the floating outputs of the operators selective recomputation keeps."""

    def __init__(self, interp: SavedTensors) -> None:
        super().__init__()
        self.interp = interp

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in COMMUNICATING and keeps("selective", func, args, kwargs):
            self.interp.kept.setdefault(self.interp.current, []).extend(
                t.numel() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())
        return out


def saved_tensors(gm: fx.GraphModule, params: set[fx.Node], trainable: set[fx.Node]) -> SavedTensors:
    """What autograd keeps for backward when ``gm`` runs (fake tensors on the CPU, shapes as in ``meta["val"]``)."""
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("val") for n in nodes]
    fake_mode = next((v.fake_mode for v in vals if hasattr(v, "fake_mode")), None)
    interp = SavedTensors(gm, params)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        args = []
        for node, v in zip(nodes, vals):
            if not isinstance(v, torch.Tensor):
                args.append(v)
                continue
            t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cpu")
            args.append(t.requires_grad_() if node in trainable and v.is_floating_point() else t)
        with torch.autograd.graph.saved_tensors_hooks(interp.pack, lambda t: t), _KeptOutputs(interp):
            interp.run(*args)
    return interp
