"""Walking the model's graph for its profile: symbolic capture, repeated layers, segments, matched nodes.

``repeated_lists`` finds module lists of identical entries and ``shortened``
cuts them to ``KEEP`` entries while the model is captured;
``segment_of_nodes`` names every compute node's segment (``"head"``, a layer
such as ``"transformer.h.3"``, ``"tail"``); ``match_nodes`` pairs the operators
of two captures of the same model, and ``by_segment`` groups a lowered
graph's nodes by the segment of the captured node they came from.

Invariant: nothing here changes a graph or a module, except ``shortened``,
whose model is whole again when its ``with`` block ends. No sympy here: the
symbolic quantities live in ``autopar/planner/profile_formulas.py``.
"""
from __future__ import annotations

import contextlib
import operator
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch.export import Dim
from torch.utils import _pytree as pytree

from autopar.core.errors import CaptureError
from autopar.core.graph import PREFIX
from autopar.passes.stage_cuts import node_layer

ORIGIN = "autopar.origin"  # meta key: the captured node a lowered node came from
KEEP = 2  # entries of a repeated module list kept while capturing


# ---------------------------------------------------------------------------
# capture
# ---------------------------------------------------------------------------

class _Call(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model  # PREFIX: parameter names read "model.<name>"

    def forward(self, args: tuple, kwargs: dict) -> Any:
        return self.model(*args, **kwargs)


def _signature(module: torch.nn.Module) -> tuple:
    return (type(module), tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()))


def repeated_lists(model: torch.nn.Module) -> dict[str, int]:
    """``{path: length}`` of module lists of 3+ entries that have the same type and parameter shapes.

    The first entry may differ in its parameters when the 3+ after it are alike
    (T5's first block also holds the relative position bias): see ``distinct_first``.
    """
    found: dict[str, int] = {}
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) <= KEEP:
            continue
        if any(path.startswith(p + ".") for p in found):
            continue
        entries = list(module)
        rest = entries[1:] if _first_differs(entries) else entries
        if any(True for _ in rest[0].parameters()) and all(_signature(e) == _signature(rest[0]) for e in rest):
            found[path] = len(entries)
    return found


def _first_differs(entries: list[torch.nn.Module]) -> bool:
    return (len(entries) > KEEP + 1 and type(entries[0]) is type(entries[1])
            and _signature(entries[0]) != _signature(entries[1]))


def distinct_first(model: torch.nn.Module, lists: dict[str, int]) -> set[str]:
    """The lists of ``lists`` whose first entry differs from the others (it is profiled on its own)."""
    return {path for path in lists if _first_differs(list(model.get_submodule(path)))}


@contextlib.contextmanager
def shortened(model: torch.nn.Module, lists: dict[str, int]) -> Iterator[None]:
    """The model with each list of ``lists`` cut to its first ``KEEP`` entries (restored on exit)."""
    saved = []
    for path in lists:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        original = getattr(parent, name)
        saved.append((parent, name, original))
        setattr(parent, name, torch.nn.ModuleList(list(original)[:KEEP]))
    try:
        yield
    finally:
        for parent, name, original in saved:
            setattr(parent, name, original)


def dynamic_export(model: torch.nn.Module, args: tuple, kwargs: dict, seq: bool) -> torch.export.ExportedProgram:
    """``model`` exported with a free batch dim 0 (and sequence dim 1 when ``seq``) on every tensor input."""
    def spec(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            return {0: Dim.AUTO, **({1: Dim.AUTO} if seq and x.dim() >= 2 else {})}
        return None

    dynamic = (pytree.tree_map(spec, args), pytree.tree_map(spec, kwargs))
    try:
        return torch.export.export(_Call(model), (args, kwargs), dynamic_shapes=dynamic, strict=False)
    except Exception as e:  # noqa: BLE001 - every export failure is reported the same way
        raise CaptureError(f"torch.export could not capture {type(model).__name__} with symbolic batch and "
                           "sequence sizes", cause=e,
                           hint="the planner needs the model to export with a free batch dim 0 (and sequence "
                           "dim 1); pass example_inputs whose dim 0 is the batch") from e


def placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes that run an operator (not getitem, not symbolic-size arithmetic)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem
            and isinstance(n.meta.get("val"), (torch.Tensor, tuple, list))]


def param_names(ep: torch.export.ExportedProgram) -> dict[fx.Node, str]:
    """Parameter placeholders of ``ep`` -> the model's parameter names."""
    out = {}
    for node, spec in zip(placeholders(ep.graph_module), ep.graph_signature.input_specs):
        if spec.kind.name == "PARAMETER":
            out[node] = spec.target.removeprefix(PREFIX)
    return out


# ---------------------------------------------------------------------------
# segments
# ---------------------------------------------------------------------------

def segment_of_nodes(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Every compute node's segment: its layer, ``"head"`` before the first layer, ``"tail"`` after the last.

    Nodes between two layers belong to the next layer.
    """
    nodes = compute_nodes(gm)
    layers = [node_layer(n) for n in nodes]
    out: dict[fx.Node, str] = {}
    following = "tail"
    for node, layer in zip(reversed(nodes), reversed(layers)):
        if layer is not None:
            following = layer
        out[node] = layer or following
    seen_layer = False
    for node, layer in zip(nodes, layers):
        seen_layer = seen_layer or layer is not None
        if not seen_layer:
            out[node] = "head"
    for node in gm.graph.nodes:  # getitems follow their producer
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in out:
            out[node] = out[node.args[0]]
    return out


def family(layer: str) -> str:
    """``"transformer.h"`` for the layer ``"transformer.h.3"``: the module list it is an entry of."""
    return layer.rsplit(".", 1)[0]


def representatives(order: list[str], lists: dict[str, int],
                    distinct: set[str] = frozenset()) -> tuple[set[str], dict[str, int]]:
    """Which captured segments stand for others, and how many they stand for.

    A shortened list's last captured entry stands for all its entries, or for
    all but the first when the first differs (``distinct``): that one counts once.
    """
    keep, count = set(), {}
    by_family: dict[str, list[str]] = {}
    for key in order:
        if key in ("head", "tail"):
            keep.add(key)
            count[key] = 1
        else:
            by_family.setdefault(family(key), []).append(key)
    for name, keys in by_family.items():
        if name in distinct and len(keys) > 1:
            keep.update((keys[0], keys[-1]))
            count[keys[0]], count[keys[-1]] = 1, lists[name] - 1
        elif name in lists:
            keep.add(keys[-1])
            count[keys[-1]] = lists[name]
        else:
            keep.update(keys)
            count.update(dict.fromkeys(keys, 1))
    return keep, count


def segment_params(nodes: list[fx.Node], param_nodes: dict[fx.Node, str]) -> list[str]:
    """Names of the parameters that ``nodes`` use, in placeholder order."""
    members = set(nodes)
    return list(dict.fromkeys(name for pnode, name in param_nodes.items() if any(u in members for u in pnode.users)))


# ---------------------------------------------------------------------------
# one capture against another
# ---------------------------------------------------------------------------

def match_nodes(gm: fx.GraphModule, seg_of: dict[fx.Node, str], other: fx.GraphModule,
                other_seg: dict[fx.Node, str]) -> dict[str, str]:
    """Node names of ``gm`` -> names of the same operators in ``other`` (another capture of the same model).

    The k-th call of an operator in a segment matches the k-th call of it in
    the same segment of the other graph; calls without a counterpart (a
    no-op slice one capture leaves out) are not matched.
    """
    def keyed(g: fx.GraphModule, seg: dict[fx.Node, str]) -> dict[tuple, str]:
        seen: dict[tuple, int] = {}
        out = {}
        for node in compute_nodes(g):
            base = (seg.get(node, "head"), str(node.target))
            k = seen[base] = seen.get(base, -1) + 1
            out[(*base, k)] = node.name
        return out

    mine, theirs = keyed(gm, seg_of), keyed(other, other_seg)
    return {name: theirs[key] for key, name in mine.items() if key in theirs}


def by_segment(lowered: fx.GraphModule, seg_by_name: dict[str, str]) -> dict[str, list[fx.Node]]:
    """Lowered compute nodes by segment; an inserted collective goes with the value it converts, or, converting a
    parameter, with the node that uses it."""
    out: dict[str, list[fx.Node]] = {}
    for node in compute_nodes(lowered):
        source = node
        while source.meta.get(ORIGIN) is None and source.all_input_nodes:
            source = source.all_input_nodes[0]
        if source.op == "placeholder":  # on a parameter (a norm's weight under sequence parallelism): with its user
            source = node
            while source.meta.get(ORIGIN) is None and source.users:
                source = next(iter(source.users))
        out.setdefault(seg_by_name.get(source.meta.get(ORIGIN), "head"), []).append(node)
    return out
