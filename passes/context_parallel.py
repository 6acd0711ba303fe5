"""Context parallelism: the graph of one cp rank, which holds a balanced pair of chunks of every sequence.

Precondition: the graph captured on one cp rank's inputs, i.e. every sequence-dim input cut to its ``local``
tokens (chunks ``i`` and ``2 * cp - 1 - i`` of ``2 * cp``; ``autopar/core/ring_attention.py``). The rewrite:

- each ``aten.scaled_dot_product_attention`` (or its CPU kernel ``_scaled_dot_product_flash_attention_for_cpu``;
  Hugging Face's eager matmul-softmax-matmul arrives here as SDPA, ``passes/context_eager.py``) becomes
  ``autopar::ring_attention`` over ``cp`` (K/V blocks around the group, merged by log-sum-exp, the causal
  mask evaluated per block from global positions); where the attention has a mask tensor on whole sequences
  (``whole``: the model captured on them), the ring reads the rank's rows of that mask, computed in the
  rank's graph (``passes/context_masks.py``).
  With ``attention="all_to_all"`` (``parallelize(cp_attention=...)``) each becomes
  ``autopar::ulysses_attention`` instead: heads exchanged for sequence (``autopar/core/ulysses.py``), a mask
  tensor computed whole on the rank (every query's row: the rank attends for all of them); with
  ``attention="usp"`` (``Mesh(cp=(ring, a2a))``) ``autopar::usp_attention``: heads exchanged over ``cp_a2a``, a
  ring over ``cp_ring`` (``autopar/core/usp.py``);
- each ``aten.arange`` of the local length (cache positions, position ids, RoPE's positions) becomes
  ``autopar::cp_positions``: the global positions of the rank's tokens;
- each slice ``[0:local]`` (or ``narrow`` from 0) of a parameter, buffer or constant along a dim, or of a view
  of one longer than ``local`` there (a position-id buffer, ``buffer.unsqueeze(0)[:, :S]``, a position table
  cut to the sequence), becomes an ``index_select`` of those global positions;
- the label shift of a causal LM loss, ``pad(labels, [0, 1], value=ignore)[:, 1:]`` on a user input (Hugging
  Face's ``ForCausalLMLoss``), becomes the input itself, and the input is recorded in ``shifted``: the runtime
  shifts it on the whole sequence before cutting it (``runtime/batch.py``), so every rank's last token of a
  chunk is scored against the next chunk's first.

Refused with ``UnsupportedError`` naming the node and the source line, never replaced: an ``arange`` of the
local length from another start or by another step (``arange(2, S + 2)``, ``arange(S - 1, -1, -1)``) or a
window of the model's state from another start (``table[:, 1:S + 1]``), whose start may or may not follow the
length, which the rank's capture cannot tell (each rank got the same positions); a loss summing over the tokens
without dividing by their number (``passes/context_loss.py``); a pointwise op the model runs on whole
sequences but not on the rank's chunks (its Python branches on the length); an attention whose
mask ``passes/context_masks.py`` cannot follow, with dropout, or whose query and key lengths are not the
local length; and what ``passes/context_checks.py`` finds the chunks cannot compute alone: an attention in another form (a softmax over the local length, a batched matmul giving
(..., local, local): an eager matmul-softmax-matmul ``passes/context_eager.py`` does not match, such as
Gemma-2's soft-capped one); any other slice or pad along a dim of the local length (a shift inside the
sequence); a running sum (``cumsum``, ...) along it, a reduction over it (``sum``, ``mean``, ``amax``, ...; not
one over all dims, such as the loss's), a pick of positions (``select``, ``index``) or an op that moves or
orders values along it (``roll``, ``gather``, ``sort``, ``topk``, a convolution): a chunk's running sum
restarts, its sum covers the rank's tokens only, its position 0 is another token (RoBERTa's positions; mean
pooling; BERT's pooler; Mamba's convolution).

Invariant: the rank's graph computes the rows of the single-device graph's sequence-dim values at the rank's
positions (up to the order of floating-point sums in attention); values without a sequence dim are partial
per rank (the loss terms, averaged over dp x cp by the runtime with the global token count).
"""
from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.core.errors import UnsupportedError
from autopar.core.graph import Captured, SlotKind, copy_module, placeholder_kinds
from autopar.core.plan import Collective, Plan
from autopar.core.ring_attention import cp_positions, ring_attention
from autopar.core.ulysses import fake_outputs as ulysses_shapes
from autopar.core.ulysses import ulysses_attention
from autopar.core.usp import usp_attention
from autopar.passes.context_checks import (NARROW, SLICE, check_chunkable, check_constants_of_the_length,
                                           check_no_branch_on_length, dim_of, live_nodes, model_state)
from autopar.passes.context_loss import check_loss_is_a_token_mean
from autopar.passes.context_masks import MaskCopies, refused

aten = torch.ops.aten
AXIS = "cp"
SDPA = aten.scaled_dot_product_attention.default
CPU_SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default  # SDPA's CPU kernel: (out, logsumexp)
ATTENTIONS = {  # the attention ops rewritten -> their positional arguments (the rest are keywords)
    SDPA: ("query", "key", "value", "attn_mask", "dropout_p", "is_causal"),
    CPU_SDPA: ("query", "key", "value", "dropout_p", "is_causal"),
}
STATE_VIEWS = {aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten.expand.default,
               aten._to_copy.default, aten.alias.default, aten.detach.default}  # keep the dims they do not add
ARANGES = {aten.arange.default: (None, 0), aten.arange.start: (0, 1), aten.arange.start_step: (0, 1)}  # -> (start arg, end arg)
RING, POSITIONS = ring_attention._opoverload, cp_positions._opoverload  # autopar::ring_attention, ::cp_positions
ULYSSES = ulysses_attention._opoverload  # autopar::ulysses_attention
USP = usp_attention._opoverload  # autopar::usp_attention
EXCHANGES = {ULYSSES: (AXIS,), USP: ("cp_ring", "cp_a2a")}  # the head-exchanging attentions -> their axes
REWRITTEN = (RING, ULYSSES, USP)  # every op an attention becomes
CP_AXES = (AXIS, "cp_ring", "cp_a2a")  # the axes those communicate over
GRAPH_SIDE_EFFECTS = {aten._assert_tensor_metadata.default}  # checks only: a value they alone read is dead


@dataclass(frozen=True)
class ContextParallelGraph:
    """The rewritten graph and what it holds: attentions rewritten, positions made global."""

    gm: fx.GraphModule
    attentions: list[tuple[str, tuple[int, ...], int]]  # (node, k shape, bytes of K and V) per attention
    positions: int  # aranges and slices made global
    shifted: dict[int, float]  # flat user input -> the fill of its last position: shifted left along dim 1
    gathered: tuple[int, ...] = ()  # bytes per rank of each input masks read on whole sequences (gathered)
    # all_to_all: bytes of the rank's Q, K, V and output (with its log-sum-exp) exchanged per forward, and of
    # the output's gradient, dQ, dK and dV per backward, per microbatch (None for the ring)
    exchanged: tuple[int, int] | None = None
    split: tuple[int, int] | None = None  # usp: (ring, a2a) sizes of cp

    def add_to(self, plan: Plan, cp: int) -> None:
        """The exchanges per step. The ring: forward ``cp - 1`` K/V blocks per attention and microbatch;
        backward ``cp - 1`` K/V blocks again and ``cp`` exchanges of their gradients' partial sums (the last one
        home). All-to-all: forward Q, K, V and the output (4 calls), backward the output's gradient and dQ, dK,
        dV (4 calls), each the rank's whole tensor (``(cp - 1) / cp`` of it leaves the rank). USP: the
        all-to-alls over ``cp_a2a`` and the ring of its size over ``cp_ring`` (its blocks as many bytes as the
        rank's own K and V)."""
        ring, a2a = self.split or ((1, cp) if self.exchanged else (cp, 1))
        axes = ("cp_ring", "cp_a2a") if self.split else (AXIS, AXIS)
        plan.collectives += [Collective(AXIS, "all_gather", len(self.gathered) * plan.microbatches,
                                        sum(self.gathered) * plan.microbatches,
                                        "forward, inputs attention masks read on whole sequences", "forward")
                             ] if self.gathered else []
        plan.collectives += self._all_to_alls(axes[1], plan.microbatches) if a2a > 1 else []
        plan.collectives += self._ring(axes[0], ring, plan.microbatches) if ring > 1 else []

    def _all_to_alls(self, axis: str, m: int) -> list[Collective]:
        forward, backward = self.exchanged or (0, 0)
        n = len(self.attentions) * m
        return [Collective(axis, "all_to_all", 4 * n, forward * m, "forward, heads for sequence: Q, K, V, output",
                           "forward"),
                Collective(axis, "all_to_all", 4 * n, backward * m, "backward, the output's gradient and dQ, dK, dV",
                           "backward")]

    def _ring(self, axis: str, ring: int, m: int) -> list[Collective]:
        kv, n = sum(b for _, _, b in self.attentions) * m, len(self.attentions) * m
        return [Collective(axis, "send_recv", n * (ring - 1), kv * (ring - 1), "forward, ring attention's K/V blocks",
                           "forward"),
                Collective(axis, "send_recv", n * (2 * ring - 1), kv * (2 * ring - 1),
                           "backward, K/V blocks again and their gradients' partial sums", "backward")]


def context_parallel(cap: Captured, cp: int, local: int, whole: fx.GraphModule | None = None,
                     attention: str = "ring", split: tuple[int, int] | None = None) -> ContextParallelGraph:
    """``cap``'s graph for one cp rank of ``cp`` holding ``local`` tokens of each sequence (module doc);
    ``whole``: the model captured on whole sequences, whose attention masks the rank evaluates on its rows;
    each attention a ring, (``attention="all_to_all"``) an exchange of heads for sequence, or (``"usp"``) both
    on the (ring, a2a) sub-axes ``split`` of cp."""
    gm = copy_module(cap.gm)
    graph = gm.graph
    kinds = placeholder_kinds(graph, cap.slots)
    nodes = [n for n in graph.nodes if n.target in ATTENTIONS]
    wholes = _whole_attentions(whole, len(nodes))
    exchanged = [0, 0]
    exchange = {"all_to_all": (cp, None), "usp": (split[1] if split else 0, split)}.get(attention, (0, None))
    rings = [_ring(graph, n, local, w, *exchange, exchanged) for n, w in zip(nodes, wholes)]
    shifted = _label_shifts(graph, kinds, local)
    moved, kept = 0, []
    for node in list(graph.nodes):
        if node.target in ARANGES and _arange_of(node) == local:
            _replace(graph, node, _positions(graph, node, local))
            moved += 1
        elif node.target in ARANGES and _length(node) == local:
            kept.append(node)
        elif _state_window(node, kinds, local)[1] == local and _state_window(node, kinds, local)[0] != 0:
            kept.append(node)
        elif _state_window(node, kinds, local) == (0, local):
            with graph.inserting_after(node):
                pos = _positions(graph, node, local)
                picked = graph.call_function(aten.index_select.default, (node.args[0], dim_of(node), pos))
            _replace(graph, node, picked)
            moved += 1
    masks = _attach_masks(graph, whole, kinds, local, rings, wholes)
    _drop_dead_checks(graph)
    graph.eliminate_dead_code()
    _check_none_kept(graph, kept, local)
    check_constants_of_the_length(graph, kinds, whole, local)
    check_chunkable(graph, kinds, local)
    check_loss_is_a_token_mean(graph, kinds, local)
    if whole is not None:
        check_no_branch_on_length(whole, cap.gm)
    graph.lint()
    gm.recompile()
    return ContextParallelGraph(gm, [a for _, a in rings], moved, shifted, masks,
                                tuple(exchanged) if exchanged[0] else None, split if attention == "usp" else None)


def same_attention(whole: fx.GraphModule, local: fx.GraphModule) -> None:
    """The attentions of the graph captured on whole sequences and on one rank's chunks agree in form (causal
    or not) where the whole one has no mask tensor; where it has one, the rank evaluates that mask on its rows
    whatever the local capture holds (Mistral's sliding window is folded to ``is_causal`` on a chunk no longer
    than the window)."""
    forms = [[_form(n) for n in gm.graph.nodes if n.target in ATTENTIONS] for gm in (whole, local)]
    for i, (a, b) in enumerate(zip(*forms)):
        if a != b and not a[0]:
            raise UnsupportedError(f"context parallelism: attention {i} is {a[1]} on whole sequences and {b[1]} on "
                                   f"one cp rank's chunks: the model builds its mask from the sequence length (e.g. a "
                                   f"sliding window), which this version does not shard; run it without cp")
    if len(forms[0]) != len(forms[1]):
        raise UnsupportedError(f"context parallelism: the model has {len(forms[0])} attentions on whole sequences "
                               f"and {len(forms[1])} on one cp rank's chunks; run it without cp")


def _arguments(node: fx.Node) -> dict:
    return dict(zip(ATTENTIONS[node.target], node.args)) | dict(node.kwargs)


def _form(node: fx.Node) -> tuple[bool, str]:
    args = _arguments(node)
    mask, causal = args.get("attn_mask") is not None, bool(args.get("is_causal", False))
    return mask, "masked by a tensor" if mask else "causal" if causal else "unmasked"


# -- attention ----------------------------------------------------------------------------------------------------
def _whole_attentions(whole: fx.GraphModule | None, n: int) -> list[fx.Node | None]:
    """The attentions of the whole-sequence graph, in order (Nones without one)."""
    if whole is None:
        return [None] * n
    found = [node for node in whole.graph.nodes if node.target in ATTENTIONS]
    if len(found) != n:
        raise UnsupportedError(f"context parallelism: the model has {len(found)} attentions on whole sequences "
                               f"and {n} on one cp rank's chunks; run it without cp")
    return found


def _ring(graph: fx.Graph, node: fx.Node, local: int, whole: fx.Node | None, heads_over: int,
          split: tuple[int, int] | None, exchanged: list[int]) -> tuple[fx.Node, tuple[str, tuple[int, ...], int]]:
    """``node`` rewritten to the ring (``whole``: the same attention on whole sequences, whose form it takes),
    or with ``heads_over`` (the cp size, or the a2a size of the usp ``split``) to an exchange of heads for
    sequence, its forward and backward bytes added to ``exchanged``."""
    args = _arguments(node)
    q, k, v = args["query"], args["key"], args["value"]
    causal = bool((_arguments(whole) if whole is not None else args).get("is_causal", False))
    if whole is None and args.get("attn_mask") is not None:
        raise refused(node, f"its mask {args['attn_mask'].name} is a tensor, and the graph on whole sequences "
                            f"it is taken from is not given")
    if args.get("dropout_p", 0.0):
        raise refused(node, f"it has dropout_p={args['dropout_p']}; set the attention dropout to 0")
    if args.get("enable_gqa", False):
        raise refused(node, "it shares K/V heads (enable_gqa=True); repeat them before the attention")
    shapes = [tuple(x.meta["val"].shape) for x in (q, k, v)]
    if any(s[-2] != local for s in shapes):
        raise refused(node, f"query/key/value lengths {[s[-2] for s in shapes]} are not the local sequence length "
                            f"{local}")
    scale = args.get("scale")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(shapes[0][-1])
    op = (USP if split else ULYSSES) if heads_over else RING
    call = (q, k, v, scale, causal, *EXCHANGES.get(op, (AXIS,)))
    if heads_over:
        call += (heads_over,)
        _all_to_all_bytes(node, [x.meta["val"] for x in (q, k, v)], heads_over, exchanged, split)
    with graph.inserting_after(node):
        ring = graph.call_function(op, call)
    val = node.meta["val"][0] if node.target is CPU_SDPA else node.meta["val"]
    ring.meta["val"] = ulysses_shapes(*(x.meta["val"] for x in (q, k, v)), *call[3:5], AXIS, heads_over) \
        if heads_over else (val, val.new_empty(val.shape[:-1]))
    if node.target is CPU_SDPA:  # (out, logsumexp) as the ring's, whose log-sum-exp takes no gradient
        if any(u.args[1] != 0 and u.users for u in node.users):
            raise refused(node, "its log-sum-exp output is used; context parallelism keeps the attention output "
                                "only")
        _replace(graph, node, ring)
    else:
        with graph.inserting_after(ring):
            out = graph.call_function(operator.getitem, (ring, 0))
        _replace(graph, node, out)
    kv = sum(x.meta["val"].numel() * x.meta["val"].element_size() for x in (k, v))
    return ring, (node.name, shapes[1], kv)


def _all_to_all_bytes(node: fx.Node, qkv: list[torch.Tensor], cp: int, exchanged: list[int],
                      split: tuple[int, int] | None = None) -> None:
    """Adds what the all-to-alls of one attention send to ``exchanged`` (forward: Q, K, V and the output with its
    log-sum-exp; backward: the output's gradient, dQ, dK, dV); refuses heads that do not divide by ``cp`` (the
    a2a size of the usp ``split``)."""
    heads = [x.shape[1] for x in qkv]
    if any(h % cp for h in heads) and split:
        total = split[0] * cp
        fits = [a for a in range(2, total) if total % a == 0 and not any(h % a for h in heads)]
        raise refused(node, f"query/key/value heads {heads} do not divide by the a2a size {cp} of cp={split} for the "
                            f"all-to-all; use Mesh(cp=(ring, a2a)) with ring x a2a = {total} and a2a dividing the "
                            f"heads{f' (a2a in {fits})' if fits else ''}, or cp_attention='ring' with Mesh(cp={total})")
    if any(h % cp for h in heads):
        raise refused(node, f"query/key/value heads {heads} do not divide by cp={cp} for the all-to-all; use "
                            f"cp_attention='ring' or a cp dividing the heads")
    size = [x.numel() * x.element_size() for x in qkv]
    row = size[0] // qkv[0].shape[-1]  # bytes of one element per query row and head
    exchanged[0] += sum(size) + row * (qkv[2].shape[-1] + 1)
    exchanged[1] += sum(size) + row * qkv[2].shape[-1]


def _attach_masks(graph: fx.Graph, whole: fx.GraphModule | None, kinds: dict[fx.Node, SlotKind], local: int,
                  rings: list[tuple[fx.Node, tuple]], wholes: list[fx.Node | None]) -> tuple[int, ...]:
    """Each ring whose attention has a mask tensor on whole sequences reads the rank's rows of that mask
    (``passes/context_masks.py``), each all-to-all attention (which attends for every query) the whole mask,
    computed on the rank from the gathered inputs; the bytes per rank of the inputs gathered for them."""
    if whole is None:
        return ()
    copies = MaskCopies(graph, whole.graph, kinds, local, AXIS)
    for (ring, _), attention in zip(rings, wholes):
        mask = _arguments(attention).get("attn_mask")
        if mask is not None and ring.target is USP:
            raise refused(attention, f"its mask {mask.name} is a tensor; cp_attention='usp' evaluates causal "
                                     f"masks or none; use cp_attention='ring' or 'all_to_all'")
        if mask is not None:
            rows = copies.all_rows_of(mask, ring) if ring.target is ULYSSES else copies.rows_of(mask, ring)
            ring.args = (*ring.args, rows)
    return tuple(x.meta["val"].numel() * x.meta["val"].element_size() for x in copies.gathered)


def _drop_dead_checks(graph: fx.Graph) -> None:
    """Erases the metadata checks of values nothing else reads (e.g. a mask Hugging Face builds and then
    leaves to ``is_causal``): on the rank's chunks they would index the local sequence with global positions."""
    live = live_nodes(graph)
    for node in list(graph.nodes):
        if node.target in GRAPH_SIDE_EFFECTS and not all(a in live for a in node.all_input_nodes):
            graph.erase_node(node)


# -- label shifts -----------------------------------------------------------------------------------------------
def _label_shifts(graph: fx.Graph, kinds: dict[fx.Node, SlotKind], local: int) -> dict[int, float]:
    """Rewrites each ``pad(input, [0, 1], value)[:, 1:]`` (a (batch, sequence) input) to the input; the inputs."""
    slots = {n: i for i, n in enumerate(n for n, k in kinds.items() if k is SlotKind.INPUT)}
    out = {}
    for node in list(graph.nodes):
        fill = _right_pad_by_one(node)
        x = node.args[0] if fill is not None else None
        if x not in slots or tuple(x.meta["val"].shape[1:]) != (local,):
            continue
        cuts = list(node.users)
        if not all(u.target is SLICE and dim_of(u) in (1, -1) and u.args[2] == 1 for u in cuts):
            continue
        if set(x.users) != {node}:
            raise refused(node, f"the input {x.name} is shifted for the loss and also read unshifted; shift the "
                                f"labels before the model (and pass the shifted ones)")
        for cut in cuts:
            cut.replace_all_uses_with(x)
            graph.erase_node(cut)
        graph.erase_node(node)
        out[slots[x]] = fill
    return out


def _right_pad_by_one(node: fx.Node) -> float | None:
    """The fill of a constant pad by one at the end of the last dim (None for another node)."""
    if node.target is aten.pad.default and list(node.args[1]) == [0, 1] and node.args[2:3] in ((), ("constant",)):
        return float(node.args[3]) if len(node.args) > 3 and node.args[3] is not None else 0.0
    if node.target is aten.constant_pad_nd.default and list(node.args[1]) == [0, 1]:
        return float(node.args[2]) if len(node.args) > 2 else 0.0
    return None


# -- positions --------------------------------------------------------------------------------------------------
def _arange_of(node: fx.Node) -> int | None:
    """The length of an ``arange`` from 0 with step 1 (None otherwise)."""
    start_i, end_i = ARANGES[node.target]
    start = node.args[start_i] if start_i is not None else 0
    step = node.args[2] if node.target is aten.arange.start_step else 1
    end = node.args[end_i]
    return end if start == 0 and step == 1 and isinstance(end, int) else None


def _check_none_kept(graph: fx.Graph, kept: list[fx.Node], local: int) -> None:
    """No captured ``arange`` of the local length that does not count from 0 by 1, and no window of the local
    length of the model's state that does not start at 0 (``kept``), is still read once the masks are the whole
    graph's: its start may or may not follow the sequence's length (``arange(2, S + 2)``, ``arange(S - 1, -1,
    -1)``, ``table[:, 1:S + 1]``, ``table[:, max - S:]``), which the rank's capture cannot tell, and kept as
    captured it gives every cp rank the first chunk's numbers."""
    live = set(graph.nodes)
    for node in kept:
        if node not in live:
            continue
        arange = node.target in ARANGES
        what = ("an arange of the local length {} that does not count from 0 by 1" if arange
                else "a window of the local length {} of the model's state that does not start at 0")
        args = ", ".join(map(str, node.args if arange else node.args[1:]))
        raise refused(node, f"{what.format(local)} ({args}) would give every cp rank the same positions; write it "
                            f"as torch.arange(S) * step + offset with a constant offset (for a table, table[:, :S] "
                            f"or an index by such positions), pass the positions as an input, or run without cp")


def _of_state(value: fx.Node, kinds: dict[fx.Node, SlotKind], local: int, dim: int) -> bool:
    """Whether ``value`` is the model's state or a view of it (``pos_ids.unsqueeze(0)``, ``table.expand(B, -1,
    -1)``, a cast; nothing of a user input) longer than ``local`` along ``dim``: its ``[0:local]`` there is
    positions 0..local-1 of the model's table, which on a cp rank are the rank's global positions."""
    if model_state(value, kinds):
        return True
    if value.op != "call_function" or value.target not in STATE_VIEWS or not isinstance(value.args[0], fx.Node):
        return False
    shape, source = value.meta["val"].shape, value.args[0].meta["val"].shape
    before = (dim - (1 if dim > value.args[1] % len(shape) else 0) if value.target is aten.unsqueeze.default
              else dim - (len(shape) - len(source)))  # the dim of the input that ``dim`` reads
    if shape[dim] <= local or not 0 <= before < len(source) or source[before] != shape[dim]:
        return False
    return _of_state(value.args[0], kinds, local, before)


def _length(node: fx.Node) -> int | None:
    """The number of elements of a 1-dim ``arange`` (None for another value)."""
    val = node.meta.get("val")
    return int(val.shape[0]) if isinstance(val, torch.Tensor) and val.dim() == 1 else None


def _state_window(node: fx.Node, kinds: dict[fx.Node, SlotKind], local: int) -> tuple[int | None, int | None]:
    """(start, length) of ``node`` where it is a slice or ``narrow`` of the model's state (or a view of it)
    longer than ``local`` along its dim; (None, None) otherwise."""
    if node.target not in (SLICE, NARROW) or not _of_state(node.args[0], kinds, local, dim_of(node)):
        return None, None
    return _window(node)


def _window(node: fx.Node) -> tuple[int | None, int | None]:
    """(start, length) of a slice with step 1 or a ``narrow`` along its dim; (None, None) for another one."""
    if node.target is NARROW:
        start, length = node.args[2:4]
        return (start, length) if isinstance(start, int) and isinstance(length, int) else (None, None)
    dim, start, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:])[:4]
    start = start or 0
    size = node.args[0].meta["val"].shape[dim]
    if step != 1 or not isinstance(start, int) or not isinstance(end, int) or start < 0:
        return None, None
    return start, min(end, size) - start


def _positions(graph: fx.Graph, node: fx.Node, local: int) -> fx.Node:
    """The rank's global positions (int64), cast to ``node``'s dtype where it is an arange of another dtype."""
    val = node.meta["val"]
    with graph.inserting_before(node):
        pos = graph.call_function(POSITIONS, (local, AXIS, val.device))
        pos.meta["val"] = val.new_empty(local, dtype=torch.int64)
        if node.target in ARANGES and val.dtype != torch.int64:
            pos = graph.call_function(aten._to_copy.default, (pos,), {"dtype": val.dtype})
            pos.meta["val"] = val
    return pos


def _replace(graph: fx.Graph, old: fx.Node, new: fx.Node) -> None:
    new.meta.setdefault("val", old.meta.get("val"))
    for key in ("nn_module_stack", "stack_trace"):
        if key in old.meta:
            new.meta.setdefault(key, old.meta[key])
    old.replace_all_uses_with(new)
    graph.erase_node(old)


def ring_per_pp_rank(plan: Plan, stages: list, stage_to_rank: list[int]) -> None:
    """Under a pipeline the plan's ring exchanges are those of the pp rank whose stages pass the most K/V
    bytes around the cp ring, not those of every attention."""
    total = sum(ring_kv_bytes(st.gm) for st in stages)
    if not total:
        return
    calls, kv = {}, {}
    for st in stages:
        rank = stage_to_rank[st.index]
        calls[rank] = calls.get(rank, 0) + sum(1 for nd in st.gm.graph.nodes if nd.target in REWRITTEN)
        kv[rank] = kv.get(rank, 0) + ring_kv_bytes(st.gm)
    worst = max(kv, key=kv.__getitem__)
    attentions = sum(calls.values())
    plan.collectives = [dataclasses.replace(x, count=x.count * calls[worst] // attentions,
                                            bytes=x.bytes * kv[worst] // total) if x.axis in CP_AXES else x
                        for x in plan.collectives]


def ring_kv_bytes(gm: fx.GraphModule) -> int:
    """Bytes of K and V the ring attentions of ``gm`` pass around the cp ring, or its all-to-all attentions
    receive (0 without context parallelism)."""
    return sum(x.meta["val"].numel() * x.meta["val"].element_size()
               for nd in gm.graph.nodes if nd.target in REWRITTEN for x in nd.args[1:3])
