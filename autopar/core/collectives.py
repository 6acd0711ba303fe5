"""Named, autograd-aware collectives that rewritten graphs call: ``torch.ops.autopar.*``.

Each op is a ``torch.library`` custom op, so ``pm.graph(rank).code`` shows every
communication by name and axis. Forward placement decides backward, so that
autograd on the rank-local graph computes the single-device gradient (the
gradient of a value has the dual placement: Replicate <-> Partial, Shard(d) <->
Shard(d)):

| op                     | forward                  | backward        | placement change       |
|------------------------|--------------------------|-----------------|------------------------|
| all_reduce(x, axis)    | sum over the axis        | identity        | Partial -> Replicate   |
| grad_all_reduce(x, ax) | identity                 | sum over axis   | Replicate feeding sharded compute |
| all_gather(x, ax, d)   | concatenate along d      | local chunk     | Shard(d) -> Replicate  |
| all_gather_rs(x,ax,d)  | concatenate along d      | reduce-scatter  | Shard(d) -> Replicate feeding sharded compute |
| chunk(x, ax, d)        | local chunk along d      | all-gather      | Replicate -> Shard(d)  |
| reduce_scatter(x,ax,d) | sum, keep local chunk    | all-gather      | Partial -> Shard(d)    |
| all_to_all(x,ax,a,b)   | exchange chunks along b  | all_to_all(b,a) | Shard(a) -> Shard(b)   |
| to_partial(x, axis)    | x on index 0, else zeros | identity        | Replicate -> Partial   |

The same facts as data, for the solver, the lowering and the plan: ``OPS`` in ``autopar/core/comm.py``.

The process group of each axis comes from ``bind(binding)``, which the runtime
enters around every step; counts and bytes of every collective are kept on the
binding for tests and plans. Backward may run on autograd's own threads (CUDA's
device threads), where no ``bind`` block is active: what runs there carries the
binding its forward ran under (these ops' backward, a recomputed region,
re-gathered activations) and binds it again.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist


@dataclass
class Binding:
    """What the graph ops of the running rank reach: the process group of each axis, the ZeRO-3 group of each
    shard it feeds them, and what was communicated."""

    groups: dict[str, dist.ProcessGroup | None]
    counts: Counter = field(default_factory=Counter)  # (op, axis) -> calls
    bytes: Counter = field(default_factory=Counter)  # (op, axis) -> bytes sent per rank (payload size)
    # id of a ZeRO-3 shard -> its flat group: a runtime record the core layer holds without knowing its type
    # (runtime/zero_kernels.py checks it with isinstance when it reads it back)
    shards: dict[int, object] = field(default_factory=dict)
    # (what, start, end) perf_counter seconds a rank's host waited inside an op for a message (the ring's
    # K/V blocks): the exposed part of communication the ops overlap themselves; cleared by each step
    waits: list[tuple[str, float, float]] = field(default_factory=list)

    def group(self, axis: str) -> dist.ProcessGroup:
        g = self.groups.get(axis)
        if g is None:
            raise RuntimeError(f"no process group is bound for mesh axis {axis!r}")
        return g

    def record(self, op: str, axis: str, t: torch.Tensor) -> None:
        self.counts[(op, axis)] += 1
        self.bytes[(op, axis)] += t.numel() * t.element_size()


_BINDING: contextvars.ContextVar[Binding | None] = contextvars.ContextVar("autopar_binding", default=None)


@contextlib.contextmanager
def bind(binding: Binding | None) -> Iterator[Binding | None]:
    """The autopar ops inside the block run on ``binding`` (``None``: on whatever is bound already)."""
    if binding is None:
        yield None
        return
    token = _BINDING.set(binding)
    try:
        yield binding
    finally:
        _BINDING.reset(token)


def bound() -> Binding | None:
    """The binding active here, if any: what a forward hands to the backward work it leaves (module doc)."""
    return _BINDING.get()


def current() -> Binding:
    b = _BINDING.get()
    if b is None:
        raise RuntimeError("an autopar collective ran outside a bound runtime (no process groups); run the graph "
                           "through ParallelModel (pm.step / pm(...)), or inside autopar.core.collectives.bind()")
    return b


_GATHER_OBSERVER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("autopar_gathers", default=None)


@contextlib.contextmanager
def observe_gathers(observer: Callable[[torch.Tensor, torch.Tensor, str, int], None]) -> Iterator[None]:
    """Calls ``observer(shard, gathered, axis, dim)`` after every ``all_gather_rs`` run inside the block
    (``runtime/regather.py`` saves those outputs for backward as their shards)."""
    token = _GATHER_OBSERVER.set(observer)
    try:
        yield
    finally:
        _GATHER_OBSERVER.reset(token)


def _size_index(axis: str) -> tuple[int, int, dist.ProcessGroup]:  # noqa: D103
    g = current().group(axis)
    return dist.get_world_size(g), dist.get_rank(g), g


# -- the communication itself (plain functions; the ops below wrap them) ----------------------------
def _all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    out = x.contiguous().clone()
    current().record("all_reduce", axis, out)
    dist.all_reduce(out, group=current().group(axis))
    return out


def _all_gather(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    n, _, g = _size_index(axis)
    pieces = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(n)]
    current().record("all_gather", axis, x)
    dist.all_gather(pieces, x.contiguous(), group=g)
    return torch.cat(pieces, dim=dim)


def _chunk(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    n, i, _ = _size_index(axis)
    return x.chunk(n, dim=dim)[i].clone(memory_format=torch.contiguous_format)


def _all_to_all(x: torch.Tensor, axis: str, src_dim: int, dst_dim: int) -> torch.Tensor:
    """Shard(src_dim) -> Shard(dst_dim): rank i sends its chunk j along ``dst_dim`` to rank j, which
    concatenates what it receives along ``src_dim`` (1/n of the bytes of all-gather then chunk). The chunks
    travel as one flat tensor (``all_to_all_single``, which NCCL and gloo run on CPU and CUDA tensors alike)."""
    n, _, g = _size_index(axis)
    pieces = x.chunk(n, dim=dst_dim)
    sizes = [piece.numel() for piece in pieces]
    flat = torch.cat([piece.reshape(-1) for piece in pieces])
    received = torch.empty_like(flat)
    current().record("all_to_all", axis, x)
    dist.all_to_all_single(received, flat, output_split_sizes=sizes, input_split_sizes=sizes, group=g)
    outputs = [part.view(piece.shape) for part, piece in zip(received.split(sizes), pieces)]
    return torch.cat(outputs, dim=src_dim)


def _reduce_scatter(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    n, i, g = _size_index(axis)
    if dist.get_backend(g) == "gloo":  # gloo has no reduce-scatter: all-reduce, keep the local chunk
        full = x.contiguous().clone()
        dist.all_reduce(full, group=g)
        out = full.chunk(n, dim=dim)[i].clone(memory_format=torch.contiguous_format)
    else:
        pieces = [piece.contiguous() for piece in x.chunk(n, dim=dim)]
        out = torch.empty_like(pieces[i])
        dist.reduce_scatter(out, pieces, group=g)
    current().record("reduce_scatter", axis, out)  # the local piece, as an all-gather's
    return out


# -- ops ------------------------------------------------------------------------------------------
@torch.library.custom_op("autopar::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    return _all_reduce(x, axis)


@torch.library.custom_op("autopar::all_reduce_max", mutates_args=())
def all_reduce_max(x: torch.Tensor, axis: str) -> torch.Tensor:
    out = x.contiguous().clone()
    current().record("all_reduce_max", axis, out)
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=current().group(axis))
    return out


@torch.library.custom_op("autopar::grad_all_reduce", mutates_args=())
def grad_all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    return x.clone()


@torch.library.custom_op("autopar::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    return _all_gather(x, axis, dim)


@torch.library.custom_op("autopar::all_gather_rs", mutates_args=())
def all_gather_rs(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    out = _all_gather(x, axis, dim)
    observer = _GATHER_OBSERVER.get()
    if observer is not None:
        observer(x, out, axis, dim)
    return out


@torch.library.custom_op("autopar::chunk", mutates_args=())
def chunk(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    return _chunk(x, axis, dim)


@torch.library.custom_op("autopar::all_to_all", mutates_args=())
def all_to_all(x: torch.Tensor, axis: str, src_dim: int, dst_dim: int) -> torch.Tensor:
    return _all_to_all(x, axis, src_dim, dst_dim)


@torch.library.custom_op("autopar::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    return _reduce_scatter(x, axis, dim)


@torch.library.custom_op("autopar::to_partial", mutates_args=())
def to_partial(x: torch.Tensor, axis: str) -> torch.Tensor:
    _, i, _ = _size_index(axis)
    return x.clone() if i == 0 else torch.zeros_like(x)


# -- shapes without running (fake tensors), for shape propagation over rewritten graphs ----------------
_FAKE_SIZES: contextvars.ContextVar[dict[str, int]] = contextvars.ContextVar("autopar_fake_axis_sizes", default={})


@contextlib.contextmanager
def fake_axis_sizes(sizes: dict[str, int]) -> Iterator[None]:
    """Axis sizes for shape propagation at compile time, when no process group exists."""
    token = _FAKE_SIZES.set(sizes)
    try:
        yield
    finally:
        _FAKE_SIZES.reset(token)


def _tp_size(axis: str) -> int:
    sizes = _FAKE_SIZES.get()
    if axis in sizes:
        return sizes[axis]
    return dist.get_world_size(current().group(axis))


# -- what local replacements of ops (passes.rules.base.LocalOp) read at run time ---------------------
class AxisCollectives:
    """The collectives a local replacement (vocab-parallel cross-entropy, ...) may call, on one axis."""

    def __init__(self, axis: str) -> None:
        self.axis = axis

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return torch.ops.autopar.all_reduce(t, self.axis)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        return torch.ops.autopar.all_reduce_max(t.detach(), self.axis)


def axis_index(axis: str) -> int:
    """This rank's index on ``axis`` (0 during compile-time shape propagation)."""
    if axis in _FAKE_SIZES.get():
        return 0
    return dist.get_rank(current().group(axis))


def _fake(x: torch.Tensor, axis: str, *, gathered: int | None = None, chunked: int | None = None) -> torch.Tensor:
    """An empty tensor shaped like ``x``, dim ``gathered`` times the axis size and dim ``chunked`` divided by it."""
    shape = list(x.shape)
    if gathered is not None:
        shape[gathered] *= _tp_size(axis)
    if chunked is not None:
        shape[chunked] //= _tp_size(axis)
    return x.new_empty(shape)


for _same_shape in (all_reduce, all_reduce_max, grad_all_reduce, to_partial):
    _same_shape.register_fake(lambda x, axis: torch.empty_like(x))
all_gather.register_fake(lambda x, axis, dim: _fake(x, axis, gathered=dim))
all_gather_rs.register_fake(lambda x, axis, dim: _fake(x, axis, gathered=dim))
chunk.register_fake(lambda x, axis, dim: _fake(x, axis, chunked=dim))
all_to_all.register_fake(lambda x, axis, src_dim, dst_dim: _fake(x, axis, gathered=src_dim, chunked=dst_dim))
reduce_scatter.register_fake(lambda x, axis, dim: _fake(x, axis, chunked=dim))


# -- backward: forward placement decides it ---------------------------------------------------------
def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.args = inputs[1:]
    ctx.binding = _BINDING.get()  # backward binds it again (it may run on another thread)


def _bound_backward(formula: Callable[[Any, torch.Tensor], tuple]) -> Callable[[Any, torch.Tensor], tuple]:
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        with bind(ctx.binding):
            return formula(ctx, g)
    return backward


BACKWARD: dict[Callable, Callable[[Any, torch.Tensor], tuple]] = {  # op -> gradients of its arguments
    all_reduce: lambda ctx, g: (g, None),
    grad_all_reduce: lambda ctx, g: (all_reduce(g, ctx.args[0]), None),
    to_partial: lambda ctx, g: (g, None),
    all_gather: lambda ctx, g: (chunk(g, *ctx.args), None, None),
    all_gather_rs: lambda ctx, g: (reduce_scatter(g, *ctx.args), None, None),
    chunk: lambda ctx, g: (all_gather(g, *ctx.args), None, None),
    all_to_all: lambda ctx, g: (all_to_all(g, ctx.args[0], ctx.args[2], ctx.args[1]), None, None, None),
    reduce_scatter: lambda ctx, g: (all_gather(g, *ctx.args), None, None),
}
for _op, _formula in BACKWARD.items():
    _op.register_autograd(_bound_backward(_formula), setup_context=_setup)
