"""Exports remembered within a process, keyed by everything that can change the exported graph.

``torch.export`` is most of a compile's time, and a process often exports the same model on the same
signature again: a second ``parallelize`` of a freshly built identical model, the ranks of a worker pool
running job after job. Each export is kept under its key (``autopar/compiler/export_key.py``), which holds everything the
export reads.

A training export also answers the forward-only export of the same model on the same inputs: it is exported
once returning the loss and the model's outputs, and ``split_outputs`` cuts it into the graph of each (the
forward one without the loss's nodes and the target's inputs), kept under each one's key. ``pm(...)`` after
``pm.step`` then exports nothing. (Not where a value the model returns is one the loss computed: a loss that
changes the model's output in place.)

A hit returns a copy of the pristine export (new nodes and metadata; the fake values are shared, as no pass
changes one in place), so that the passes may rewrite it freely.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable

import torch
from torch.export.graph_signature import InputKind, OutputKind

from autopar.passes.lazy_module import lazy

ENTRIES = 64  # exports kept (least recently used dropped first)


@dataclass
class Export:
    """What capture reads of an ``ExportedProgram``."""

    graph_module: torch.fx.GraphModule
    input_specs: list
    output_specs: list
    constants: dict[str, Any]
    out_spec: Any

    @classmethod
    def of(cls, ep: torch.export.ExportedProgram) -> "Export":
        sig = ep.graph_signature
        return cls(lazy(ep.graph_module), list(sig.input_specs), list(sig.output_specs), dict(ep.constants),
                   ep.call_spec.out_spec)

    def copy(self) -> "Export":
        constants = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.constants.items()}
        return Export(copy.deepcopy(self.graph_module), self.input_specs, self.output_specs, constants,
                      self.out_spec)


def split_outputs(joint: Export, targets: int, same: dict[int, int] | None = None) -> tuple[Export, Export | None]:
    """The training export and the forward-only one of an export that returned ``(loss, model outputs)``, whose
    last ``targets`` user inputs are the loss's target; the forward one is None where the loss's nodes cannot
    all go (an operator that must run, a target that the model's outputs read).

    ``same``: target leaf -> the user input it is (one tensor passed as both: the export gives the model the
    target's placeholder, which the forward graph reads as that input's)."""
    mutations = [s for s in joint.output_specs if s.kind == OutputKind.BUFFER_MUTATION]
    user = [s for s in joint.output_specs if s.kind == OutputKind.USER_OUTPUT]
    loss_spec, out_spec = joint.out_spec.children() if hasattr(joint.out_spec, "child") else joint.out_spec.children_specs
    train = Export(joint.graph_module, joint.input_specs, mutations + user[:1], joint.constants, loss_spec)
    forward = Export(copy.deepcopy(joint.graph_module), joint.input_specs, mutations + user[1:],
                     dict(joint.constants), out_spec)
    m = len(mutations)
    _keep_outputs(train.graph_module, list(range(m + 1)))
    _keep_outputs(forward.graph_module, [*range(m), *range(m + 1, m + len(user))], prune=True)
    placeholders = [n for n in forward.graph_module.graph.nodes if n.op == "placeholder"]
    dropped = [(n, spec) for n, spec in zip(placeholders, joint.input_specs)
               if spec.kind == InputKind.USER_INPUT][len([s for s in joint.input_specs
                                                          if s.kind == InputKind.USER_INPUT]) - targets:]
    inputs = [n for n, spec in zip(placeholders, joint.input_specs) if spec.kind == InputKind.USER_INPUT]
    for t, i in (same or {}).items():
        if targets and dropped[t][0].users:
            dropped[t][0].replace_all_uses_with(inputs[i])
    if not targets or any(n.users for n, _ in dropped) or not _by_the_model(forward.graph_module):
        return train, None
    for n, _ in dropped:
        forward.graph_module.graph.erase_node(n)
    forward.input_specs = [s for s in joint.input_specs if all(s is not spec for _, spec in dropped)]
    forward.graph_module.recompile()
    return train, forward


def _by_the_model(gm: torch.fx.GraphModule) -> bool:
    """Whether the model computed every value the graph returns: a loss that changes the model's output in place
    (``out.mul_(2)``) makes the export return the changed value, which a forward-only export would not."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return all(n.op != "call_function" or any(path == "model" or path.startswith("model.") for path, _ in
                                              (n.meta.get("nn_module_stack") or {}).values())
               for n in _ancestors(out))


def _keep_outputs(gm: torch.fx.GraphModule, keep: list[int], prune: bool = False) -> None:
    """Keeps the graph's outputs at ``keep``; with ``prune``, drops the nodes only the others needed (nodes that
    no output needed stay, as a fresh export keeps them)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    needed_before = _ancestors(out)
    values = list(out.args[0])
    out.args = (tuple(values[i] for i in keep),)
    if isinstance(out.meta.get("val"), (list, tuple)):
        out.meta["val"] = type(out.meta["val"])(out.meta["val"][i] for i in keep)
    if prune:
        needed = _ancestors(out)
        for node in reversed(list(gm.graph.nodes)):
            if node in needed_before and node not in needed and node.op != "placeholder" and not node.users:
                gm.graph.erase_node(node)
    gm.recompile()


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen, stack = set(), [node]
    while stack:
        for x in stack.pop().all_input_nodes:
            if x not in seen:
                seen.add(x)
                stack.append(x)
    return seen


class ExportCache:
    def __init__(self, entries: int = ENTRIES) -> None:
        self.entries = entries
        self.kept: OrderedDict[Hashable, Export] = OrderedDict()
        self.hits = 0

    def get(self, key: Hashable | None) -> Export | None:
        if key is None or key not in self.kept:
            return None
        self.kept.move_to_end(key)
        self.hits += 1
        return self.kept[key].copy()

    def remember(self, key: Hashable | None, export: Export) -> None:
        """Keeps ``export`` under ``key`` (when not None) for a later ``get``."""
        if key is not None:
            self.put(key, export)

    def put(self, key: Hashable | None, export: Export) -> Export:
        """Keeps ``export`` (when ``key`` is not None) and returns a copy to rewrite."""
        if key is None:
            return export
        self.kept[key] = export
        while len(self.kept) > self.entries:
            self.kept.popitem(last=False)
        return export.copy()


EXPORTS = ExportCache()
