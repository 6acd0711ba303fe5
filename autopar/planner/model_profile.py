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
- the weight matmuls whose gradient a split backward (zero-bubble
  schedules) leaves for ``W``, per parameter (``passes/split_backward.py``'s rule);
- the operator count (what per-operator overhead costs).

Repeated layers are the children of module lists whose entries have the same
type and parameter shapes (``passes/blocks.py`` names them by the list index).
To keep capture fast for deep models, such a list is shortened to two entries
while the graph is captured, and the second entry's numbers stand for every
entry; ``profile_model(..., shorten=False)`` captures the whole model.

Invariant: a segment's numbers at tp size ``n`` are those of the rank graphs
autopar itself would run (placements, collectives, local shapes); only the
dependence on ``b`` and ``s`` is taken from the symbolic graph.

The graph walking (symbolic capture, repeated layers, segments, matching one
capture against another) is in ``autopar/planner/profile_graph.py``; the quantities in
``b`` and ``s`` (saved tensors, entering elements, matmul widths) are in
``autopar/planner/profile_formulas.py``. This module holds the profile's values and
puts the two together.
"""
from __future__ import annotations

import math

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.distributed.tensor import Shard
from torch.utils import _pytree as pytree

from autopar.compiler.capture import capture
from autopar.core.buffer_writes import written_placeholders
from autopar.core.comm import OPS
from autopar.core.graph import PREFIX, SlotKind, tied_aliases
from autopar.planner.example_inputs import model_inputs
from autopar.planner.expert_cost import ExpertProfile, expert_profile, grouped_while_profiling
from autopar.planner.fake_cpu import as_fake_cpu, fake_inputs
from autopar.core.recompute_modes import COMMUNICATING
from autopar.planner.profile_formulas import (b_sym, entering_elements, export_symbols, kept_elements, moved_elements,
                                              ring_elements,
                                              numel_of, output_elements, s_sym, saved_elements, to_sympy,
                                              weight_width)
from autopar.passes.constant_masks import evaluate_constant, mask_kind
from autopar.passes.context_eager import sdpa_from_eager
from autopar.passes.context_checks import BATCHED_MATMULS, SOFTMAXES
from autopar.passes.saved import saved_tensors
from autopar.planner.profile_graph import (KEEP, ORIGIN, by_segment, compute_nodes, distinct_first, dynamic_export, family,
                                   match_nodes, param_names, repeated_lists, representatives, segment_of_nodes,
                                   segment_params, shortened)
from autopar.passes.cost import node_cost, requires_grad
from autopar.passes.split_backward import deferred_weight
from autopar.passes.tensor_parallel import VIEWS, collective_calls, tensor_parallel


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
    traffic: sympy.Expr  # elements read and written by the forward's memory-bound operators (not matmuls)
    saved: sympy.Expr  # elements of floating tensors saved for backward (per-token part)
    saved_other: sympy.Expr  # bytes of other saved tensors (indices, masks)
    attention: sympy.Expr  # elements of attention internals saved (the attention matrix on the math path)
    attention_fused: sympy.Expr  # elements a fused attention kernel keeps instead (its output and log-sum-exp)
    collectives: list[Collective]
    ops: int
    kept_selective: sympy.Expr = sympy.Integer(0)  # elements of matmul and attention outputs (selective keeps them)
    communicated: sympy.Expr = sympy.Integer(0)  # elements of tp collectives' forward outputs (recomputation keeps)
    deferred: dict[str, int] = field(default_factory=dict)  # parameter -> its matmuls whose gradient W computes
    entering: sympy.Expr | None = None  # sequence parallelism: elements entering, as sharded (None: the segment's)
    ring_kv: sympy.Expr = sympy.Integer(0)  # elements of the attentions' K and V (a cp ring's block per step)
    attention_flops: sympy.Expr = sympy.Integer(0)  # forward FLOPs of the attentions (a cp ring overlaps them)

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
    entering_head: sympy.Expr = sympy.Integer(0)  # the part the head made (RoPE's cos, sin): one tensor, all layers
    parts: dict[int, Part] = field(default_factory=dict)  # by tp size
    sequence_parallel: dict[int, Part] = field(default_factory=dict)  # by tp size, with sequence parallelism


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
    experts: ExpertProfile | None = None  # routed-experts layers (``autopar/planner/expert_cost.py``), None: none
    attention_heads: int = 0  # the heads every attention's query, key and value divide into (their gcd); 0: none
    masked_attention: bool = False  # some attention takes a mask tensor (padding, windows, biases)
    eager_attention: str = ""  # a node relating the sequence to itself outside scaled_dot_product_attention ("": none)
    updated_buffers: tuple[str, ...] = ()  # the buffers its forward updates (``program.check_buffer_updates``)

    def sequence(self) -> list[Segment]:
        """Segments as they run: the head, every layer (repeats expanded), the tail."""
        return [seg for seg in self.segments for _ in range(seg.count)]

    @property
    def layers(self) -> list[Segment]:
        return [seg for seg in self.segments if seg.kind == "layer"]

    def layer_names(self) -> list[str | None]:
        """The module-list entry each segment of ``sequence()`` is (``"transformer.h.3"``, the name
        ``parallelize(recompute={...})`` takes); None for the head and the tail."""
        names: list[str | None] = []
        seen: dict[str, int] = {}  # module list -> its entries named so far
        for seg in self.segments:
            for _ in range(seg.count):
                if seg.kind != "layer":
                    names.append(None)
                    continue
                index = seen.get(family(seg.name), 0)
                seen[family(seg.name)] = index + 1
                names.append(f"{family(seg.name)}.{index}" if seg.name.endswith(".*") else seg.name)
        return names

    def part(self, segment: Segment, tp: int, sequence_parallel: bool = False) -> Part:
        parts = segment.sequence_parallel if sequence_parallel else segment.parts
        if tp not in parts:
            raise ValueError(f"tp={tp}{' with sequence parallelism' if sequence_parallel else ''} was not analyzed; "
                             f"the profile has tp sizes {list(self.tp_sizes)} (pass tp_sizes=... to profile_model)")
        return parts[tp]


# ---------------------------------------------------------------------------
# profile
# ---------------------------------------------------------------------------

def profile_model(model: torch.nn.Module, *, example_inputs: tuple | None = None,
                  example_kwargs: dict | None = None, sequence: bool = True,
                  tp_sizes: tuple[int, ...] = (1, 2, 4, 8), shorten: bool = True) -> ModelProfile:
    """Captures ``model`` and returns its ``ModelProfile``.

    A model on the meta device (or an accelerator) is captured as a CPU model
    of fake tensors (``autopar/planner/fake_cpu.py``): no memory, the CPU's code paths.

    ``example_inputs``: a small batch (dim 0 batch, dim 1 sequence when
    ``sequence``); default: guessed from the
    model (``autopar/planner/example_inputs.py``: token ids of shape (2, 16), decoder
    ids for an encoder-decoder, pixel values for an image model).
    ``tp_sizes``: the tensor-parallel sizes to analyze (sizes the model's
    shapes do not allow are dropped, with a note).
    """
    args, kwargs = model_inputs(model, example_inputs, example_kwargs, sequence=sequence)
    lists = repeated_lists(model) if shorten else {}
    distinct = distinct_first(model, lists)
    notes = [f"{path}: {n} identical entries; {KEEP} captured, the last standing for all" if path not in distinct else
             f"{path}: {n} entries, identical after the first; {KEEP} captured, the second standing for the other "
             f"{n - 1}" for path, n in lists.items()]
    # a meta model is captured as a fake CPU one; experts written as a loop as one grouped matmul (routed FLOPs)
    with as_fake_cpu(model) as mode, shortened(model, lists), grouped_while_profiling(model):
        args, kwargs = fake_inputs((args, kwargs), mode)
        exported = dynamic_export(model, args, kwargs, sequence)
        updated = updated_buffers(exported)
        analysis = _Analysis(model, exported, sequence, lists, distinct)
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
                        has_sequence=sequence, notes=notes, experts=expert_profile(model),
                        attention_heads=attention_heads(analysis.gm), masked_attention=masked_attention(analysis.gm),
                        eager_attention=eager_attention(analysis.gm) if sequence else "", updated_buffers=updated)


def updated_buffers(exported: torch.export.ExportedProgram) -> tuple[str, ...]:
    """The buffers ``exported``'s forward updates (``dynamic_export``'s): returned as mutations, or written in
    place."""
    sig = exported.graph_signature
    written = [sig.inputs_to_buffers.get(p.name) for p in written_placeholders(exported.graph_module)]
    names = [*sig.buffers_to_mutate.values(), *filter(None, written)]
    return tuple(dict.fromkeys(n.removeprefix(PREFIX) for n in names))  # (as the model names them)


def attention_heads(gm: torch.fx.GraphModule) -> int:
    """The gcd of the head counts (dim 1) of every ``scaled_dot_product_attention``'s query, key and value; 0
    without one: an all-to-all over cp ranks splits the heads, so cp must divide it."""
    heads = [x.meta["val"].shape[1] for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)
             for x in n.args[:3]]
    return math.gcd(*heads) if heads and all(isinstance(h, int) for h in heads) else 0


def masked_attention(gm: torch.fx.GraphModule) -> bool:
    """Whether a ``scaled_dot_product_attention`` of ``gm`` takes a mask tensor the runtime keeps: one that reads
    the inputs' values, or that is neither causal nor all-visible at the example's sizes. A mask built from
    shapes alone that is causal or all-visible the runtime's capture folds away (``is_causal``,
    ``passes/constant_masks.py``); here it is evaluated at the sizes the symbolic export was made with."""
    masks = {n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask") for n in gm.graph.nodes
             if n.target is torch.ops.aten.scaled_dot_product_attention.default}  # (layers share one mask)
    return any(isinstance(mask, torch.fx.Node)
               and mask_kind(evaluate_constant(mask, _example_size, torch.device("cpu"))) == "other"
               for mask in masks)


def _example_size(node: fx.Node) -> int | None:
    """A symbolic size's value at the export's example (None: not a size)."""
    val = node.meta.get("val")
    if isinstance(val, torch.SymInt):
        return val.node.hint
    return val if isinstance(val, int) and not isinstance(val, bool) and node.op != "placeholder" else None


def eager_attention(gm: torch.fx.GraphModule) -> str:
    """The first softmax over the sequence or batched matmul giving a (..., sequence, sequence) value that is
    left once the eager attention chains the runtime rewrites to ``scaled_dot_product_attention`` are
    (``passes/context_eager.sdpa_from_eager``: Hugging Face's eager matmul-softmax-matmul of GPT-2, LLaMA, BERT),
    named with its module; "" without one. Context parallelism refuses such an attention (Gemma-2's soft-capped
    one; ``passes/context_checks._check_no_sequence_square``)."""
    gm, _ = sdpa_from_eager(gm)
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.target not in SOFTMAXES | BATCHED_MATMULS or not isinstance(val, torch.Tensor) or val.dim() < 2:
            continue
        a, b = val.shape[-2:]
        if isinstance(b, torch.SymInt) and (n.target in SOFTMAXES or str(a) == str(b)):
            where = ([("", "")] + list(n.meta.get("nn_module_stack", {}).values()))[-1][0]
            return f"{n.target} {tuple(val.shape)}" + (f" in {where}" if where else "")
    return ""


class _Analysis:
    """The symbolic graph of a (shortened) model, its segments, and what autograd saves in it."""

    def __init__(self, model: torch.nn.Module, ep: torch.export.ExportedProgram, sequence: bool,
                 lists: dict[str, int], distinct: set[str]) -> None:
        self.model = model
        self.gm = ep.graph_module
        self.sequence = sequence
        self.names = export_symbols(ep, sequence)
        self.seg_of = segment_of_nodes(self.gm)
        aliases = tied_aliases(model)
        self.param_nodes = {nd: aliases.get(name, name) for nd, name in param_names(ep).items()}
        self.requires = {n: p.requires_grad for n, p in model.named_parameters()}
        self.numel = {n: p.numel() for n, p in model.named_parameters()}
        self.trainable = {nd for nd, name in self.param_nodes.items() if self.requires.get(name, True)}
        self.saved = saved_tensors(self.gm, set(self.param_nodes), self.trainable)
        order = list(dict.fromkeys(self.seg_of[n] for n in compute_nodes(self.gm)))
        keep, count = representatives(order, lists, distinct)
        self.keys = [k for k in order if k in keep]
        self.nodes = {k: [n for n in compute_nodes(self.gm) if self.seg_of[n] == k] for k in self.keys}
        self.segments = [self._segment(k, count[k]) for k in self.keys]

    def _segment(self, key: str, count: int) -> Segment:
        kind = key if key in ("head", "tail") else "layer"
        params = segment_params(self.nodes[key], self.param_nodes)
        widths = {nd.name: w for nd in self.nodes[key] if (w := weight_width(nd, set(self.param_nodes)))}
        part = self._part(key, {n: self.numel[n] for n in params if n in self.numel}, {}, {}, len(self.nodes[key]),
                          widths)
        name = f"{family(key)}.*" if count > 1 else key
        head = set(self.nodes.get("head", []))
        return Segment(name=name, kind=kind, count=count, entering=entering_elements(set(self.nodes[key]), self.names),
                       entering_head=entering_elements(set(self.nodes[key]), self.names, head) if kind == "layer"
                       else sympy.Integer(0), parts={1: part})

    def _part(self, key: str, params: dict[str, int], flops_factor: dict[str, Any], act_factor: dict[str, Any],
              ops: int, widths: dict[str, int]) -> Part:
        """Segment ``key``'s numbers, each node's FLOPs and saved tensors scaled by its local/full factor."""
        nodes = self.nodes[key]
        flops = {nd: to_sympy(node_cost(nd).flops, self.names) * flops_factor.get(nd.name, 1) for nd in nodes}
        zero = sympy.Integer(0)
        narrow = sum((f / widths[nd.name] for nd, f in flops.items() if nd.name in widths), zero)
        traffic = sum((moved_elements(nd, self.names) * act_factor.get(nd.name, 1) for nd in nodes), zero)
        saved, saved_other, attention, attention_fused = saved_elements(self.saved, set(nodes), self.names,
                                                                        act_factor)
        if key == "tail":
            saved += output_elements(self.gm, self.names)  # a loss keeps the outputs (log-softmax of logits)
        return Part(params=params, trainable={n for n in params if self.requires.get(n, True)},
                    flops=sum(flops.values(), zero), narrow=narrow, traffic=sympy.expand(traffic), saved=saved,
                    saved_other=saved_other, attention=attention, attention_fused=attention_fused, collectives=[],
                    ops=ops, kept_selective=kept_elements(self.saved, set(nodes), self.names, act_factor),
                    ring_kv=ring_elements(set(nodes), self.names, act_factor),
                    attention_flops=sum((f for nd, f in flops.items() if "scaled_dot_product" in str(nd.target)), zero),
                    deferred=dict(Counter(self.param_nodes[w] for nd in nodes
                                          if (w := deferred_weight(nd, self.trainable)) is not None)))

    def add_tensor_parallel(self, args: tuple, kwargs: dict, n: int) -> None:
        """Each segment's ``Part`` at tp size ``n``, from autopar's own solver and lowering of a static capture."""
        cap = capture(self.model, args, kwargs)
        static_seg = segment_of_nodes(cap.gm)
        flops, numel = {}, {}
        for node in cap.gm.graph.nodes:
            node.meta[ORIGIN] = node.name
            flops[node.name] = node_cost(node).flops if node.op == "call_function" else 0
            numel[node.name] = numel_of(node.meta.get("val"))
        same = match_nodes(self.gm, self.seg_of, cap.gm, static_seg)  # symbolic node name -> static node name
        for sequence_parallel in (False, True):
            tp = tensor_parallel(cap, n, {k for k, v in self.requires.items() if v},
                                 sequence_parallel=sequence_parallel)
            self._add_lowered(args, cap, tp, n, same, flops, numel, static_seg, sequence_parallel)

    def _add_lowered(self, args: tuple, cap: Any, tp: Any, n: int, same: dict[str, str], flops: dict[str, int],
                     numel: dict[str, int], static_seg: dict, sequence_parallel: bool) -> None:
        """Each segment's ``Part`` from one tensor-parallel lowering of the static capture ``cap``."""
        lowered = tp.graphs[0]
        local_flops: dict[str, int] = {}
        local_numel: dict[str, int] = {}
        local_width: dict[str, int] = {}
        lowered_params = {nd for nd in lowered.graph.nodes if nd.op == "placeholder"}
        for node in lowered.graph.nodes:
            origin = node.meta.get(ORIGIN)
            if origin is not None and node.op == "call_function":
                local_flops[origin] = local_flops.get(origin, 0) + node_cost(node).flops
                local_numel.setdefault(origin, numel_of(node.meta.get("val")))
                width = weight_width(node, lowered_params)
                if width:
                    local_width[origin] = width
        for origin in _gathered(lowered, sequence_parallel):  # a value all-gathered for a matmul: saved whole
            local_numel[origin] = numel[origin]
        flops_factor = {k: sympy.Rational(local_flops.get(o, flops[o]), flops[o]) for k, o in same.items() if flops[o]}
        act_factor = {k: sympy.Rational(local_numel.get(o, numel[o]), numel[o]) for k, o in same.items() if numel[o]}
        first = next(a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor))
        static_tokens = first.shape[0] * (first.shape[1] if self.sequence and first.dim() >= 2 else 1)
        tokens = b_sym * (s_sym if self.sequence and first.dim() >= 2 else 1) / sympy.Integer(static_tokens)
        by_key = by_segment(lowered, {nd.name: key for nd, key in static_seg.items()})
        trainable = {ph for ph, slot in zip([nd for nd in lowered.graph.nodes if nd.op == "placeholder"], cap.slots)
                     if slot.kind is SlotKind.PARAM and self.requires.get(slot.name)}
        grads = requires_grad(lowered, trainable)
        for key, seg in zip(self.keys, self.segments):
            params = {name: (e // n if isinstance(tp.placements.get(name), Shard) else e)
                      for name, e in seg.parts[1].params.items()}
            widths = {k: local_width[o] for k, o in same.items() if o in local_width}
            part = self._part(key, params, flops_factor, act_factor, len(by_key.get(key, [])), widths)
            part.collectives = _collectives(by_key.get(key, []), n, tokens, grads, sequence_parallel)
            part.communicated = sympy.expand(sum((numel_of(nd.meta.get("val")) * tokens for nd in by_key.get(key, [])
                                                  if nd.target in COMMUNICATING), sympy.Integer(0)))
            if sequence_parallel:  # the values between layers arrive sharded
                part.entering = entering_elements(set(self.nodes[key]), self.names, factors=act_factor)
            (seg.sequence_parallel if sequence_parallel else seg.parts)[n] = part


def _gathered(lowered: fx.GraphModule, regather: bool) -> set[str]:
    """Origins of the values the tp lowering all-gathers, and of what they view: autograd saves them whole
    (except, under sequence parallelism, ``all_gather_rs`` outputs: kept as shards, ``runtime/regather.py``)."""
    found = set()
    for node in lowered.graph.nodes:
        if getattr(node.target, "namespace", None) != "autopar" or OPS.get(node.target._opname) is None \
                or OPS[node.target._opname].forward != "all_gather" \
                or (regather and node.target._opname == "all_gather_rs"):
            continue
        x = node.args[0]
        while isinstance(x, fx.Node):
            if x.meta.get(ORIGIN) is not None:
                found.add(x.meta[ORIGIN])
            x = x.args[0] if x.op == "call_function" and x.target in VIEWS else None
    return found


def _collectives(nodes: list[fx.Node], n: int, tokens: sympy.Expr, grads: dict[fx.Node, bool],
                 regather: bool) -> list[Collective]:
    """The tp collectives (forward and backward) of lowered ``nodes``, elements scaled from the static shape (a
    parameter's, such as a norm weight's gradient all-reduce under sequence parallelism, not);
    a backward only where the collective's input needs a gradient (``grads``); ``regather``: sequence
    parallelism's gathers again in backward (``collective_calls``)."""
    out = []
    for node, direction, kind in collective_calls(nodes, grads, regather):
        local = numel_of(node.meta.get("val"))
        whole = local * n if OPS[node.target._opname].sharded_output else local  # unsharded elements
        per_token = not (isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder")  # not a parameter's
        out.append(Collective(kind, direction, sympy.expand(whole * tokens) if per_token else sympy.Integer(whole)))
    return out


__all__ = ["Collective", "Part", "Segment", "ModelProfile", "profile_model", "b_sym", "s_sym",
           "KEEP", "ORIGIN", "repeated_lists", "shortened", "segment_of_nodes", "saved_tensors", "weight_width"]
