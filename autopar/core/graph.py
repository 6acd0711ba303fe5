"""The graph IR that passes rewrite and the runtime executes.

``Captured`` is one functional ATen graph (``autopar.compiler.capture`` makes it) with the
signature of its placeholders (``Slot``) and outputs; ``StageGraph`` is one
pipeline stage of it (``passes.stage_cuts`` cuts it) with the values that cross
its cuts (``Boundary``). Parameter names are the user's model's state-dict
keys; a parameter reachable under several names (tied embeddings) appears
under one of them (``tied_aliases``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.core.buffer_writes import written_placeholders
from autopar.core.loss_count import LossCounts

PREFIX = "model."  # the attribute capture's wrappers keep the user's model under


class SlotKind(str, Enum):
    """What feeds a placeholder. A kind equals its value as a string (``SlotKind.PARAM == "param"``)."""

    PARAM = "param"  # a parameter of the model, by state-dict key
    BUFFER = "buffer"  # a buffer of the model, by state-dict key
    CONSTANT = "constant"  # a tensor the capture lifted out of the model (``Captured.constants``)
    INPUT = "input"  # one of the flat user inputs, by its index among them
    RECV = "recv"  # a value a pipeline stage receives from the stage before, by the value's name

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Slot:
    """One placeholder of a captured graph or stage: what feeds it."""

    kind: SlotKind
    name: str  # the model's state-dict key (param/buffer/constant), the placeholder's (input), the value's (recv)
    index: int | None = None  # an input's position in the flat user inputs (inputs only)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", SlotKind(self.kind))
        if (self.kind is SlotKind.INPUT) != (self.index is not None):
            raise ValueError(f"{self}: an input slot has its index in the flat user inputs; no other slot has one")


@dataclass
class Captured:
    """A functional graph and the signature of its placeholders and outputs."""

    gm: fx.GraphModule
    slots: list[Slot]  # the inputs' indices are 0, 1, ... in placeholder order
    mutated_buffers: list[str]  # the graph's first outputs are new values of these buffers
    out_spec: pytree.TreeSpec  # unflattens the remaining outputs
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> the name the graph uses
    input_dtypes: list[torch.dtype | None] = field(default_factory=list)  # each flat user input's, as fed
    counts: LossCounts | None = None  # the last inputs are the loss's counts over the batch (``core/loss_count.py``)

    @property
    def param_names(self) -> list[str]:
        return [s.name for s in self.slots if s.kind is SlotKind.PARAM]

    @property
    def updated_buffers(self) -> list[str]:
        """Every buffer the forward updates: those returned as new values (``mutated_buffers``) and those the
        graph writes in place (an ``add_`` on the placeholder or a view of it, BatchNorm's running statistics)."""
        written = written_placeholders(self.gm)
        nodes = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        in_place = [s.name for n, s in zip(nodes, self.slots) if s.kind is SlotKind.BUFFER and n in written]
        return list(dict.fromkeys([*self.mutated_buffers, *in_place]))

    def placeholders(self, kind: SlotKind) -> list[fx.Node]:
        nodes = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        return [n for n, s in zip(nodes, self.slots) if s.kind == kind]

    def run(self, state: dict[str, torch.Tensor], inputs: list[Any], gm: fx.GraphModule | None = None) -> Any:
        """Runs ``gm`` (default: the captured graph) with ``state`` for params/buffers; returns the outputs.

        ``inputs`` are the flat user inputs; the loss's counts (if any) are those of ``inputs`` unless given."""
        if self.counts is not None and len(inputs) < sum(s.kind is SlotKind.INPUT for s in self.slots):
            device = next((x.device for x in inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
            inputs = [*inputs, *self.counts.inputs([list(inputs)], device)]
        it = iter(inputs)
        args = [
            next(it) if s.kind is SlotKind.INPUT else self.constants[s.name] if s.kind is SlotKind.CONSTANT
            else state[s.name]
            for s in self.slots
        ]
        flat = (gm or self.gm)(*args)
        k = len(self.mutated_buffers)
        with torch.no_grad():
            for name, value in zip(self.mutated_buffers, flat[:k]):
                state[name].copy_(value)
        return pytree.tree_unflatten(list(flat[k:]), self.out_spec)


@dataclass(frozen=True)
class Boundary:
    """A value crossing from one stage to the next."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool  # its gradient flows back across the cut


@dataclass
class StageGraph:
    index: int
    gm: fx.GraphModule
    slots: list[Slot]  # its placeholders
    recv: list[Boundary]
    send: list[Boundary]
    is_last: bool
    params: list[str] = field(default_factory=list)
    mutated: list[str] = field(default_factory=list)  # the first outputs are new values of these buffers


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """``{alias: canonical}`` for parameters and buffers reachable under several names."""
    first: dict[int, str] = {}
    aliases = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, t in named:
        canonical = first.setdefault(id(t), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def copy_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule with a copy of ``gm``'s graph (node meta shared, not deep-copied), for a pass to rewrite."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    graph._codegen = gm.graph._codegen
    return fx.GraphModule(gm, graph)


def placeholders_of(node: fx.Node) -> set[fx.Node]:
    """The placeholders ``node`` is computed from (itself, if it is one)."""
    found, stack, seen = set(), [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            found.add(n)
        stack.extend(n.all_input_nodes)
    return found


def placeholder_kinds(graph: fx.Graph, slots: list[Slot]) -> dict[fx.Node, SlotKind]:
    """Each placeholder of ``graph`` (a capture's, in ``slots``' order) -> its slot's kind."""
    return dict(zip([n for n in graph.nodes if n.op == "placeholder"], [s.kind for s in slots]))


def origin(node: fx.Node) -> str:
    """Where ``node`` was computed in the user's model, for an error message: ``"in model.layers.0.self_attn
    (LlamaAttention)"`` (the innermost module and its class), or ``""`` for a node outside every module."""
    root = PREFIX[:-1]
    stack = [(path, cls) for path, cls in (node.meta.get("nn_module_stack") or {}).values()
             if path.startswith(PREFIX) or path == root]
    if not stack:
        return ""
    path, cls = stack[-1]
    name = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
    return f"in {'the model' if path == root else path.removeprefix(PREFIX)} ({name.rsplit('.', 1)[-1]})"
