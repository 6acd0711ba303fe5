"""Attention masks under context parallelism: a cp rank's rows of the mask the whole-sequence graph computes.

A model builds an attention's mask from the sequence (Hugging Face: ``arange``s of query and key positions,
compared for causality and sliding windows, the (batch, sequence) padding mask indexed at key positions, the
position ids' packed-sequence ids indexed at both). On one rank's chunks those would be the wrong positions
and a part of the padding, and a capture at the local length may even fold a mask that binds on the whole
sequence into ``is_causal`` (a sliding window as long as a chunk). So the mask is taken from the graph
captured on whole sequences, and ``mask_rows`` copies its computation into the rank's graph with:

- each ``arange`` that indexes the mask's query dim (``Role.QUERY``) replaced by the rank's global positions,
  and each size the copy ``expand``s along that dim cut to the local length: the copy computes the rows of
  the rank's queries against all keys, (B, 1, local, S);
- everything the mask reads through an ``index`` (a (batch, sequence) value: the padding mask, position ids)
  computed on whole sequences as captured: each user input there gathered from the cp ranks' chunks
  (``autopar::cp_sequence``), ``arange``s of the whole length kept (they are whole-sequence positions).

Under ``cp_attention="all_to_all"`` a rank attends for every query of its head group: ``all_rows_of``
copies the mask's computation as it stands (every row, query ``arange``s of the whole length kept), its
inputs gathered the same way, after checking the mask by the same rules.

The roles come from the mask's dims backwards (``RULES``: one entry per op); a value read in two roles (one
``arange`` as queries and as keys) is copied once per role. A mask computed by an op with no rule on its
query or key dims, an input laid out over (query, key), or a query ``arange`` that is not of the whole
length is refused with ``UnsupportedError`` naming the node: never replaced.

Invariant: the copy's value equals the rows of the whole graph's mask at the rank's global query positions.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from autopar.core.errors import UnsupportedError
from autopar.core.graph import SlotKind, origin
from autopar.core.ring_attention import cp_positions, cp_sequence

aten = torch.ops.aten
POSITIONS, SEQUENCE = cp_positions._opoverload, cp_sequence._opoverload  # autopar::cp_positions, ::cp_sequence


class Role(enum.Enum):
    """What a dim of a mask value runs over."""

    QUERY = "query"
    KEY = "key"


Roles = tuple[Role | None, ...]  # per dim of a value (None: batch, heads or broadcast)
Use = tuple[fx.Node, Roles]  # a value read with its dims in those roles
ELEMENTWISE = {  # broadcasting ops masks are built with: the inputs' dims align with the output's from the right
    aten.__and__.Tensor, aten.__or__.Tensor, aten.__xor__.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
    aten.bitwise_not.default, aten.logical_and.default, aten.logical_or.default, aten.logical_not.default,
    aten.eq.Tensor, aten.ne.Tensor, aten.le.Tensor, aten.lt.Tensor, aten.ge.Tensor, aten.gt.Tensor,
    aten.eq.Scalar, aten.ne.Scalar, aten.le.Scalar, aten.lt.Scalar, aten.ge.Scalar, aten.gt.Scalar,
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.add.Scalar, aten.sub.Scalar, aten.mul.Scalar,
    aten.remainder.Scalar, aten.floor_divide.default, aten.abs.default, aten.where.self, aten.where.ScalarSelf,
    aten.where.ScalarOther, aten.masked_fill.Scalar, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
    aten._to_copy.default, aten.clone.default, aten.expand.default,
}
LIKE = {aten.new_ones.default, aten.new_zeros.default, aten.new_full.default}  # read their input's dtype, device
ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}


@dataclass
class MaskCopies:
    """The masks copied into one rank's graph, shared by the attentions that read the same mask."""

    graph: fx.Graph
    whole: fx.Graph
    kinds: dict[fx.Node, SlotKind]  # the rank graph's placeholders
    local: int
    axis: str
    whole_length: int = 0
    rows: dict[fx.Node, fx.Node] = field(default_factory=dict)  # whole graph's mask -> the rank's rows
    every_row: dict[fx.Node, fx.Node] = field(default_factory=dict)  # whole graph's mask -> all its rows
    gathered: dict[fx.Node, fx.Node] = field(default_factory=dict)  # rank's input -> its whole sequence

    def rows_of(self, mask: fx.Node, before: fx.Node) -> fx.Node:
        """The rank's rows of the whole graph's ``mask``, computed in the rank's graph before ``before``."""
        if mask not in self.rows:
            with self.graph.inserting_before(before):
                self.rows[mask] = self._copy(mask)
        return self.rows[mask]

    def all_rows_of(self, mask: fx.Node, before: fx.Node) -> fx.Node:
        """The whole graph's ``mask`` itself (every query's row, in sequence order), computed in the rank's
        graph before ``before`` as the whole graph computes it, its inputs gathered from the cp ranks: what an
        attention over the whole sequence for some heads reads. The same masks as ``rows_of`` are followed."""
        if mask not in self.every_row:
            self._roles(mask)  # refuses what the rows could not follow
            todo: set[fx.Node] = set()
            _whole(mask, todo)
            env: dict[fx.Node, fx.Node] = {}
            places = {n.name: n for n in _placeholders(self.graph)}
            with self.graph.inserting_before(before):
                for node in (n for n in self.whole.nodes if n in todo):
                    env[node] = self._node(node, None, env.__getitem__, places)
            self.every_row[mask] = env[mask]
        return self.every_row[mask]

    def _roles(self, mask: fx.Node) -> tuple[Roles, dict[Use, list[Use]], set[fx.Node]]:
        """The roles of ``mask``'s dims, what each value over them reads, the values read on whole sequences."""
        shape = tuple(mask.meta["val"].shape)
        self.whole_length = shape[-1]
        if len(shape) < 2 or shape[-2] not in (1, shape[-1]):
            raise refused(mask, f"the attention's mask has shape {shape}; context parallelism needs "
                                f"(..., S or 1, S) over queries and keys")
        out: Roles = (None,) * (len(shape) - 2) + (Role.QUERY if shape[-2] > 1 else None, Role.KEY)
        return (out, *_roles(mask, out))

    def _copy(self, mask: fx.Node) -> fx.Node:
        out, uses, whole_side = self._roles(mask)
        whole_env: dict[fx.Node, fx.Node] = {}  # values read on whole sequences, copied as they are
        rows_env: dict[Use, fx.Node] = {}  # values over query or key dims, over the rank's queries
        places = {n.name: n for n in _placeholders(self.graph)}  # the same signature, captured twice
        by_node: dict[fx.Node, list[Use]] = {}
        for use in uses:
            by_node.setdefault(use[0], []).append(use)
        for node in self.whole.nodes:  # in order: every input is copied before its users
            if node in whole_side:
                whole_env[node] = self._node(node, None, whole_env.__getitem__, places)
            for use in by_node.get(node, []):
                inputs = dict(uses[use])
                rows_env[use] = whole_env[node] if node in whole_side and not any(use[1]) else self._node(
                    node, use[1], lambda x: rows_env[(x, inputs[x])] if x in inputs else whole_env[x], places)
        return rows_env[(mask, out)]

    def _node(self, node: fx.Node, roles: Roles | None, env: Callable[[fx.Node], fx.Node],
              places: dict[str, fx.Node]) -> fx.Node:
        if node.op == "placeholder":
            if node.name not in places:
                raise refused(node, "the mask reads an input the graph of one cp rank does not have")
            return self._input(node, places[node.name])
        if roles and Role.QUERY in roles and node.target in ARANGES:
            return self._positions(node)
        val = node.meta.get("val")
        if node.target in LIKE:  # a constant: the input gave its dtype and device only
            fill = {aten.new_ones.default: 1, aten.new_zeros.default: 0}.get(node.target, node.args[-1])
            copy = self.graph.call_function(aten.full.default, (list(val.shape), fill),
                                            {"dtype": val.dtype, "device": val.device})
            copy.meta["val"] = val
            return copy
        args = fx.node.map_arg(node.args, env)
        if node.target is aten.expand.default and roles:
            args = (args[0], [self.local if r is Role.QUERY and s != -1 else s for s, r in zip(args[1], roles)])
        copy = self.graph.call_function(node.target, args, fx.node.map_arg(node.kwargs, env))
        if isinstance(val, torch.Tensor):
            copy.meta["val"] = val.new_empty([self.local if r is Role.QUERY else s
                                              for s, r in zip(val.shape, roles or (None,) * val.dim())])
        return copy

    def _input(self, whole: fx.Node, mine: fx.Node) -> fx.Node:
        """The rank's placeholder for a whole-graph one: model state as it is, a user input's chunks gathered."""
        if self.kinds.get(mine) in (SlotKind.PARAM, SlotKind.BUFFER, SlotKind.CONSTANT):
            return mine
        want, have = tuple(whole.meta["val"].shape), tuple(mine.meta["val"].shape)
        if want == have:
            return mine
        cut = len(want) > 1 and (want[1], have[1]) == (self.whole_length, self.local)
        if not cut or want[:1] + want[2:] != have[:1] + have[2:]:
            raise refused(whole, f"the mask reads the input {whole.name} of shape {want} on whole sequences and "
                                 f"{have} on one cp rank; context parallelism gathers (batch, sequence, ...) "
                                 f"inputs only")
        if mine not in self.gathered:
            gathered = self.graph.call_function(SEQUENCE, (mine, 1, self.axis, self.whole_length))
            gathered.meta["val"] = whole.meta["val"]
            self.gathered[mine] = gathered
        return self.gathered[mine]

    def _positions(self, node: fx.Node) -> fx.Node:
        """The rank's global positions for a query ``arange`` of the whole length."""
        if _length(node) != self.whole_length:
            raise refused(node, f"the mask's query positions come from {node.target} with arguments {node.args}, "
                                f"not an arange(0, {self.whole_length}) context parallelism can move")
        val = node.meta["val"]
        pos = self.graph.call_function(POSITIONS, (self.local, self.axis, val.device))
        pos.meta["val"] = val.new_empty(self.local, dtype=torch.int64)
        if val.dtype != torch.int64:
            pos = self.graph.call_function(aten._to_copy.default, (pos,), {"dtype": val.dtype})
            pos.meta["val"] = val.new_empty(self.local)
        return pos


# -- the roles of the mask's dims, backwards -----------------------------------------------------------------
def _roles(mask: fx.Node, out: Roles) -> tuple[dict[Use, list[Use]], set[fx.Node]]:
    """Every (value, roles of its dims) the mask computes over its query or key dims, with the (input, roles)
    each reads (one value may be read over queries and over keys: ``pos[None, :] - pos[:, None]``), and the
    values read on whole sequences (through an ``index``, or without a query or key dim), copied as they are."""
    uses: dict[Use, list[Use]] = {}
    whole_side: set[fx.Node] = set()
    todo = [(mask, out)]
    while todo:
        node, r = todo.pop()
        if (node, r) in uses:
            continue
        uses[(node, r)] = []
        if node.target in LIKE or node.target in ARANGES:  # a constant of the given size (``MaskCopies._node``)
            continue
        if not any(r) or (node.op == "placeholder" and Role.QUERY not in r):  # (keys only: read whole)
            _whole(node, whole_side)
            continue
        if node.op == "placeholder":
            raise refused(node, f"the mask reads the input {node.name} already laid out over (query, key) "
                                f"positions {tuple(node.meta['val'].shape)}; pass a (batch, sequence) padding mask")
        rule = RULES.get(node.target) if node.op == "call_function" else None
        if rule is None:
            raise refused(node, "the attention's mask is computed over its query or key positions by an op "
                                "context parallelism has no rule for; build the mask from aranges, comparisons "
                                "and a (batch, sequence) padding mask, or run without cp")
        uses[(node, r)] = rule(node, r)
        todo.extend(uses[(node, r)])
        for x in _read_whole(node):
            _whole(x, whole_side)
    return uses, whole_side


def _whole(node: fx.Node, into: set[fx.Node]) -> None:
    todo = [node]
    while todo:
        n = todo.pop()
        if n not in into:
            into.add(n)
            todo.extend(n.all_input_nodes)


def _aligned(node: fx.Node, out: Roles) -> list[tuple[fx.Node, Roles]]:
    """Broadcasting: each tensor input's dims take the roles of the output's they align with from the right."""
    return _align(node.all_input_nodes, out)


def _align(xs: list[fx.Node], out: Roles) -> list[tuple[fx.Node, Roles]]:
    found = []
    for x in xs:
        val = x.meta.get("val")
        if isinstance(val, torch.Tensor):
            tail = out[len(out) - val.dim():] if val.dim() else ()
            found.append((x, tuple(r if s != 1 else None for s, r in zip(val.shape, tail))))
    return found


def _unsqueezed(node: fx.Node, out: Roles) -> list[tuple[fx.Node, Roles]]:
    d = node.args[1] % len(out)
    return [(node.args[0], out[:d] + out[d + 1:])]


def _sliced(node: fx.Node, out: Roles) -> list[tuple[fx.Node, Roles]]:
    """A slice keeping a whole dim (``x[:, None, None, :]``) is the identity; another one has no rule."""
    x = node.args[0]
    dim, start, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:])[:4]
    if start not in (0, None) or step != 1 or (end is not None and end < x.meta["val"].shape[dim]):
        raise refused(node, f"the mask slices [{start}:{end}:{step}] along dim {dim}; context parallelism "
                            f"follows whole dims only")
    return [(x, out)]


def _indexed(node: fx.Node, out: Roles) -> list[tuple[fx.Node, Roles]]:
    """``x[i0, i1, ...]`` with an index per dim of ``x``: the indices take the output's roles; ``x`` is read on
    whole sequences (``_read_whole``)."""
    x, indices = node.args[0], list(node.args[1])
    if any(i is None for i in indices) or len(indices) != x.meta["val"].dim():
        raise refused(node, "the mask indexes a value with slices or fewer indices than dims; context parallelism "
                            "follows x[i0, i1, ...] with one index tensor per dim")
    return _align(indices, out)


def _read_whole(node: fx.Node) -> list[fx.Node]:
    return [node.args[0]] if node.target is aten.index.Tensor else []


RULES: dict[object, Callable[[fx.Node, Roles], list[tuple[fx.Node, Roles]]]] = {
    **{op: _aligned for op in ELEMENTWISE},  # broadcast: align from the right
    aten.unsqueeze.default: _unsqueezed,  # the new dim dropped
    aten.index.Tensor: _indexed,  # the index tensors take the output's dims
    aten.slice.Tensor: _sliced,  # a whole dim: the identity
}


# -- small helpers --------------------------------------------------------------------------------------------
def _length(node: fx.Node) -> int | None:
    """The length of an ``arange`` from 0 with step 1 (None otherwise)."""
    if node.target is aten.arange.default:
        return node.args[0] if isinstance(node.args[0], int) else None
    start, end = node.args[0], node.args[1]
    step = node.args[2] if node.target is aten.arange.start_step else 1
    return end if start == 0 and step == 1 and isinstance(end, int) else None


def _placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def _names(roles: Roles) -> str:
    return "(" + ", ".join(r.value if r else "-" for r in roles) + ")"


def refused(node: fx.Node, why: str) -> UnsupportedError:
    """An error naming ``node``, its op and the module of the user's model it is in, then ``why``."""
    where = f" ({origin(node)})" if origin(node) else ""
    return UnsupportedError(f"context parallelism: node {node.name} ({node.target}){where}: {why}")
