"""What one cp rank's chunks of every sequence cannot compute alone, refused by name (``passes/context_parallel.py``
runs ``check_chunkable`` on the rank's graph).

Refused with ``UnsupportedError`` naming the node and the source line: an attention in another form (a fused
GPU kernel; a softmax over the local sequence or a batched matmul giving (..., local, local): an eager
matmul-softmax-matmul ``passes/context_eager.py`` does not match); a slice or pad along a sequence dim of the
local length (a shift inside the sequence); a running sum, a reduction, a pick of positions, an op that moves,
orders or splits values along one (``cumsum``, ``mean``, ``select``, ``roll``, ``sort``, ``flip``, ``scatter``,
``chunk``, ``unfold``, a convolution over the tokens) or a product summing over one (``x.transpose(1, 2) @ x``):
on a rank's chunks each sees the rank's tokens only. Positions made from the local length alone are refused
too: a running sum over a tensor of ones of that length, and a constant tensor sized by it
(``torch.tensor(range(S))``, ``check_constants_of_the_length``): on every rank they hold 0..local-1.

Invariant: a graph that passes computes, on the rank's chunks, the rows of the single-device values at the rank's
positions wherever the other rewrites of ``context_parallel`` hold; values of the model's state (parameters,
buffers, constants) are whole and never refused.
"""
from __future__ import annotations

import difflib
import math

import torch
import torch.fx as fx

from autopar.core.graph import SlotKind, placeholders_of
from autopar.passes.context_masks import refused

aten = torch.ops.aten
FUSED = {aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
         aten._scaled_dot_product_cudnn_attention.default,
         aten._scaled_dot_product_fused_attention_overrideable.default}  # GPU kernels: refused by name
SLICE = aten.slice.Tensor
NARROW = aten.narrow.default
SOFTMAXES = {aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int}
BATCHED_MATMULS = {aten.matmul.default, aten.bmm.default, aten.baddbmm.default, aten.einsum.default}


def check_chunkable(graph: fx.Graph, kinds: dict[fx.Node, SlotKind], local: int) -> None:
    """Refuses the first live node of ``graph`` (the rank's, on ``local`` tokens of each sequence) that its
    chunks cannot compute alone (the module doc)."""
    live = live_nodes(graph)
    batches = _batch_sizes(kinds, local)
    _check_no_sequence_square(graph, live, local, batches)
    _check_no_sequence_shift(graph, live, kinds, local)
    _check_no_sequence_reads(graph, live, kinds, local, batches)
    _check_no_sequence_contraction(graph, live, kinds, local, batches)
    _check_no_sequence_fold(graph, live, kinds, local, batches)
    _check_no_other_sequence_op(graph, live, kinds, local, batches)
    _check_no_scan_of_positions(graph, live, local)


def _check_no_sequence_square(graph: fx.Graph, live: set[fx.Node], local: int,
                              batches: set[int] | None) -> None:
    """No live attention in another form: a softmax over the local sequence, or a batched matmul giving a
    (..., local, local) value (Hugging Face's eager matmul-softmax-matmul) would see the rank's keys only. (A
    softmax over as many experts as local tokens, on the tokens flattened, is not over the sequence:
    ``_batch_first``; scores (..., local, local) are, whatever their leading dims.)"""
    for node in graph.nodes:
        if node in live and node.target in FUSED:
            raise refused(node, "a fused attention kernel context parallelism does not rewrite; capture the model "
                                "on the CPU (autopar does by default) or with scaled_dot_product_attention")
        val = node.meta.get("val")
        if node not in live or not isinstance(val, torch.Tensor) or val.dim() < 2:
            continue
        if (node.target in SOFTMAXES and val.shape[-1] == local
                and (_batch_first(val.shape, batches) or val.shape[-2] == local)) or (
                node.target in BATCHED_MATMULS and tuple(val.shape[-2:]) == (local, local)):
            raise refused(node, f"its value {tuple(val.shape)} relates the local sequence ({local} tokens) to "
                                f"itself: an attention in a form context parallelism does not rewrite (eager "
                                f"matmul-softmax-matmul); run the model with attn_implementation='sdpa' or "
                                f"without cp")


def _check_no_scan_of_positions(graph: fx.Graph, live: set[fx.Node], local: int) -> None:
    """No live running sum along a dim of the local length of a value made from no input and no state
    (``torch.ones(S).cumsum(0) - 1``: positions counted by a scan, 0..local-1 on every cp rank; not batch-first,
    so ``_check_no_sequence_reads`` does not take it for the sequence)."""
    for node in graph.nodes:
        if node not in live or node.target not in SCANS or not isinstance(node.args[0], fx.Node):
            continue
        shape = tuple(node.args[0].meta["val"].shape)
        dim = (node.args[1] if len(node.args) > 1 else node.kwargs["dim"]) % max(len(shape), 1)
        if shape and shape[dim] == local and not placeholders_of(node.args[0]):
            raise refused(node, f"it accumulates along dim {dim} of a tensor {shape} made from the local sequence "
                                f"length {local} alone (positions counted by a running sum), the same on every cp "
                                f"rank; use torch.arange(S), pass the positions as an input, or run without cp")


def _check_no_sequence_shift(graph: fx.Graph, live: set[fx.Node], kinds: dict[fx.Node, SlotKind],
                             local: int) -> None:
    """No live slice or pad moves values along a sequence dim of the local length: dim 1 of (batch, sequence,
    ...) values, or dim 2 of (batch, heads, sequence, head dim) ones (a shift inside a sequence)."""
    for node in graph.nodes:
        if node not in live or node.target not in (SLICE, NARROW, aten.pad.default, aten.constant_pad_nd.default):
            continue
        x = node.args[0]
        shape = tuple(x.meta["val"].shape)
        if model_state(x, kinds):
            continue
        dims = {d for d in sequence_dims(shape) if shape[d] == local}
        if node.target in (SLICE, NARROW):
            start, end = (list(node.args[2:4]) + [None, None])[:2]
            end = start + end if node.target is NARROW else end  # narrow's (start, length)
            if dim_of(node) % len(shape) in dims and (start not in (0, None) or (end is not None and end < local)):
                raise refused(node, f"it slices [{start}:{end}] along a dim of the local sequence length {local}: "
                                    f"a shift inside the sequence, which crosses the cp ranks' chunks")
        elif any(len(shape) - 1 - i // 2 in dims for i, p in enumerate(node.args[1]) if p != 0):
            raise refused(node, f"it pads {list(node.args[1])} along a dim of the local sequence length {local}")


SCANS = {aten.cumsum.default, aten.cumprod.default, aten.cummax.default, aten.cummin.default,
         aten.logcumsumexp.default}  # (x, dim, ...): a running reduction along dim
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}  # (x, [index per dim], ...)
PICKS = {aten.select.int} | INDEXING  # (x, dim, i) / (x, [index per dim]): chosen positions along a dim
MOVES = {  # op -> (the position of its dim argument, its default): ops that move or order values along that dim
    aten.gather.default: (1, None), aten.roll.default: (2, []), aten.sort.default: (1, -1),
    aten.sort.stable: (None, -1), aten.argsort.default: (1, -1), aten.argsort.stable: (None, -1),
    aten.topk.default: (2, -1), aten.kthvalue.default: (2, -1), aten.flip.default: (1, None),
    aten.index_select.default: (1, None), aten.unfold.default: (1, None), aten.scatter.src: (1, None),
    aten.scatter.value: (1, None), aten.scatter.reduce: (1, None), aten.scatter.value_reduce: (1, None),
    aten.scatter_add.default: (1, None), aten.scatter_reduce.two: (1, None), aten.index_add.default: (1, None),
    aten.index_copy.default: (1, None), aten.index_fill.int_Scalar: (1, None), aten.index_fill.int_Tensor: (1, None),
    aten.split.Tensor: (2, 0), aten.split_with_sizes.default: (2, 0), aten.chunk.default: (2, 0),
    aten.tensor_split.sections: (2, 0), aten.tensor_split.indices: (2, 0), aten.unbind.int: (1, 0)}
CONVOLUTIONS = {aten.convolution.default, aten.conv1d.default, aten.conv1d.padding}  # (input (B, C, *spatial),
# weight (O, C / groups, *kernel), ...)
REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.max.dim,
              aten.min.dim, aten.prod.dim_int, aten.logsumexp.default, aten.argmax.default, aten.argmin.default,
              aten.var.correction, aten.std.correction, aten.any.dim, aten.all.dim}  # (x, dim or dims, ...)


def _check_no_sequence_reads(graph: fx.Graph, live: set[fx.Node], kinds: dict[fx.Node, SlotKind],
                             local: int, batches: set[int] | None) -> None:
    """No live running sum (or product, max, ...) along a sequence dim of the local length, no reduction over
    one and no pick of positions along one: on the rank's chunks a running sum restarts at each chunk (e.g.
    RoBERTa's positions, counted from a padding mask by ``cumsum``), a sum or mean covers the rank's tokens only
    (e.g. a classifier's mean over the tokens) and position ``i`` is another token (a classifier reading each
    sequence's first token). A reduction over all dims (the loss's sum and count) is the runtime's to combine."""
    for node in graph.nodes:
        if node not in live or node.target not in SCANS | PICKS | REDUCTIONS | MOVES.keys() | CONVOLUTIONS or \
                model_state(node.args[0], kinds):
            continue
        shape = tuple(node.args[0].meta["val"].shape)
        dims = {d for d in sequence_dims(shape) if shape[d] == local} if _batch_first(shape, batches) else set()
        moved = moved_dims(node, shape, local) if _batch_first(shape, batches) else []
        if moved and (node.target in CONVOLUTIONS or set(moved) & dims):
            raise refused(node, f"it moves or orders values along dim {moved[0]}, of the local sequence length "
                                f"{local} (a roll, gather, scatter, sort, flip, split, unfold or convolution over "
                                f"the tokens): on a cp rank it sees the rank's chunks only; run without cp")
        if node.target in MOVES or node.target in CONVOLUTIONS:
            continue
        if node.target in INDEXING:
            picked = [d for d, index in enumerate(node.args[1]) if index is not None and d in dims]
            if picked:
                raise refused(node, f"it indexes dim {picked[0]}, of the local sequence length {local}, with a "
                                    f"tensor: on a cp rank's chunks those positions are other tokens; run without cp")
            continue
        if node.target in REDUCTIONS:
            reduced = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            reduced = [reduced] if isinstance(reduced, int) else list(reduced or [])  # [] / None: all dims
            over = [d % len(shape) for d in reduced if d % len(shape) in dims]
            if over:
                raise refused(node, f"it reduces over dim {over[0]}, of the local sequence length {local} (such as "
                                    f"a mean over each sequence's tokens): on a cp rank it covers the rank's chunks "
                                    f"only; run without cp")
            continue
        dim = (node.args[1] if len(node.args) > 1 else node.kwargs["dim"]) % max(len(shape), 1)
        if dim not in dims:
            continue
        if node.target is aten.select.int:
            raise refused(node, f"it takes position {node.args[2]} along a dim of the local sequence length "
                                f"{local} (such as a classifier reading each sequence's first token): on a cp "
                                f"rank's chunks that is another token; run without cp")
        raise refused(node, f"it accumulates along a dim of the local sequence length {local} (a running sum over "
                            f"the sequence, such as positions counted from a padding mask), which would restart at "
                            f"each cp rank's chunk; pass it as an input (e.g. position_ids=) or run without cp")


PRODUCTS = {aten.matmul.default: 0, aten.bmm.default: 0, aten.mm.default: 0, aten.baddbmm.default: 1,
            aten.addmm.default: 1}  # op -> the position of its two factors


def _check_no_sequence_contraction(graph: fx.Graph, live: set[fx.Node], kinds: dict[fx.Node, SlotKind],
                                   local: int, batches: set[int] | None) -> None:
    """No live product sums over a sequence dim of the local length of a (batch, sequence, ...) factor (a token
    mixing such as ``x.transpose(1, 2) @ x`` or ``tril(ones) @ x``): on a rank it sums the rank's chunks only.
    The attentions are rewritten before this runs, and one left in eager form is refused above."""
    for node in graph.nodes:
        if node not in live or node.target not in PRODUCTS.keys() | {aten.einsum.default}:
            continue
        for factor, dim in summed(node):
            if not isinstance(factor, fx.Node) or model_state(factor, kinds):
                continue
            shape = tuple(factor.meta["val"].shape)
            if _batch_first(shape, batches) and dim in sequence_dims(shape) and shape[dim] == local:
                raise refused(node, f"it sums over dim {dim} of a factor {shape}, of the local sequence length "
                                    f"{local} (a product mixing the tokens): on a cp rank it covers the rank's "
                                    f"chunks only; run without cp")


VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
         aten.unflatten.int}


def _check_no_sequence_fold(graph: fx.Graph, live: set[fx.Node], kinds: dict[fx.Node, SlotKind], local: int,
                            batches: set[int] | None) -> None:
    """No live view folds the local sequence of a (batch, sequence, ...) value into blocks, (B, S, H) as
    (B, S / k, k * H): on a rank's chunks a block holds tokens of two chunks wherever a chunk is not a multiple of
    k long. A view keeping a dim of the local length, or merging the batch and sequence dims (with any after them)
    into its first, keeps the tokens apart."""
    for node in graph.nodes:
        if node not in live or node.target not in VIEWS or model_state(node.args[0], kinds):
            continue
        shape, out = tuple(node.args[0].meta["val"].shape), tuple(node.meta["val"].shape)
        if len(shape) < 2 or shape[1] != local or not _batch_first(shape, batches) or local in out:
            continue
        leading = [math.prod(shape[:k]) for k in range(2, len(shape) + 1)]
        if not out or out[0] not in leading:
            raise refused(node, f"it views {shape} as {out}, folding the local sequence ({local} tokens) into "
                                f"blocks: on a cp rank a block can hold tokens of two chunks; run without cp")


def summed(node: fx.Node) -> list[tuple[object, int]]:
    """The (factor, dim) pairs a matrix product or an einsum sums over."""
    if node.target is aten.einsum.default:
        equation, factors = node.args[0].replace(" ", ""), node.args[1]
        terms, _, output = equation.partition("->")
        terms = terms.split(",")
        if "->" not in equation:  # implicit: the letters used once, in order
            letters = "".join(terms).replace(".", "")
            output = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
        pairs = []
        for term, factor in zip(terms, factors):
            if not isinstance(factor, fx.Node):
                continue
            rank = factor.meta["val"].dim()
            head, _, tail = term.partition("...")
            dims = list(enumerate(head)) + [(rank - len(tail) + i, c) for i, c in enumerate(tail)]
            pairs += [(factor, d) for d, c in dims if c not in output]
        return pairs
    at = PRODUCTS[node.target]
    a, b = node.args[at], node.args[at + 1]
    return [(f, d) for f, d in ((a, -1), (b, -2)) if isinstance(f, fx.Node) and f.meta["val"].dim() >= 2
            for d in [d % f.meta["val"].dim()]]


ALONG_DIM_IS_LOCAL = {aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
                      aten.cat.default, aten.stack.default, aten.movedim.int, aten.select.int, aten.slice.Tensor,
                      aten.narrow.default, aten.repeat_interleave.self_int, aten.repeat_interleave.self_Tensor,
                      aten.expand.default, aten.flatten.using_ints, aten.unflatten.int, aten.permute.default}
# (checked elsewhere or moving no value along the dim)
NORMS = {aten.layer_norm.default: 1, aten.native_layer_norm.default: 1, aten.rms_norm.default: 1}  # op -> where
# its normalized shape is: the trailing dims it normalizes over
POOLS = {aten.avg_pool1d.default, aten.avg_pool2d.default, aten.max_pool1d.default, aten.max_pool2d.default,
         aten.max_pool1d_with_indices.default, aten.max_pool2d_with_indices.default, aten.adaptive_avg_pool1d.default,
         aten._adaptive_avg_pool2d.default, aten.adaptive_max_pool1d.default, aten.upsample_nearest1d.vec,
         aten.upsample_linear1d.vec}  # (x (B, C, *spatial), ...): over the spatial dims
SPACED = {aten.linspace.default: 2, aten.logspace.default: 2}  # op -> where its count of points is


CHECKED = SCANS | PICKS | REDUCTIONS | MOVES.keys() | CONVOLUTIONS | PRODUCTS.keys()  # by the checks above
SKIPPED_NUMBERS = FUSED | {aten.scaled_dot_product_attention.default}


def _check_no_other_sequence_op(graph: fx.Graph, live: set[fx.Node], kinds: dict[fx.Node, SlotKind], local: int,
                                batches: set[int] | None) -> None:
    """What the lists above leave: any other op taking a dim (``dim``, ``dims``, ``dimension`` in its schema:
    a softmax, a variance, a norm, a difference along the tokens) given a sequence dim of the local length, a
    layer norm over one, a pooling over the tokens, and points spaced over the local length (``linspace``)."""
    for node in graph.nodes:
        if node not in live or not isinstance(node.target, torch._ops.OpOverload) or node.target.namespace != "aten":
            continue  # (autopar's own ops are the rewrites' and compute on the whole sequence where they must)
        if node.target in SPACED:
            if node.args[SPACED[node.target]] == local:
                raise refused(node, f"it spaces {local} points, the local sequence length: on a cp rank they would "
                                    f"be the rank's chunks' own, not the sequence's; run without cp")
            continue
        x = node.args[0] if node.args else None
        if node.target in ALONG_DIM_IS_LOCAL | CHECKED or not isinstance(x, fx.Node) or model_state(x, kinds) or \
                not isinstance(x.meta.get("val"), torch.Tensor):
            continue
        shape = tuple(x.meta["val"].shape)
        if not _batch_first(shape, batches):
            continue
        dims = {d for d in sequence_dims(shape) if shape[d] == local}
        if node.target in NORMS or node.target in POOLS:  # over trailing dims, the sequence's wherever it is
            first = len(shape) - len(node.args[NORMS[node.target]]) if node.target in NORMS else 2
            over = {d for d in range(max(first, 1), len(shape)) if shape[d] == local}
        else:
            over = set(dims_argument(node, len(shape))) & dims
        if over:
            raise refused(node, f"it computes along dim {min(over)}, of the local sequence length {local} (a "
                                f"softmax, variance, norm, pooling or difference over the tokens): on a cp rank it "
                                f"sees the rank's chunks only; run without cp")


def dims_argument(node: fx.Node, rank: int) -> list[int]:
    """The dims ``node``'s op is given by name (``dim``, ``dims``, ``dimension``), made non-negative."""
    found: list[int] = []
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name not in ("dim", "dims", "dimension"):
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        values = [value] if isinstance(value, int) else list(value) if isinstance(value, (list, tuple)) else []
        found += [v % rank for v in values if isinstance(v, int) and rank]
    return found


def check_same_numbers(whole: fx.GraphModule, local: fx.GraphModule) -> None:
    """Refuses a number the model computes from the sequence's length (``x * (S / 8)``, ``S ** -0.5``): the
    rank's capture, on its ``local`` tokens, holds the local length's. Found where the two captures run the same
    ops in the same order (``difflib``'s matching runs of ops; the rank's may hold more, such as its loss divided
    by the global count): a float argument, or an integer argument of a pointwise op, that differs between them.
    (Lengths given as shapes are the rank's to differ.)"""
    ops = [[n for n in gm.graph.nodes if n.op == "call_function"] for gm in (whole, local)]
    runs = difflib.SequenceMatcher(None, *[[str(n.target) for n in nodes] for nodes in ops], autojunk=False)
    pairs = [(ops[0][i + k], ops[1][j + k]) for i, j, size in runs.get_matching_blocks() for k in range(size)]
    for w, n in pairs:
        if n.target in SKIPPED_NUMBERS or len(w.args) != len(n.args) or w.kwargs.keys() != n.kwargs.keys():
            continue  # (an attention's mask may be folded to ``is_causal`` on a chunk: ``same_attention``'s)
        pointwise = isinstance(n.target, torch._ops.OpOverload) and torch.Tag.pointwise in n.target.tags
        for a, b in zip([*w.args, *w.kwargs.values()], [*n.args, *[n.kwargs[k] for k in w.kwargs]]):
            if isinstance(b, bool) or not isinstance(b, (int, float)) or a == b or (a != a and b != b):
                continue
            if isinstance(b, float) or pointwise:
                raise refused(n, f"it takes {b} on a rank's chunks but {a} on whole sequences: a number computed "
                                 f"from the sequence's length, which a cp rank's capture sees as its local length; "
                                 f"pass it as an input or a constant, or run without cp")


def check_no_branch_on_length(whole: fx.GraphModule, local: fx.GraphModule) -> None:
    """Refuses a pointwise op that one of the graphs on whole sequences and on a rank's chunks (``local``) runs and
    the other does not (``if S > 6: x = x.tanh()``, a Python loop over the tokens: the model's Python branches or
    loops on the sequence's length, and each rank took the local length's way), unless it only builds an
    attention's mask, which the rank takes from the whole graph, or divides by the loss's whole-batch count.
    Matched as ``check_same_numbers`` matches (runs of ops)."""
    ops = [[n for n in gm.graph.nodes if n.op == "call_function"] for gm in (whole, local)]
    runs = difflib.SequenceMatcher(None, *[[str(n.target) for n in nodes] for nodes in ops], autojunk=False)
    matched = {ops[side][block[side] + k] for block in runs.get_matching_blocks() for k in range(block[2])
               for side in (0, 1)}
    for gm, where in ((whole, "on whole sequences but not on a cp rank's chunks"),
                      (local, "on a cp rank's chunks but not on whole sequences")):
        live, masks = live_nodes(gm.graph), _mask_only(gm.graph)
        for node in gm.graph.nodes:
            if node.op == "call_function" and node in live and node not in matched and node not in masks and \
                    isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags \
                    and not _reads_count(node):
                raise refused(node, f"the model runs it {where}: its Python branches or loops on the sequence's "
                                    f"length (if S > ..., for t in range(S)), and a rank follows its local length; "
                                    f"branch on a constant, or run without cp")


def _reads_count(node: fx.Node) -> bool:
    """Whether ``node`` reads the loss's whole-batch count (``passes/global_count.py``: the rank's graph only)."""
    return any(a.op == "placeholder" and a.name.startswith("loss_count_") for a in node.all_input_nodes)


def _mask_only(graph: fx.Graph) -> set[fx.Node]:
    """The nodes whose every use ends in an attention's mask argument (the masks the rank evaluates whole)."""
    found: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        users = list(node.users)
        if users and all(u in found or (u.target is aten.scaled_dot_product_attention.default
                                        and node in u.args[3:4] + tuple(u.kwargs.values())) for u in users):
            found.add(node)
    return found


def moved_dims(node: fx.Node, shape: tuple[int, ...], local: int) -> list[int]:
    """The dims a ``MOVES`` op moves values along (a roll without dims: all), or a convolution's spatial dims of
    the local length that its kernel spans (wider than 1)."""
    if node.target in CONVOLUTIONS:
        kernel = tuple(node.args[1].meta["val"].shape)[2:]
        return [2 + i for i, k in enumerate(kernel) if k > 1 and shape[2 + i] == local]
    if node.target not in MOVES or not shape:
        return []
    at, default = MOVES[node.target]
    dim = node.args[at] if at is not None and len(node.args) > at else node.kwargs.get("dim")
    dim = default if dim is None else dim
    dims = [dim] if isinstance(dim, int) else list(dim) or list(range(len(shape)))
    return [d % len(shape) for d in dims]


def _batch_sizes(kinds: dict[fx.Node, SlotKind], local: int) -> set[int] | None:
    """The sizes dim 0 of a (batch, sequence, ...) value has: the batch of the inputs holding the local sequence at
    dim 1, or 1 (broadcast); None where no input does (then any leading size counts)."""
    found = {tuple(n.meta["val"].shape)[0] for n, kind in kinds.items() if kind is SlotKind.INPUT
             and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() >= 2
             and n.meta["val"].shape[1] == local}
    return found | {1} if found else None


def _batch_first(shape: tuple[int, ...] | torch.Size, batches: set[int] | None) -> bool:
    """Whether ``shape`` may be (batch, sequence, ...): not the tokens flattened, (batch * sequence, ...)."""
    return batches is None or (len(shape) > 0 and shape[0] in batches)


def sequence_dims(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Where a value's sequence dim may be: 1 (batch first), and 2 of a 4-dim (batch, heads, sequence, dim)."""
    return (1, 2) if len(shape) == 4 else (1,) if len(shape) >= 2 else ()


def live_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes the outputs depend on (checks such as ``_assert_tensor_metadata`` keep nothing alive)."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    seen, todo = set(), [output]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return seen


def dim_of(node: fx.Node) -> int:
    return node.args[1] if len(node.args) > 1 else 0


def model_state(node: object, kinds: dict[fx.Node, SlotKind]) -> bool:
    return isinstance(node, fx.Node) and kinds.get(node) in (SlotKind.PARAM, SlotKind.BUFFER, SlotKind.CONSTANT)


def check_constants_of_the_length(graph: fx.Graph, kinds: dict[fx.Node, SlotKind], whole: fx.GraphModule | None,
                                  local: int) -> None:
    """No live constant tensor of the rank's graph is sized by the sequence's length: a tensor built in Python
    from it (``torch.tensor(range(S))``, a list of positions) is captured as a constant holding the local length's
    values, the same on every cp rank, where one device's holds the whole sequence's (it trained silently wrong);
    found by its shape differing from the constant of the same name captured on whole sequences."""
    if whole is None:
        return
    shapes = {n.name: tuple(n.meta["val"].shape) for n in whole.graph.nodes
              if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)}
    for node in graph.nodes:
        if node.op != "placeholder" or kinds.get(node) is not SlotKind.CONSTANT or not node.users:
            continue
        shape = tuple(node.meta["val"].shape) if isinstance(node.meta.get("val"), torch.Tensor) else None
        if shape is not None and local in shape and shapes.get(node.name, shape) != shape:
            raise refused(node, f"a constant tensor of shape {shape} here is {shapes[node.name]} on whole "
                                f"sequences: built in Python from the sequence's length (torch.tensor(range(S)), "
                                f"a list of positions), it holds the local length's values on every cp rank; build "
                                f"it with torch.arange(S), pass it as an input, or run without cp")
