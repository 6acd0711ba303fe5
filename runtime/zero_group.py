"""One flat group on one dp rank: its shard, its gradient, and the collectives that move them.

Invariant: ``shard`` holds this rank's slice ``[index * S, (index + 1) * S)`` of
the group's padded flat parameters, and after ``ReduceQueue.drain`` ``grad``
holds the same slice of the gradient averaged over the dp ranks (stages 2-3
allocate it during backward and drop it after the optimizer step, as torch's
``zero_grad(set_to_none=True)`` does for ordinary gradients). Stages 1 and
2 keep the full flat parameters (``full``) and the shard is a view into it, so
the optimizer's in-place update needs no copy; stage 1 also keeps the full flat
gradient (``grad_full``) with ``grad`` a view into it. Stage 3 keeps only the
shard; ``gather``/``prefetch`` materialise the full flat parameters on demand
(in another dtype when asked: mixed precision gathers bf16 copies of fp32
shards; the shard is cast straight into its own slice of the gathered buffer,
which the all-gather reads in place), and ``GatheredBytes`` measures how many
bytes of them are alive.
Gradients are reduced in ``reduce_dtype`` (default the parameters') and
accumulate into ``grad`` in the parameters' dtype. Under hybrid sharding the
group is the rank's ``dp_shard`` group, and ``ReplicaReduce`` averages each
``grad`` over the ``dp_replicate`` ranks holding the same slice: a group's
all-reduce starts as soon as the step's last reduction of it has landed, while
backward goes on (as FSDP2's hybrid sharding does), and the step waits for all
of them before the optimizer.
"""
from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.core.collectives import Binding
from autopar.core.mesh import DP_SUBAXES
from autopar.core.zero_layout import FlatGroup
from autopar.runtime.zero_trace import Span, ZeroEvent, ZeroTrace

# torch 2.13 renamed the flat-tensor collectives; older releases have only the first names
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _SliceAfter:
    """An all-reduce in flight; ``result`` is one rank's slice of the sum once waited on (copied into ``out``
    when one was given, else a view of the reduced tensor)."""

    def __init__(self, work: object, out: torch.Tensor | None, part: torch.Tensor) -> None:
        self.work, self.out, self.part = work, out, part

    def wait(self) -> None:
        self.work.wait()
        if self.out is not None and self.out.data_ptr() != self.part.data_ptr():
            self.out.copy_(self.part)

    @property
    def result(self) -> torch.Tensor:
        return self.out if self.out is not None else self.part


def reduce_scatter_async(out: torch.Tensor | None, flat: torch.Tensor, index: int,
                         group: dist.ProcessGroup | None = None, axis: str = "dp") -> object:
    """Starts reducing ``flat`` over ``group`` (the mesh axis ``axis``) into ``out``, rank ``index``'s slice of
    the sum; returns the work.

    gloo has no reduce-scatter of its own: torch emulates it by copying
    through per-rank buffers, and it measures 1.5x an all-reduce of the same
    tensor (4 ranks, 4-32 MB). There ``flat`` is all-reduced in place (so it
    is overwritten: pass a tensor nothing else reads) and the slice copied
    into ``out`` when the work is waited on; with ``out=None`` nothing is
    allocated and the work's ``result`` is a view of ``flat``. Other backends
    need ``out``.
    """
    if dist.get_backend(group) != "gloo":
        if out is None:
            raise ValueError(f"reduce_scatter_async on {dist.get_backend(group)} needs an output tensor")
        return reduce_scatter_flat(out, flat, group=group, async_op=True)
    n = flat.numel() // dist.get_world_size(group)
    return _SliceAfter(dist.all_reduce(flat, group=group, async_op=True), out, flat[index * n: (index + 1) * n])


class _AllOf:
    """Several works in flight, waited for as one."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def all_gather_async(full: torch.Tensor, group: dist.ProcessGroup | None = None) -> object:
    """Starts filling ``full`` (1-D) with every rank's slice of it, where each rank of ``group`` has already
    written its own (slice ``i`` of ``world_size`` equal ones on group rank ``i``); returns the work.

    On gloo, one broadcast per rank from its slice, in place: gloo's all-gather
    gathers into a temporary buffer of the whole size and copies each slice out
    of it, and measures 1.5-1.9x these broadcasts, which move the same bytes
    (2 ranks, 1-23 MB: ``benchmarks/zero_gloo_gather.py``). Other backends:
    their all-gather into ``full``.
    """
    n = dist.get_world_size(group)
    k = full.numel() // n
    if dist.get_backend(group) != "gloo":
        me = dist.get_rank(group)
        return all_gather_flat(full, full[me * k : (me + 1) * k], group=group, async_op=True)
    return _AllOf([dist.broadcast(full[i * k : (i + 1) * k], src=dist.get_global_rank(group, i) if group else i,
                                  group=group, async_op=True) for i in range(n)])


class GatheredBytes:
    """Live bytes of gathered (stage-3) parameter buffers, measured from their storages, and the peak."""

    def __init__(self) -> None:
        self._live: list[weakref.ref] = []
        self.peak = 0

    def add(self, full: torch.Tensor) -> None:
        self._live = [ref for ref in self._live if ref() is not None and ref().nbytes()]
        self._live.append(weakref.ref(full.untyped_storage()))
        self.peak = max(self.peak, self.live())

    def live(self) -> int:
        return sum(s.nbytes() for s in (ref() for ref in self._live) if s is not None)

    def reset_peak(self) -> None:
        self.peak = self.live()


@dataclass
class _Prefetch:
    work: object
    full: torch.Tensor
    version: int
    span: Span | None  # issued .. waited for, in the rank's ``ZeroTrace``

    @property
    def dtype(self) -> torch.dtype:
        return self.full.dtype


class FlatShard:
    """The state of one ``FlatGroup`` on rank ``index`` of ``group``, the ranks ``ranks`` of mesh axis ``axis``
    (``dp``, or ``dp_shard`` under hybrid sharding; ``group`` is ``None`` when the axis has one rank). Its
    collectives are counted on ``binding`` (the rank's, ``pm.communication()``), whatever thread runs them."""

    def __init__(self, spec: FlatGroup, *, index: int, group: dist.ProcessGroup | None, ranks: list[int],
                 device: torch.device, stage: int, tracker: GatheredBytes, queue: ReduceQueue,
                 reduce_dtype: torch.dtype | None = None, trace: ZeroTrace | None = None, axis: str = "dp",
                 binding: Binding | None = None, divisor: int | None = None) -> None:
        self.spec = spec
        self.divisor = divisor or len(ranks)  # a reduced gradient's sum is divided by it (routed experts: dp)
        self.binding = binding
        self.axis = axis
        self.trace = trace
        self.reduce_dtype = reduce_dtype or spec.dtype
        self.queue = queue
        self.index = index
        self.group = group
        self.ranks = list(ranks)
        self.stage = stage
        self.tracker = tracker
        lo, hi = index * spec.shard, (index + 1) * spec.shard
        self.full = torch.zeros(spec.padded, dtype=spec.dtype, device=device) if stage < 3 else None
        data = self.full[lo:hi] if self.full is not None else torch.zeros(spec.shard, dtype=spec.dtype, device=device)
        self.shard = torch.nn.Parameter(data)
        self.grad_full = torch.zeros_like(self.full) if stage == 1 else None
        # stage 1: a view of the full gradient; stages 2-3: allocated by the step's first reduction, dropped after it
        self.grad: torch.Tensor | None = self.grad_full[lo:hi] if self.grad_full is not None else None
        self.fresh = True  # no gradient accumulated into ``grad`` yet this step
        self._prefetched: _Prefetch | None = None

    def __repr__(self) -> str:
        spec = self.spec
        return f"FlatShard({spec.name!r}, {spec.numel} elements, shard {spec.shard} on rank {self.index})"

    def record(self, op: str, axis: str, t: torch.Tensor) -> None:
        """Counts one of this group's collectives on the rank's binding."""
        if self.binding is not None:
            self.binding.record(op, axis, t)

    # parameters ---------------------------------------------------------------
    def views(self, base: torch.Tensor) -> list[torch.Tensor]:
        """``base`` (a padded flat buffer of this group) cut into tensors shaped like the parameters."""
        return [base[o : o + k].view(s) for o, k, s in zip(self.spec.offsets, self.spec.numels, self.spec.shapes)]

    def _flat(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The group's padded flat parameters from full tensors, in ``dtype``."""
        flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])
        return torch.nn.functional.pad(flat, (0, self.spec.padded - self.spec.numel))

    def local_flat(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """This rank's slice of the group's padded flat parameters, from full tensors, in ``dtype`` (a copy)."""
        return self._flat(tensors, dtype)[self.index * self.spec.shard : (self.index + 1) * self.spec.shard].clone()

    def load_full(self, tensors: list[torch.Tensor]) -> None:
        """Sets the group's parameters from full tensors (this rank keeps its slice)."""
        flat = self._flat(tensors, self.spec.dtype)
        with torch.no_grad():
            if self.full is not None:
                self.full.copy_(flat)
            else:
                self.shard.copy_(flat[self.index * self.spec.shard : (self.index + 1) * self.spec.shard])

    def gather_from(self, shard: torch.Tensor) -> torch.Tensor:
        """The full padded flat tensor whose rank slices are every rank's ``shard`` (shaped as ``self.shard``,
        e.g. its float32 master), all-gathered over dp."""
        if self.group is None:
            return shard.detach().clone()
        full = torch.empty(self.spec.padded, dtype=shard.dtype, device=shard.device)
        all_gather_flat(full, shard.detach().contiguous(), group=self.group)
        return full

    def all_gather_in_place(self) -> object:
        """Stages 1-2: every rank's updated shard into ``full``; returns the work (None when done)."""
        if self.group is None:
            return None
        self.record("zero_all_gather", self.axis, self.shard)
        return all_gather_async(self.full, self.group)

    # stage 3 ------------------------------------------------------------------
    def _start_gather(self, dtype: torch.dtype, kind: ZeroEvent) -> _Prefetch:
        """Allocates the full buffer and gathers into it in place: this rank's shard is cast straight into its
        own slice, which is the collective's input (no separate copy of the shard in ``dtype``)."""
        span = self.trace.open(kind, self.spec.name) if self.trace is not None else None
        full = torch.empty(self.spec.padded, dtype=dtype, device=self.shard.device)
        self.tracker.add(full)
        lo = self.index * self.spec.shard
        mine = full[lo : lo + self.spec.shard]
        mine.copy_(self.shard.detach())
        if self.group is None:
            return _Prefetch(None, full, self.shard._version, span)
        self.record("zero_all_gather", self.axis, mine)
        work = all_gather_async(full, self.group)
        return _Prefetch(work, full, self.shard._version, span)

    def prefetch(self, dtype: torch.dtype | None = None, kind: ZeroEvent = ZeroEvent.GATHER) -> None:
        """Starts gathering the full flat parameters (in ``dtype``); the next ``gather`` waits for it.
        ``kind``: how the rank's trace names it (a forward gather, or backward's re-gather)."""
        if self._prefetched is None:
            self._prefetched = self._start_gather(dtype or self.spec.dtype, kind)

    @property
    def prefetched(self) -> bool:
        """Whether a gather of this group is in flight (issued and not yet taken by ``gather``)."""
        return self._prefetched is not None

    def gather(self, dtype: torch.dtype | None = None, kind: ZeroEvent = ZeroEvent.GATHER) -> torch.Tensor:
        """The full flat parameters (padded, in ``dtype``), from a prefetch when one is pending and current."""
        dtype = dtype or self.spec.dtype
        pending, self._prefetched = self._prefetched, None
        if pending is None or pending.dtype != dtype:
            if pending is not None:
                _finish(pending)
            pending = self._start_gather(dtype, kind)
        _finish(pending)
        if pending.version != self.shard._version:  # the shard changed after the prefetch was issued
            return self.gather(dtype, kind)
        return pending.full

    def drop_prefetch(self) -> None:
        if self._prefetched is not None:
            _finish(self._prefetched)
        self._prefetched = None

    # gradients ----------------------------------------------------------------
    def reduce_gradient(self, flat: torch.Tensor, *, wait: bool = True, owned: bool = False) -> None:
        """Stages 2-3: reduce-scatters the group's padded flat gradient (in ``reduce_dtype``); the average lands
        in ``grad``.

        ``owned``: nothing else reads ``flat``, so the reduction may overwrite it and release it when done.
        """
        if flat.dtype != self.reduce_dtype:
            flat, owned = flat.to(self.reduce_dtype), True
        self.queue.reduce_scatter(self, flat, wait=wait, owned=owned)

    def accumulate(self, reduced: torch.Tensor, *, in_place: bool) -> None:
        """Adds a reduce-scattered gradient slice (a sum over ranks) to ``grad`` as an average, in the
        parameters' dtype. Unless ``in_place`` (``reduced`` is ``grad``), keeps no reference to ``reduced``."""
        n = self.divisor
        with torch.no_grad():
            if in_place:  # stage 1: ``reduced`` is ``grad`` itself
                reduced.div_(n)
            elif self.grad_full is not None:  # stage 1 reduced in another dtype: back into the view
                self.grad.copy_(reduced).div_(n)
            elif self.fresh or self.grad is None:  # a new tensor: ``reduced`` may view a buffer about to be freed
                same = reduced.dtype == self.spec.dtype
                self.grad = torch.div(reduced, n) if same else reduced.to(self.spec.dtype).div_(n)
            else:
                self.grad.add_(reduced.to(self.spec.dtype), alpha=1.0 / n)
        self.fresh = False


class ReplicaReduce:
    """Hybrid sharding: each flat group's averaged shard gradient all-reduced over the rank's ``dp_replicate``
    group (the ``n`` ranks holding the same slices), in the group's ``reduce_dtype``, then divided by ``n``: each
    slice was averaged over its shard group, so it ends averaged over all of dp.

    ``start`` issues a group's all-reduce (the reduce queue calls it when the step's last reduction of the group
    lands, so it runs beside the rest of backward); ``finish`` starts those no final reduction started (a group
    its stage's last backward action did not reduce, or a stage armed as never last) and waits for every one.
    Replica ranks run the same program, so they issue the all-reduces in the same order."""

    def __init__(self, group: dist.ProcessGroup, n: int, trace: ZeroTrace | None = None) -> None:
        self.group, self.n, self.trace = group, n, trace
        self._pending: dict[FlatShard, tuple[torch.Tensor, object, Span | None]] = {}

    def started(self, fs: FlatShard) -> bool:
        return fs in self._pending

    def start(self, fs: FlatShard) -> None:
        if fs in self._pending or fs.fresh or fs.grad is None:
            return
        buf = fs.grad if fs.grad.dtype == fs.reduce_dtype else fs.grad.to(fs.reduce_dtype)
        span = self.trace.open(ZeroEvent.ALL_REDUCE, fs.spec.name) if self.trace is not None else None
        fs.record("zero_all_reduce", DP_SUBAXES[0], buf)
        self._pending[fs] = (buf, dist.all_reduce(buf, group=self.group, async_op=True), span)

    def finish(self, shards: list[FlatShard]) -> None:
        for fs in shards:
            self.start(fs)
        pending, self._pending = self._pending, {}
        with torch.no_grad():
            for fs, (buf, work, span) in pending.items():
                work.wait()
                if span is not None:
                    span.close()
                if buf is fs.grad:
                    buf.div_(self.n)
                else:
                    fs.grad.copy_(buf.div_(self.n))


def _finish(gather: _Prefetch) -> None:
    if gather.work is not None:
        gather.work.wait()
    if gather.span is not None:
        gather.span.close()


@dataclass
class _Reduction:
    """One reduce-scatter in flight: its averaged slice goes to ``shard`` when ``work`` completes."""

    shard: FlatShard
    work: object
    out: torch.Tensor | None  # None: the slice is read from the work's result (gloo, in place)
    src: torch.Tensor  # the flat gradient being reduced
    in_place: bool  # stage 1: ``out`` is the shard's gradient itself
    owned: bool  # nothing else reads ``src``: its storage is released once the slice is taken
    span: Span | None  # issued .. waited for, in the rank's ``ZeroTrace``
    final: bool  # the step's last reduction of ``shard``: its all-reduce across replicas follows it


class ReduceQueue:
    """Asynchronous reduce-scatters of flat gradients, at most ``inflight`` outstanding at a time.

    A flat gradient the queue owns (converted, copied or handed over with ``owned``) is released when its
    reduction completes, as gathered buffers are: gloo may keep a completed collective's tensor referenced
    for a while, and memory should follow the step, not that timing.

    Under hybrid sharding (``replicas``) a reduction issued while ``final`` is set is the step's last of its
    group (the owner sets ``final`` where that is known): when it lands, the group's all-reduce across the
    replicas starts. A reduction of a group whose all-reduce has started is refused (it would be lost).
    """

    def __init__(self, inflight: int = 1, trace: ZeroTrace | None = None,
                 replicas: ReplicaReduce | None = None) -> None:
        self.inflight = inflight
        self.trace = trace
        self.replicas = replicas
        self.final = False
        self._pending: deque[_Reduction] = deque()
        self.launched = 0  # reduce-scatters launched since construction (for tests and the plan)

    def _landed(self, shard: FlatShard, final: bool) -> None:
        """After ``shard``'s reduced slice was added to its gradient: its all-reduce across replicas, if final."""
        if self.replicas is not None and final:
            self.replicas.start(shard)

    def _check_open(self, shard: FlatShard) -> None:
        if self.replicas is not None and self.replicas.started(shard):
            raise RuntimeError(f"internal error: {shard} got a gradient reduction after its all-reduce across "
                               "replicas had started (its last reduction of the step was mistaken); please "
                               "report it with the model and the schedule")

    def reduce_scatter(self, shard: FlatShard, flat: torch.Tensor, *, wait: bool = True, owned: bool = False) -> None:
        """Reduce-scatters ``flat`` (the group's padded flat gradient) into a new slice, added to ``grad`` later.

        With ``wait``, older reduce-scatters beyond ``inflight`` are completed first; without, call ``limit``.
        ``owned``: nothing else reads ``flat``, so the reduction may overwrite it and free it when done.
        """
        self._check_open(shard)
        if shard.group is None:
            lo = shard.index * shard.spec.shard
            shard.accumulate(flat[lo : lo + shard.spec.shard].clone(), in_place=False)
            self._landed(shard, self.final)
            return
        gloo = dist.get_backend(shard.group) == "gloo"
        if not owned and gloo:
            flat, owned = flat.clone(), True  # gloo's reduction overwrites its input
        # gloo reduces in place and its slice is read when the work completes: no output buffer while in flight
        out = None if gloo else torch.empty(shard.spec.shard, dtype=flat.dtype, device=flat.device)
        span = self._open(shard)
        shard.record("zero_reduce_scatter", shard.axis, flat)
        work = reduce_scatter_async(out, flat, shard.index, shard.group, shard.axis)
        self._push(_Reduction(shard, work, out, flat, in_place=False, owned=owned, span=span, final=self.final))
        if wait:
            self.limit()

    def reduce_scatter_in_place(self, shard: FlatShard) -> None:
        """Stage 1: reduce-scatters ``grad_full`` into its own slice ``grad`` (through a copy in the shard's
        ``reduce_dtype`` when that differs)."""
        self._check_open(shard)
        if shard.group is None:
            shard.accumulate(shard.grad, in_place=True)
            self._landed(shard, self.final)
            return
        if shard.reduce_dtype != shard.grad_full.dtype:
            self.reduce_scatter(shard, shard.grad_full.to(shard.reduce_dtype), owned=True)
            return
        span = self._open(shard)
        shard.record("zero_reduce_scatter", shard.axis, shard.grad_full)
        work = reduce_scatter_async(shard.grad, shard.grad_full, shard.index, shard.group, shard.axis)
        self._push(_Reduction(shard, work, shard.grad, shard.grad_full, in_place=True, owned=False, span=span,
                              final=self.final))
        self.limit()

    def _open(self, shard: FlatShard) -> Span | None:
        return self.trace.open(ZeroEvent.REDUCE_SCATTER, shard.spec.name) if self.trace is not None else None

    def _push(self, reduction: _Reduction) -> None:
        self.launched += 1
        self._pending.append(reduction)

    def limit(self) -> None:
        """Completes the oldest reduce-scatters until at most ``inflight`` are outstanding."""
        while len(self._pending) > self.inflight:
            self._complete()

    def make_room(self) -> None:
        """Completes the oldest reduce-scatters until one more keeps at most ``inflight`` outstanding: called
        before a new one allocates its buffer, so that no more than ``inflight`` flat gradients are alive."""
        while self._pending and len(self._pending) >= self.inflight:
            self._complete()

    def _complete(self) -> None:
        r = self._pending.popleft()
        r.work.wait()
        if r.span is not None:
            r.span.close()
        r.shard.accumulate(r.out if r.out is not None else r.work.result, in_place=r.in_place)
        if r.owned:
            r.src.untyped_storage().resize_(0)
        self._landed(r.shard, r.final)

    def drain(self) -> None:
        while self._pending:
            self._complete()
