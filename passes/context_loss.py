"""A loss that sums over the tokens without dividing by their number, refused under cp
(``passes/context_parallel.py`` runs ``check_loss_is_a_token_mean`` on the rank's graph).

The runtime averages the loss and the gradients over the dp x cp ranks. That is the whole batch's value when each
rank's loss is a mean over its tokens (or a sum divided by the whole batch's count: ``passes/global_count.py``), and
under dp alone also when it is a mean over its samples (``ce(reduction="sum") / batch``): a dp rank's share of the
samples is divided by its own batch size. A cp rank holds every sample but a share of its tokens, and divides its
tokens' sum by the same batch size as one device, so the average over cp is the whole sum over cp: the loss and
every gradient come out ``cp`` times too small (trained silently wrong before).

Refused with ``UnsupportedError`` naming the node: a sum over all dims (``sum``, a loss op such as
``cross_entropy``, ``mse_loss`` or ``kl_div`` reduced by ``"sum"``) of a value holding the tokens (a dim of the
local sequence length after the batch, the tokens flattened, (batch * local, ...), or a value per position
reduced over the batch, ``losses.mean(0)``), reached from a scalar output
through affine ops with numbers (casts, scaling by a constant, sums and differences of terms). A division by a value
of the inputs (the count of ``global_count``) ends the path: that term is a mean over the whole batch's count.

Invariant: a graph that passes has no term of its scalar outputs that scales with the number of tokens a rank holds.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.core.graph import SlotKind
from autopar.passes.context_checks import model_state
from autopar.passes.context_masks import refused
from autopar.passes.global_count import PASS_THROUGH, SUM

aten = torch.ops.aten
AFFINE = {aten.add.Tensor, aten.sub.Tensor}  # both terms kept
SCALED = {aten.mul.Tensor, aten.div.Tensor}  # by a number or a constant: the term kept


def check_loss_is_a_token_mean(graph: fx.Graph, kinds: dict[fx.Node, SlotKind], local: int) -> None:
    """Refuses a term of a scalar output of ``graph`` (on ``local`` tokens of each sequence) that is a sum over the
    rank's tokens (the module doc)."""
    output = next(n for n in graph.nodes if n.op == "output")
    batches = {tuple(n.meta["val"].shape)[0] for n, kind in kinds.items() if kind is SlotKind.INPUT
               and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() >= 2
               and n.meta["val"].shape[1] == local}
    for term in _terms([v for v in output.args[0] if _scalar(v)], kinds):
        summed = term.args[0]
        if not model_state(summed, kinds) and (_holds_tokens(tuple(summed.meta["val"].shape), batches, local)
                                               or _per_position(summed, batches, local)):
            raise refused(term, f"the loss sums over the tokens of {tuple(summed.meta['val'].shape)} (local sequence "
                                f"length {local}) without dividing by their number: each cp rank holds a share of "
                                f"every sequence's tokens, and the loss is averaged over the cp ranks, so it and its "
                                f"gradients would be cp times too small; divide by the number of tokens (a mean, or "
                                f"a sum over a count of the inputs such as (target != -100).sum()), or run without "
                                f"cp")


def _terms(values: list[fx.Node], kinds: dict[fx.Node, SlotKind]) -> list[fx.Node]:
    """The sums over all dims that ``values`` are affine functions of, through ops with numbers or constants."""
    found, stack, seen = [], list(values), set()
    while stack:
        node = stack.pop()
        if not isinstance(node, fx.Node) or node in seen or node.op != "call_function":
            continue
        seen.add(node)
        if _total(node):
            found.append(node)
        elif node.target in PASS_THROUGH:
            stack.append(node.args[0])
        elif node.target in AFFINE:
            stack.extend(node.args[:2])
        elif node.target in SCALED:
            a, b = node.args[:2]
            if not _varies(b, kinds):
                stack.append(a)
            elif node.target is aten.mul.Tensor and not _varies(a, kinds):
                stack.append(b)
    return found


def _total(node: fx.Node) -> bool:
    """A sum over every dim: ``sum()``, ``sum(dims)`` naming all dims, or a loss op reduced by ``"sum"`` (a
    ``cross_entropy`` with ``reduction="sum"``; ``kl_div`` with ``"batchmean"``, which divides that by the batch)."""
    if node.target is aten.sum.default:
        return True
    if node.target is aten.sum.dim_IntList:
        rank = node.args[0].meta["val"].dim()
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return not dims or {d % max(rank, 1) for d in dims} == set(range(rank))
    return _reduction(node) == SUM


def _reduction(node: fx.Node) -> object:
    """The ``reduction`` argument of a loss op (``cross_entropy_loss``, ``kl_div``, ``mse_loss``, ...), else None."""
    schema = getattr(node.target, "_schema", None)
    for i, argument in enumerate(schema.arguments if schema is not None else ()):
        if argument.name == "reduction":
            return node.args[i] if i < len(node.args) else node.kwargs.get("reduction", argument.default_value)
    return None


def _holds_tokens(shape: tuple[int, ...], batches: set[int], local: int) -> bool:
    """``shape`` is (batch, ..., local, ...) with the local length after the batch, or (batch * local, ...)."""
    if not shape or not batches:
        return False
    return (shape[0] in batches | {1} and local in shape[1:]) or shape[0] in {b * local for b in batches}


def _per_position(node: fx.Node, batches: set[int], local: int) -> bool:
    """``node`` is (local, ...): a (batch, local, ...) value reduced over the batch (``losses.mean(0)``), whose
    sum is a sum over the tokens (a vector of as many experts as tokens, reduced from (batch * local, ...), is not)."""
    while node.op == "call_function" and node.target in PASS_THROUGH:
        node = node.args[0]
    if node.op != "call_function" or node.target not in (aten.mean.dim, aten.sum.dim_IntList):
        return False
    shape = tuple(node.args[0].meta["val"].shape)
    dims = node.args[1] if len(node.args) > 1 else None
    return len(shape) >= 2 and shape[0] in batches and shape[1] == local and bool(dims) and \
        [d % len(shape) for d in dims] == [0]


def _varies(value: object, kinds: dict[fx.Node, SlotKind]) -> bool:
    """Whether ``value`` is computed from a user input, a parameter or a buffer (not a number or a constant)."""
    if not isinstance(value, fx.Node):
        return False
    stack, seen = [value], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder" and kinds.get(node) is not SlotKind.CONSTANT:
            return True
        stack.extend(node.all_input_nodes)
    return False


def _scalar(value: object) -> bool:
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point()
