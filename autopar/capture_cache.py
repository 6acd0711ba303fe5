"""Exports remembered within a process, keyed by everything that can change the exported graph.

``torch.export`` is most of a compile's time, and a process often exports the same model on the same
signature again: a second ``parallelize`` of a freshly built identical model, the ranks of a worker pool
running job after job. ``export_key`` fingerprints what the export reads and nothing it does not:

- the model's modules in order: class (so its code), every attribute (Hugging Face's config, flags,
  ``training``), the names, shapes, dtypes, devices and ``requires_grad`` of parameters and buffers, and
  the value of any plain tensor attribute (it would become a constant of the graph). Parameter and buffer
  values are not read: the export sees them as fake tensors, so no value can shape the graph;
- the inputs and target: tensors by shape, dtype, device and ``requires_grad`` (fake as well), every other
  leaf by value; the loss function (the object itself, and what its closure holds);
- whether a loss is captured and the output dtype.

A training export also answers the forward-only export of the same model on the same inputs: it is exported
once returning the loss and the model's outputs, and ``split_outputs`` cuts it into the graph of each (the
forward one without the loss's nodes and the target's inputs), kept under each one's key. ``pm(...)`` after
``pm.step`` then exports nothing.

Anything it cannot fingerprint exactly (a module with hooks, an attribute of an unknown type) makes the key
``None``: that export is not remembered. A hit returns a copy of the pristine export (new nodes and metadata;
the fake values are shared, as no pass changes one in place), so that the passes may rewrite it freely.
"""
from __future__ import annotations

import copy
import enum
import hashlib
import types
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable

import torch
from torch.utils import _pytree as pytree
from torch.export.graph_signature import InputKind, OutputKind

from autopar.passes.lazy_module import lazy

ENTRIES = 64  # exports kept (least recently used dropped first)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_state_dict_hooks", "_load_state_dict_pre_hooks", "_forward_hooks_with_kwargs",
          "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called", "_state_dict_pre_hooks",
          "_load_state_dict_post_hooks")
_SKIP = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", *_HOOKS}
_DEPTH = 6


@dataclass(frozen=True)
class ProcessLocal:
    """A value of a key that only this process can name (an object's address): such a key is not shared with
    other processes (``export_files.digest``)."""

    id: int


class _Unknown(Exception):
    """A value the key cannot hold exactly."""


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
    if not targets or any(n.users for n, _ in dropped):
        return train, None
    for n, _ in dropped:
        forward.graph_module.graph.erase_node(n)
    forward.input_specs = [s for s in joint.input_specs if all(s is not spec for _, spec in dropped)]
    forward.graph_module.recompile()
    return train, forward


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


def export_key(model: torch.nn.Module, inputs: Any, loss_fn: Any, *, with_loss: bool,
               output_dtype: torch.dtype | None) -> Hashable | None:
    """The key of an export of ``model`` on ``inputs`` (args, kwargs, target), or None where it is not exact."""
    try:
        modules = tuple((name, type(m), _attributes(m), _tensors(m)) for name, m in model.named_modules())
        return (modules, _value(inputs, fake=True), _aliases(inputs), _function(loss_fn), with_loss, output_dtype,
                torch.is_grad_enabled(), torch.get_default_dtype())
    except _Unknown:
        return None


def _aliases(inputs: Any) -> tuple:
    """For each tensor among the inputs, the first that is the same tensor and the first that shares its storage:
    a target passed as the input itself is one placeholder of the export, which the model then reads."""
    leaves = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)]
    storages = [x.untyped_storage().data_ptr() if type(x) in (torch.Tensor, torch.nn.Parameter)  # (not a fake
                and x.device.type != "meta" else -i - 1 for i, x in enumerate(leaves)]  # or meta one: no storage)
    return tuple((next(j for j, y in enumerate(leaves) if y is x), storages.index(storages[i]))
                 for i, x in enumerate(leaves))


def _attributes(m: torch.nn.Module) -> tuple:
    if any(getattr(m, h, None) for h in _HOOKS):
        raise _Unknown("hooks")
    return tuple((k, _value(v)) for k, v in sorted(vars(m).items()) if k not in _SKIP)


def _tensors(m: torch.nn.Module) -> tuple:
    def spec(t: torch.Tensor | None) -> Any:
        return None if t is None else (tuple(t.shape), t.dtype, t.device.type, t.requires_grad)
    return (tuple((k, spec(t)) for k, t in m._parameters.items()),
            tuple((k, spec(t), k in m._non_persistent_buffers_set) for k, t in m._buffers.items()))


def _value(v: Any, depth: int = 0, fake: bool = False) -> Any:
    """``v`` as a hashable value that is equal exactly when ``v`` is (tensors by value unless ``fake``)."""
    if depth > _DEPTH:
        raise _Unknown("too deep")
    if v is None or isinstance(v, (bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size)):
        return (type(v), v)
    if isinstance(v, torch.Tensor):
        if fake or v.device.type == "meta":
            return ("tensor", tuple(v.shape), v.dtype, v.device.type, v.requires_grad)
        data = v.detach().cpu().contiguous()
        return ("tensor", tuple(v.shape), v.dtype, hashlib.blake2b(data.view(torch.uint8).numpy()
                                                                   if data.numel() else b"").hexdigest())
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_value(x, depth + 1, fake) for x in v))
    if isinstance(v, dict):
        return (type(v), tuple((_value(k, depth + 1), _value(x, depth + 1, fake)) for k, x in v.items()))
    if isinstance(v, (set, frozenset)):
        return (type(v), frozenset(_value(x, depth + 1) for x in v))
    if isinstance(v, type) or callable(v) and hasattr(v, "__code__"):
        return _function(v)
    if isinstance(v, types.BuiltinFunctionType) and (v.__self__ is None or isinstance(v.__self__, types.ModuleType)):
        return ("builtin", v)  # a function of a C module (F.gelu): stateless
    if isinstance(v, torch.nn.Module):
        return ("module", ProcessLocal(id(v)))  # a submodule: fingerprinted in its own place among the modules
    if isinstance(v, enum.Enum):
        return (type(v), v.value)
    if hasattr(v, "__dict__") and not hasattr(type(v), "__slots__"):  # a plain object (a model's config)
        return (type(v), tuple((k, _value(x, depth + 1)) for k, x in sorted(vars(v).items())))
    raise _Unknown(type(v).__name__)


def _function(f: Any) -> Any:
    """A function or class: the object itself (its code), and what its closure and defaults hold."""
    if f is None or isinstance(f, type):
        return f
    if not hasattr(f, "__code__"):
        raise _Unknown(type(f).__name__)
    cells = tuple(_value(c.cell_contents) for c in (f.__closure__ or ()))
    return (f, cells, _value(f.__defaults__), _value(f.__kwdefaults__))
