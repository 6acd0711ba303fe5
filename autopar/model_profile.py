"""The model's costs, read from its own graph once and kept as sympy expressions in batch and sequence.

``profile_model(model, ...)`` captures the model twice at a small shape: once
with symbolic batch and sequence sizes (``torch.export`` dynamic shapes, so
every shape is a sympy expression in ``b`` and ``s``), and once per
tensor-parallel size with static shapes, through autopar's own sharding solver
and lowering (``passes/tensor_parallel.py``). From those graphs it keeps, per
*segment* (the nodes before the first repeated layer, one of each kind of
repeated layer, the nodes after the last):

- parameter elements per rank at every tp size (the solver's placements);
- forward FLOPs (``passes/cost.py`` per node, sympy in ``b``, ``s``);
- the tensors autograd saves for backward, found by running the graph on
  fake tensors under ``saved_tensors_hooks`` (so what a custom op saves is
  counted, not guessed), split into per-token tensors and the attention
  internals a fused (flash-style) kernel would not keep;
- the elements that enter the segment (what a pipeline stage receives, and
  what activation recomputation stores);
- the tensor-parallel collectives per microbatch, with their elements;
- the operator count (what per-operator overhead costs).

Repeated layers are the children of module lists whose entries have the same
type and parameter shapes (``passes/blocks.py`` names them by the list index).
To keep capture fast for deep models, such a list is shortened to two entries
while the graph is captured, and the second entry's numbers stand for every
entry; ``profile_model(..., shorten=False)`` captures the whole model.

Invariant: a segment's numbers at tp size ``n`` are those of the rank graphs
autopar itself would run (placements, collectives, local shapes); only the
dependence on ``b`` and ``s`` is taken from the symbolic graph.
"""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field
from typing import Any, Iterator

import sympy
import torch
import torch.fx as fx
from torch.distributed.tensor import Shard
from torch.export import Dim
from torch.utils import _pytree as pytree

from autopar.capture import PREFIX, capture, tied_aliases
from autopar.errors import CaptureError
from passes.cost import node_cost
from passes.pipeline import module_path
from passes.tensor_parallel import BACKWARD, FORWARD, tensor_parallel

b_sym, s_sym = sympy.symbols("b s", positive=True, integer=True)
ORIGIN = "autopar.origin"  # meta key: the captured node a lowered node came from
KEEP = 2  # entries of a repeated module list kept while capturing


@dataclass(frozen=True)
class Collective:
    """A tensor-parallel collective of one microbatch: ``op`` in ``direction``, moving ``elements`` per rank."""

    op: str
    direction: str  # "forward" | "backward"
    elements: sympy.Expr


@dataclass
class Part:
    """One segment's numbers at one tp size (per rank, per microbatch of ``b`` sequences of ``s`` tokens)."""

    params: dict[str, int]  # parameter -> elements this rank stores
    trainable: set[str]
    flops: sympy.Expr  # forward
    narrow: sympy.Expr  # sum over matmuls with a parameter of FLOPs / (narrower local weight dim): small-GEMM cost
    saved: sympy.Expr  # elements of floating tensors saved for backward (per-token part)
    saved_other: sympy.Expr  # bytes of other saved tensors (indices, masks)
    attention: sympy.Expr  # elements of attention internals saved (the attention matrix on the math path)
    attention_fused: sympy.Expr  # elements a fused attention kernel keeps instead (its output and log-sum-exp)
    collectives: list[Collective]
    ops: int

    @property
    def param_elements(self) -> int:
        return sum(self.params.values())

    @property
    def trainable_elements(self) -> int:
        return sum(v for k, v in self.params.items() if k in self.trainable)


@dataclass
class Segment:
    """Nodes of the graph that a pipeline cut never splits: the head, one repeated layer, or the tail."""

    name: str
    kind: str  # "head" | "layer" | "tail"
    count: int  # how many times it repeats (layers of one kind)
    entering: sympy.Expr  # floating elements produced before the segment and used in it
    parts: dict[int, Part] = field(default_factory=dict)  # by tp size


@dataclass
class ModelProfile:
    """What the planner knows about a model: its segments in execution order, at every tp size analyzed."""

    name: str
    segments: list[Segment]
    tp_sizes: tuple[int, ...]
    total_params: int
    dtype: torch.dtype
    has_sequence: bool
    notes: list[str] = field(default_factory=list)

    def sequence(self) -> list[Segment]:
        """Segments as they run: the head, every layer (repeats expanded), the tail."""
        return [seg for seg in self.segments for _ in range(seg.count)]

    @property
    def layers(self) -> list[Segment]:
        return [seg for seg in self.segments if seg.kind == "layer"]

    def part(self, segment: Segment, tp: int) -> Part:
        if tp not in segment.parts:
            raise ValueError(f"tp={tp} was not analyzed; the profile has tp sizes {list(self.tp_sizes)} "
                             f"(pass tp_sizes=... to profile_model)")
        return segment.parts[tp]


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
    """``{path: length}`` of module lists of 3+ entries that have the same type and parameter shapes."""
    found: dict[str, int] = {}
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) <= KEEP:
            continue
        if any(path.startswith(p + ".") for p in found):
            continue
        entries = list(module)
        if any(True for _ in entries[0].parameters()) and all(_signature(e) == _signature(entries[0]) for e in entries):
            found[path] = len(entries)
    return found


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


def _dynamic_export(model: torch.nn.Module, args: tuple, kwargs: dict, seq: bool) -> torch.export.ExportedProgram:
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


def _to_sympy(x: Any, names: dict[sympy.Symbol, sympy.Symbol]) -> sympy.Expr:
    if isinstance(x, torch.SymInt):
        return sympy.expand(x.node.expr.xreplace(names))
    return sympy.Integer(int(x))


def _symbols(ep: torch.export.ExportedProgram, seq: bool) -> dict[sympy.Symbol, sympy.Symbol]:
    """Export's symbols for the first input's dims 0 and 1 -> ``b`` and ``s``."""
    user = [n for n, spec in zip(_placeholders(ep.graph_module), ep.graph_signature.input_specs)
            if spec.kind.name == "USER_INPUT" and isinstance(n.meta.get("val"), torch.Tensor)]
    if not user:
        raise ValueError("the model has no tensor input; the planner needs one whose dim 0 is the batch")
    shape = user[0].meta["val"].shape
    out = {}
    for dim, symbol in [(0, b_sym), (1, s_sym)][: 2 if seq else 1]:
        if dim >= len(shape) or not isinstance(shape[dim], torch.SymInt):
            what = "batch" if dim == 0 else "sequence"
            raise ValueError(f"export fixed the {what} size of the first input (dim {dim}); the planner needs it free. "
                             f"Pass example_inputs whose dim {dim} can vary (batch and sequence sizes >= 2)"
                             + ("" if dim == 0 else ", or seq_len=None for a model without a sequence"))
        out[shape[dim].node.expr] = symbol
    return out


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _compute(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes that run an operator (not getitem, not symbolic-size arithmetic)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem
            and isinstance(n.meta.get("val"), (torch.Tensor, tuple, list))]


# ---------------------------------------------------------------------------
# segments
# ---------------------------------------------------------------------------

def _layer_of(node: fx.Node) -> str | None:
    """``"transformer.h.3"`` for a node inside entry 3 of a module list, else None."""
    for path in module_path(node):
        parts = path.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                return ".".join(parts[: i + 1])
    return None


def segment_of_nodes(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Every compute node's segment: its layer, ``"head"`` before the first layer, ``"tail"`` after the last.

    Nodes between two layers belong to the next layer.
    """
    nodes = _compute(gm)
    layers = [_layer_of(n) for n in nodes]
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


def _family(layer: str) -> str:
    return layer.rsplit(".", 1)[0]


# ---------------------------------------------------------------------------
# what autograd saves
# ---------------------------------------------------------------------------

@dataclass
class _Saved:
    saver: fx.Node
    producer: fx.Node | None  # None: made inside the saving op (e.g. attention probabilities)
    elements: Any
    floating: bool
    itemsize: int


class _SavedTensors(fx.Interpreter):
    """Runs a graph on fake tensors with autograd on; records each tensor saved for backward once."""

    def __init__(self, gm: fx.GraphModule, params: set[fx.Node]) -> None:
        super().__init__(gm)
        self.params = params
        self.current: fx.Node | None = None
        self.producer: dict[int, fx.Node] = {}
        self.param_ids: set[int] = set()
        self.saved: dict[int, _Saved] = {}
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
        return out

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if kwargs.get("device") == torch.device("meta"):  # a meta-device model runs as fake CPU tensors
            kwargs = {**kwargs, "device": torch.device("cpu")}
        return super().call_function(target, args, kwargs)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        key = id(base)
        if key in self.param_ids or key in self.saved:
            return t
        self.keep.append(base)
        self.saved[key] = _Saved(self.current, self.producer.get(key), base.numel(), base.is_floating_point(),
                                 base.element_size())
        return t


def saved_tensors(gm: fx.GraphModule, params: set[fx.Node], trainable: set[fx.Node]) -> _SavedTensors:
    """What autograd keeps for backward when ``gm`` runs (fake tensors on the CPU, shapes as in ``meta["val"]``)."""
    placeholders = _placeholders(gm)
    vals = [n.meta.get("val") for n in placeholders]
    fake_mode = next((v.fake_mode for v in vals if hasattr(v, "fake_mode")), None)
    interp = _SavedTensors(gm, params)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        args = []
        for node, v in zip(placeholders, vals):
            if not isinstance(v, torch.Tensor):
                args.append(v)
                continue
            t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cpu")
            args.append(t.requires_grad_() if node in trainable and v.is_floating_point() else t)
        with torch.autograd.graph.saved_tensors_hooks(interp.pack, lambda t: t):
            interp.run(*args)
    return interp


# ---------------------------------------------------------------------------
# profile
# ---------------------------------------------------------------------------

def default_inputs(model: torch.nn.Module, batch: int = 2, seq: int = 16) -> tuple:
    """Token ids ``(batch, seq)`` for a model with input embeddings (Hugging Face models)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is None:
        raise ValueError(f"cannot tell the inputs of {type(model).__name__}; pass example_inputs=(x,) with the batch "
                         "in dim 0 (and the sequence in dim 1)")
    device = next(model.parameters()).device
    return (torch.zeros(batch, seq, dtype=torch.long, device=device),)


def profile_model(model: torch.nn.Module, *, example_inputs: tuple | None = None,
                  example_kwargs: dict | None = None, sequence: bool = True,
                  tp_sizes: tuple[int, ...] = (1, 2, 4, 8), shorten: bool = True) -> ModelProfile:
    """Captures ``model`` (meta-device models work) and returns its ``ModelProfile``.

    ``example_inputs``: a small batch (dim 0 batch, dim 1 sequence when
    ``sequence``); default: token ids of shape (2, 16). ``tp_sizes``: the
    tensor-parallel sizes to analyze (sizes the model's shapes do not allow are
    dropped, with a note).
    """
    args = tuple(example_inputs) if example_inputs is not None else default_inputs(model)
    kwargs = example_kwargs or {}
    lists = repeated_lists(model) if shorten else {}
    notes = [f"{path}: {n} identical entries; {KEEP} captured, the last standing for all" for path, n in lists.items()]
    with shortened(model, lists):
        analysis = _Analysis(model, _dynamic_export(model, args, kwargs, sequence), sequence, lists)
        sizes = [1]
        for n in sorted(set(tp_sizes) - {1}):
            try:
                analysis.add_tensor_parallel(args, kwargs, n)
                sizes.append(n)
            except Exception as e:  # noqa: BLE001 - a tp size the solver cannot handle is left out, with the reason
                notes.append(f"tp={n} not analyzed: {type(e).__name__}: {str(e).strip().splitlines()[0]}")
    params = dict(model.named_parameters())
    return ModelProfile(name=type(model).__name__, segments=analysis.segments, tp_sizes=tuple(sizes),
                        total_params=sum(p.numel() for p in params.values()),
                        dtype=next(iter(params.values())).dtype if params else torch.float32,
                        has_sequence=sequence, notes=notes)


def _param_names(ep: torch.export.ExportedProgram) -> dict[fx.Node, str]:
    out = {}
    for node, spec in zip(_placeholders(ep.graph_module), ep.graph_signature.input_specs):
        if spec.kind.name == "PARAMETER":
            out[node] = spec.target.removeprefix(PREFIX)
    return out


class _Analysis:
    """The symbolic graph of a (shortened) model, its segments, and what autograd saves in it."""

    def __init__(self, model: torch.nn.Module, ep: torch.export.ExportedProgram, sequence: bool,
                 lists: dict[str, int]) -> None:
        self.model = model
        self.gm = ep.graph_module
        self.sequence = sequence
        self.names = _symbols(ep, sequence)
        self.seg_of = segment_of_nodes(self.gm)
        aliases = tied_aliases(model)
        self.param_nodes = {nd: aliases.get(name, name) for nd, name in _param_names(ep).items()}
        self.requires = {n: p.requires_grad for n, p in model.named_parameters()}
        self.numel = {n: p.numel() for n, p in model.named_parameters()}
        trainable = {nd for nd, name in self.param_nodes.items() if self.requires.get(name, True)}
        self.saved = saved_tensors(self.gm, set(self.param_nodes), trainable)
        order = list(dict.fromkeys(self.seg_of[n] for n in _compute(self.gm)))
        keep, count = _representatives(order, lists)
        self.keys = [k for k in order if k in keep]
        self.nodes = {k: [n for n in _compute(self.gm) if self.seg_of[n] == k] for k in self.keys}
        self.segments = [self._segment(k, count[k]) for k in self.keys]

    def _segment(self, key: str, count: int) -> Segment:
        kind = key if key in ("head", "tail") else "layer"
        params = _segment_params(self.nodes[key], self.param_nodes)
        widths = {nd.name: w for nd in self.nodes[key] if (w := weight_width(nd, set(self.param_nodes)))}
        part = self._part(key, {n: self.numel[n] for n in params if n in self.numel}, {}, {}, len(self.nodes[key]),
                          widths)
        name = f"{_family(key)}.*" if count > 1 else key
        return Segment(name=name, kind=kind, count=count, entering=_entering(set(self.nodes[key]), self.names),
                       parts={1: part})

    def _part(self, key: str, params: dict[str, int], flops_factor: dict[str, Any], act_factor: dict[str, Any],
              ops: int, widths: dict[str, int]) -> Part:
        """Segment ``key``'s numbers, each node's FLOPs and saved tensors scaled by its local/full factor."""
        nodes = self.nodes[key]
        flops = {nd: _to_sympy(node_cost(nd).flops, self.names) * flops_factor.get(nd.name, 1) for nd in nodes}
        zero = sympy.Integer(0)
        narrow = sum((f / widths[nd.name] for nd, f in flops.items() if nd.name in widths), zero)
        part = Part(params=params, trainable={n for n in params if self.requires.get(n, True)},
                    flops=sum(flops.values(), zero), narrow=narrow, saved=zero, saved_other=zero, attention=zero,
                    attention_fused=zero, collectives=[], ops=ops)
        _add_saved(part, self.saved, set(nodes), self.names, act_factor)
        if key == "tail":
            part.saved += _output_elements(self.gm, self.names)  # a loss keeps the outputs (log-softmax of logits)
        return part

    def add_tensor_parallel(self, args: tuple, kwargs: dict, n: int) -> None:
        """Each segment's ``Part`` at tp size ``n``, from autopar's own solver and lowering of a static capture."""
        cap = capture(self.model, args, kwargs)
        static_seg = segment_of_nodes(cap.gm)
        flops, numel = {}, {}
        for node in cap.gm.graph.nodes:
            node.meta[ORIGIN] = node.name
            flops[node.name] = node_cost(node).flops if node.op == "call_function" else 0
            numel[node.name] = _numel(node.meta.get("val"))
        same = _match(self.gm, self.seg_of, cap.gm, static_seg)  # symbolic node name -> static node name
        tp = tensor_parallel(cap, n, {k for k, v in self.requires.items() if v})
        lowered = tp.graphs[0]
        local_flops: dict[str, int] = {}
        local_numel: dict[str, int] = {}
        local_width: dict[str, int] = {}
        lowered_params = {nd for nd in lowered.graph.nodes if nd.op == "placeholder"}
        for node in lowered.graph.nodes:
            origin = node.meta.get(ORIGIN)
            if origin is not None and node.op == "call_function":
                local_flops[origin] = local_flops.get(origin, 0) + node_cost(node).flops
                local_numel.setdefault(origin, _numel(node.meta.get("val")))
                width = weight_width(node, lowered_params)
                if width:
                    local_width[origin] = width
        flops_factor = {k: sympy.Rational(local_flops.get(o, flops[o]), flops[o]) for k, o in same.items() if flops[o]}
        act_factor = {k: sympy.Rational(local_numel.get(o, numel[o]), numel[o]) for k, o in same.items() if numel[o]}
        first = next(a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor))
        static_tokens = first.shape[0] * (first.shape[1] if self.sequence and first.dim() >= 2 else 1)
        tokens = b_sym * (s_sym if self.sequence and first.dim() >= 2 else 1) / sympy.Integer(static_tokens)
        by_key = _by_segment(lowered, {nd.name: key for nd, key in static_seg.items()})
        for key, seg in zip(self.keys, self.segments):
            params = {name: (e // n if isinstance(tp.placements.get(name), Shard) else e)
                      for name, e in seg.parts[1].params.items()}
            widths = {k: local_width[o] for k, o in same.items() if o in local_width}
            part = self._part(key, params, flops_factor, act_factor, len(by_key.get(key, [])), widths)
            part.collectives = _collectives(by_key.get(key, []), n, tokens)
            seg.parts[n] = part


_MATMULS = {"aten.addmm.default": 2, "aten.mm.default": 1, "aten.linear.default": 1, "aten.matmul.default": 1}
_VIEWS = ("aten.t.default", "aten.transpose.int", "aten.permute.default", "aten.view.default",
          "aten.reshape.default", "aten.alias.default", "aten.detach.default", "aten._unsafe_view.default")


def weight_width(node: fx.Node, params: set[fx.Node]) -> int | None:
    """The narrower dim of a matmul's weight when the weight is a parameter (or a view of one), else None.

    Large matrix multiplications reach a larger fraction of peak than narrow
    ones; the planner charges each matmul by this width (``Cluster.narrow``).
    """
    position = _MATMULS.get(str(node.target))
    if position is None or len(node.args) <= position or not isinstance(node.args[position], fx.Node):
        return None
    weight = node.args[position]
    source = weight
    while source.op == "call_function" and str(source.target) in _VIEWS:
        source = source.args[0]
    val = weight.meta.get("val")
    if source not in params or not isinstance(val, torch.Tensor) or val.dim() < 2:
        return None
    return int(min(val.shape[-2:]))


def _collectives(nodes: list[fx.Node], n: int, tokens: sympy.Expr) -> list[Collective]:
    """The tp collectives (forward and backward) of lowered ``nodes``, elements scaled from the static shape."""
    out = []
    for node in nodes:
        if getattr(node.target, "namespace", None) != "autopar":
            continue
        name = node.target._opname
        local = _numel(node.meta.get("val"))
        whole = local * n if name in ("chunk", "reduce_scatter") else local  # elements of the unsharded tensor
        for direction, table in (("forward", FORWARD), ("backward", BACKWARD)):
            if table.get(name) and (direction == "forward" or node.meta.get("autopar.needs_grad", True)):
                out.append(Collective(table[name], direction, sympy.expand(whole * tokens)))
    return out


def _by_segment(lowered: fx.GraphModule, seg_by_name: dict[str, str]) -> dict[str, list[fx.Node]]:
    """Lowered compute nodes by segment; an inserted collective goes with the value it converts."""
    out: dict[str, list[fx.Node]] = {}
    for node in _compute(lowered):
        source = node
        while source.meta.get(ORIGIN) is None and source.all_input_nodes:
            source = source.all_input_nodes[0]
        out.setdefault(seg_by_name.get(source.meta.get(ORIGIN), "head"), []).append(node)
    return out


def _match(gm: fx.GraphModule, seg_of: dict[fx.Node, str], other: fx.GraphModule,
           other_seg: dict[fx.Node, str]) -> dict[str, str]:
    """Node names of ``gm`` -> names of the same operators in ``other`` (another capture of the same model).

    The k-th call of an operator in a segment matches the k-th call of it in
    the same segment of the other graph; calls without a counterpart (a
    no-op slice one capture leaves out) are not matched.
    """
    def keyed(g: fx.GraphModule, seg: dict[fx.Node, str]) -> dict[tuple, str]:
        seen: dict[tuple, int] = {}
        out = {}
        for node in _compute(g):
            base = (seg.get(node, "head"), str(node.target))
            k = seen[base] = seen.get(base, -1) + 1
            out[(*base, k)] = node.name
        return out

    mine, theirs = keyed(gm, seg_of), keyed(other, other_seg)
    return {name: theirs[key] for key, name in mine.items() if key in theirs}


def _numel(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel()
    if isinstance(val, (tuple, list)):
        return sum(_numel(v) for v in val)
    return 0


def _representatives(order: list[str], lists: dict[str, int]) -> tuple[set[str], dict[str, int]]:
    """Which captured segments stand for others, and how many they stand for."""
    keep, count = set(), {}
    by_family: dict[str, list[str]] = {}
    for key in order:
        if key in ("head", "tail"):
            keep.add(key)
            count[key] = 1
        else:
            by_family.setdefault(_family(key), []).append(key)
    for family, keys in by_family.items():
        if family in lists:  # a shortened list: its last captured entry stands for all of them
            keep.add(keys[-1])
            count[keys[-1]] = lists[family]
        else:
            keep.update(keys)
            count.update(dict.fromkeys(keys, 1))
    return keep, count


def _segment_params(nodes: list[fx.Node], param_nodes: dict[fx.Node, str]) -> list[str]:
    members = set(nodes)
    return list(dict.fromkeys(name for pnode, name in param_nodes.items() if any(u in members for u in pnode.users)))


def _add_saved(part: Part, saved: _SavedTensors, nodes: set[fx.Node], names: dict,
               factors: dict[str, float]) -> None:
    """Adds the tensors saved by ``nodes`` to ``part``; ``factors``: local/full size by producing node name."""
    for rec in saved.saved.values():
        if rec.saver not in nodes:
            continue
        owner = rec.producer if rec.producer is not None else rec.saver
        elements = _to_sympy(rec.elements, names) * factors.get(owner.name, 1)
        if not rec.floating:
            part.saved_other += elements * rec.itemsize
        elif rec.producer is None and "scaled_dot_product" in str(rec.saver.target):
            part.attention += elements
        else:
            part.saved += elements
    for node in nodes:
        if "scaled_dot_product" in str(node.target):
            q, out = node.args[0].meta["val"], node.meta["val"]
            lse = _to_sympy(q.numel(), names) / _to_sympy(q.shape[-1], names)  # one float per query and head
            part.attention_fused += sympy.expand((lse + _to_sympy(out.numel(), names)) * factors.get(node.name, 1))


def _entering(nodes: set[fx.Node], names: dict) -> sympy.Expr:
    """Floating elements made outside ``nodes`` (not parameters or inputs) and used by them."""
    total = sympy.Integer(0)
    seen = set()
    for node in nodes:
        for arg in node.all_input_nodes:
            val = arg.meta.get("val")
            made_by = arg.args[0] if arg.target is operator.getitem else arg
            if (made_by in nodes or arg in seen or arg.op != "call_function" or not isinstance(val, torch.Tensor)
                    or not val.is_floating_point()):
                continue
            seen.add(arg)
            total += _to_sympy(val.numel(), names)
    return total


def _output_elements(gm: fx.GraphModule, names: dict) -> sympy.Expr:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    total = sympy.Integer(0)
    for arg in pytree.tree_leaves(out.args):
        val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
        if isinstance(val, torch.Tensor) and val.is_floating_point() and val.dim() > 0:
            total += _to_sympy(val.numel(), names)
    return total


