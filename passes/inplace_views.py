"""Writes through views under tensor parallelism: ``h[..., :5] = 0``, ``z[..., 1:] = h[..., :-1]``.

The captured graph keeps such writes as they are written: a view of a base value (``slice``, ``select``,
``view``) and an in-place op on it (``fill_``, ``copy_``, ``mul_``), whose effect is on the base, read by
the base's later users. The lowering treats values as values: where it converts the base or a view on the
way to the write (an all-gather before a slice across the shards), the write lands on the converted copy and
the base keeps its old values, so training silently differs from one device.

``aliased_edges(gm)`` finds the edges of such a chain (from the base through its views to the write) where
the written value is read after the write, on which the solver converts nothing (``passes.sharding_program``):
the chain is computed at one placement. A write whose result alone is read on (``x = relu_(x)``,
``nn.ReLU(inplace=True)``) is free: a copy written is then the value read;
``check_writes(gm)`` checks the lowered graph and refuses, naming the write, where a conversion is still
inside a chain, or where a conversion of the base made before the write is read after it (a stale copy).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.core.errors import UnsupportedError


def _schema(node: fx.Node) -> torch.FunctionSchema | None:
    return getattr(node.target, "_schema", None) if node.op == "call_function" else None


def written_argument(node: fx.Node) -> fx.Node | None:
    """The value ``node`` writes in place (its first argument whose schema marks it written), if any."""
    schema = _schema(node)
    if schema is None or not schema.is_mutable:
        return None
    for arg, value in zip(schema.arguments, node.args):
        if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, fx.Node):
            return value
    return None


def is_view(node: fx.Node) -> bool:
    """Whether ``node``'s output aliases its first argument without writing it (``slice``, ``view``, ...)."""
    schema = _schema(node)
    return (schema is not None and not schema.is_mutable and bool(node.args) and isinstance(node.args[0], fx.Node)
            and any(r.alias_info is not None for r in schema.returns))


def _is_conversion(node: fx.Node) -> bool:
    """An op the lowering inserted to move a value between placements (``autopar::all_gather``, ...)."""
    return node.op == "call_function" and getattr(node.target, "namespace", None) == "autopar"


def _chain(write: fx.Node) -> list[fx.Node]:
    """The views ``write`` writes through (and any conversion between them), from the written one back to
    their base (the base last)."""
    chain = [written_argument(write)]
    while is_view(chain[-1]) or _is_conversion(chain[-1]):
        chain.append(chain[-1].args[0])
    return chain


def _read_after(write: fx.Node, chain: list[fx.Node]) -> bool:
    """Whether a node after ``write`` reads the value it writes other than through its result: a user of the
    base or of a view on the way (``h[..., :5] = 0`` then ``down(h)``), not ``relu_``'s ``x = act(x)``."""
    order = {nd: i for i, nd in enumerate(write.graph.nodes)}
    inside = {write, *chain}
    return any(order[u] > order[write] for nd in chain for u in nd.users if u not in inside)


def aliased_edges(gm: fx.GraphModule) -> set[tuple[fx.Node, fx.Node]]:
    """``(value, user)`` for every step from an in-place write of ``gm`` back through the views it writes
    through to their base, where the value written is read after the write: the edges on which the solver
    converts nothing."""
    found: set[tuple[fx.Node, fx.Node]] = set()
    for node in gm.graph.nodes:
        if written_argument(node) is not None and _read_after(node, _chain(node)):
            chain = [node, *_chain(node)]
            found.update(zip(chain[1:], chain[:-1]))
    return found


def aliases_written(write: fx.Node) -> set[fx.Node]:
    """The base ``write`` writes through and every view of it: the values whose copies made before the write
    are stale after it (``passes.lower`` converts them again for later users)."""
    found, todo = set(), [_chain(write)[-1]]
    while todo:
        nd = todo.pop()
        found.add(nd)
        todo += [u for u in nd.users if u not in found and is_view(u) and u.args[0] is nd]
    return found


def _where(node: fx.Node) -> str:
    """The user's source line of ``node``, as the export recorded it, or the module that ran it."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    if len(trace) >= 2:
        return f" ({trace[-2].strip()}: {trace[-1].strip()})"
    modules = list((node.meta.get("nn_module_stack") or {}).values())
    return f" (in {modules[-1][0]})" if modules else ""


def check_writes(gm: fx.GraphModule, n: int) -> None:
    """Raises ``UnsupportedError`` where a lowered graph's in-place write would not reach its base (module doc)."""
    order = {nd: i for i, nd in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if written_argument(node) is None:
            continue
        chain = _chain(node)
        read_after = _read_after(node, [nd for nd in chain if not _is_conversion(nd)])
        converted = [nd for nd in chain if _is_conversion(nd)] if read_after else []
        stale = [c for c in chain[-1].users if _is_conversion(c)
                 and order[c] < order[node] and any(order[u] > order[node] for u in c.users)]
        if converted or stale:
            raise UnsupportedError(
                f"{node.name} writes in place into a view of {chain[-1].name}{_where(node)}, and tensor parallelism "
                f"(tp={n}) moves that value between ranks ({(converted or stale)[0].name}), so the write would "
                f"reach a copy, not the value its later users read; write it out of place (torch.where, "
                f"masked_fill, torch.cat or slice_scatter) or use tp=1")
