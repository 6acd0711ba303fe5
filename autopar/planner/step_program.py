"""The events one rank issues in a step, in the order the runtime issues them (simulated by ``step_sim.py``).

Per microbatch, the rank's units (its stages' segments, in pipeline order) run
forward, then backward in reverse; each unit computes, then runs its tp
collectives on the tp link (the next unit waits for them). Data parallelism
adds, as ``runtime/zero.py`` and ``runtime/zero_group.py`` issue them:

- **ZeRO-3**, per flat group (a layer's own parameters, or one module's that
  several units use, such as a tied embedding). Forward: a unit waits for the
  gathers of the groups it is first to use (issued there unless prefetched),
  and once a gather has arrived the gathers of the next ``prefetch`` groups in
  forward order are issued. Backward: as a unit's backward begins, the
  re-gathers of its groups not yet issued are issued, then those of the next
  ``prefetch`` groups in backward order, then it waits for its own. When a
  group's last backward use ends, the reduce-scatter still in flight is waited
  for and the group's is issued (one in flight at a time, across microbatches);
  the last is waited for at the end of the step.
- **ZeRO 0-2**, gradient buckets (``autopar.core.buckets``): each bucket's
  collective is issued once backward has produced its bytes (with
  ``overlap``; else all after the last backward, as Megatron-LM's 2021 runs
  did). ZeRO-2 reduces in every microbatch, ZeRO 0 and 1 in the last only;
  ZeRO 1-2's reductions share ZeRO's queue (one in flight), DDP's all-reduces
  do not wait for each other. All are waited for at the end of the step.
- **Hybrid sharding** (``replicate``): in the last microbatch, as ZeRO's
  queue waits for a reduction (before the next, or at the end of the step),
  the all-reduce of that group's (or buckets') shard gradient across the
  replicas is issued on their link (``runtime/zero_group.py``'s
  ``ReplicaReduce``), beside the rest of backward.
- **ZeRO-3 per submodule** (``fetch``: DeepSpeed's ZeRO-3 of 2021): a
  gather per parameter as each submodule runs (``submodule_fetch.py``).

Invariant: every ZeRO-3 group is gathered once per forward and once per
backward (``regathers`` times: a runtime that gathers a recomputed layer for
its recomputed forward and again for its backward, as DeepSpeed's ZeRO-3
hooks do, has its two back to back in one event) and reduce-scattered once
per microbatch; every bucket is reduced once per reducing microbatch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from autopar.planner.step_sim import Event, Kind
from autopar.planner.submodule_fetch import Coordinator, Submodule, SubmoduleFetch


@dataclass(frozen=True)
class Unit:
    """One unit's seconds per microbatch and what data parallelism reads of it."""

    forward: float  # compute
    backward: float  # compute, with what recomputation redoes
    tp_forward: float = 0.0
    tp_backward: float = 0.0
    groups: tuple[int, ...] = ()  # ZeRO-3 groups it uses, in the order it uses them
    gradients: float = 0.0  # bytes of gradients complete when its backward ends (buckets)
    submodules: tuple[Submodule, ...] = ()  # ZeRO-3 per submodule (``DataParallelPlan.fetch``), in forward order
    recomputed: bool = False  # its backward redoes its forward (full recomputation of a layer)


@dataclass(frozen=True)
class Buckets:
    """Gradient buckets as ``autopar.core.buckets.bucket_sizes`` cuts ``total`` bytes: ``first``, then ``size``
    each, the last what is left; ``seconds(nbytes, count)``: of ``count`` of them moving ``nbytes`` in all."""

    total: float
    first: float
    size: float
    seconds: Callable[[float, int], float] | None = None

    @property
    def count(self) -> int:
        rest = self.total - self.first
        return 1 + (math.ceil(rest / self.size) if rest > 0 else 0)

    def end(self, k: int) -> float:
        """Bytes produced when bucket ``k`` (from 0) is complete."""
        return 0.0 if k < 0 else min(self.first + k * self.size, self.total)

    def complete(self, produced: float) -> int:
        """How many buckets ``produced`` bytes complete."""
        if produced >= self.total * (1 - 1e-12):
            return self.count
        return 0 if produced < self.first else min(1 + int((produced - self.first) // self.size), self.count - 1)


@dataclass(frozen=True)
class DataParallelPlan:
    """What the dp axis runs: ZeRO-3 groups' seconds, or buckets' (end offset in bytes, seconds)."""

    zero: int
    link: str  # the stream of the dp collectives
    prefetch: int = 1
    gather: tuple[float, ...] = ()  # seconds of each ZeRO-3 group's all-gather
    reduce: tuple[float, ...] = ()  # ... and of its gradient's reduce-scatter(s)
    buckets: Buckets | None = None  # ZeRO 0-2
    overlap: bool = True  # buckets issued as backward produces them
    names: tuple[str, ...] = ()  # each group's name ("unit 3": a unit's own parameters; a module's name)
    regathers: int = 1  # all-gathers of a ZeRO-3 group per backward (2: the recomputed forward's, then backward's)
    # hybrid sharding: seconds of each ZeRO-3 group's shard gradient all-reduced across the replicas; for buckets,
    # of ``count`` buckets' moving ``nbytes`` of (unsharded) gradient in all
    replicate: tuple[float, ...] = ()
    replicate_buckets: Callable[[float, int], float] | None = None
    replicate_link: str = ""
    fetch: SubmoduleFetch | None = None  # ZeRO-3 per submodule; ``gather`` and ``reduce`` are then per parameter
    elements: tuple[int, ...] = ()  # ... and each parameter's elements


class _Reductions:
    """ZeRO's queue: the reduction in flight (its event, what it reduces, whether it is the step's last of that),
    and, under hybrid sharding, the all-reduce across replicas that follows the last one once it is waited for."""

    def __init__(self, b: "_Builder", dp: DataParallelPlan) -> None:
        self.b, self.dp = b, dp
        self.event: int | None = None
        self.what: tuple[int, int] | int = 0  # a ZeRO-3 group, or buckets ``start .. stop - 1``
        self.final = False
        self.hybrid = bool(dp.replicate or dp.replicate_buckets)

    def issue(self, event: int, what: tuple[int, int] | int, final: bool) -> None:
        self.event, self.what, self.final = event, what, final

    def land(self) -> None:
        """The host waits for the reduction in flight; a final one's all-reduce across replicas is issued."""
        if self.event is None:
            return
        self.b.wait((self.event,))
        self.event = None
        dp = self.dp
        if not (self.final and self.hybrid):
            return
        if isinstance(self.what, tuple):
            start, stop = self.what
            name, nbytes = _span(dp.buckets, start, stop)
            seconds = dp.replicate_buckets(nbytes, stop - start)
        else:
            seconds, name = dp.replicate[self.what], self.b.group(self.what)
        self.b.collective(Kind.REPLICATE, f"all_reduce {name} across replicas", seconds, dp.replicate_link)


class _Builder:
    def __init__(self, tp_link: str, names: tuple[str, ...]) -> None:
        self.names = names
        self.events: list[Event] = []
        self.tp_link = tp_link
        self.pending: list[int] = []  # collectives not waited for yet
        self.last_tp: int | None = None  # the tp collective the next compute waits for

    def emit(self, kind: Kind, name: str, seconds: float = 0.0, stream: str = "compute",
             after: tuple[int, ...] = ()) -> int:
        self.events.append(Event(kind, name, seconds, stream, after))
        return len(self.events) - 1

    def group(self, g: int) -> str:
        return self.names[g] if self.names else str(g)

    def collective(self, kind: Kind, name: str, seconds: float, link: str) -> int:
        i = self.emit(kind, name, seconds, link)
        self.pending.append(i)
        return i

    def compute(self, name: str, seconds: float, tp: float, waits: tuple[int, ...] = ()) -> None:
        after = waits + ((self.last_tp,) if self.last_tp is not None else ())
        self.emit(Kind.COMPUTE, name, seconds, after=after)
        self.last_tp = self.emit(Kind.TP, name, tp, self.tp_link) if tp else None

    def wait_all(self, name: str) -> None:
        """The host waits for everything issued (``torch.cuda.synchronize``; the end of the step)."""
        self.wait(tuple(self.pending) + ((self.last_tp,) if self.last_tp is not None else ()), name)
        self.pending, self.last_tp = [], None

    def wait(self, on: tuple[int, ...], name: str = "") -> None:
        """The host waits for ``on`` (named after the first, unless ``name``)."""
        if on:
            self.emit(Kind.WAIT, name or f"wait {self.events[on[0]].name}", after=on)


def step_program(units: list[Unit], dp: DataParallelPlan | None, microbatches: int, tp_link: str = "tp",
                 marks: list[int] | None = None) -> list[Event]:
    """The events of ``microbatches`` microbatches of a rank holding ``units`` (the module doc); events name
    compute by unit index (``"backward 3"``) and collectives by group (``dp.names``, else the group's index).
    ``marks`` receives how many events each microbatch ends after."""
    b = _Builder(tp_link, dp.names if dp is not None else ())
    queue = _Reductions(b, dp) if dp is not None else None
    coordinator = None
    if queue is not None and dp.fetch is not None and queue.hybrid:
        raise ValueError("ZeRO-3 gathered per submodule (DeepSpeed's 2021 coordinator) is not modelled with hybrid "
                         "sharding; plan it with dp_shard=0 or without zero3_fetch")
    for k in range(microbatches):
        final = k == microbatches - 1
        reduces = dp is not None and (dp.zero >= 2 or final)
        if dp is not None and dp.fetch is not None:
            coordinator = coordinator or Coordinator(b, units, dp, microbatches)
            coordinator.microbatch(k)
        elif dp is not None and dp.zero == 3:
            _zero3_forward(b, units, dp)
            _zero3_backward(b, units, dp, queue, final)
        else:
            for i, u in enumerate(units):
                b.compute(f"forward {i}", u.forward, u.tp_forward)
            _backward_with_buckets(b, units, dp if reduces else None, queue, final)
        if marks is not None:
            marks.append(len(b.events))
    if queue is not None and queue.final and queue.hybrid:  # the last reduction waited for, its all-reduce issued
        queue.land()
    b.wait_all("end of step")
    return b.events


def _zero3_forward(b: _Builder, units: list[Unit], dp: DataParallelPlan) -> None:
    order = _first_uses(units)
    at = {g: n for n, g in enumerate(order)}
    issued: dict[int, int] = {}
    ready: set[int] = set()  # gathered in this pass (kept until the group's last forward use)
    for i, u in enumerate(units):
        for g in [g for g in u.groups if g not in ready]:
            if g not in issued:
                issued[g] = b.collective(Kind.GATHER, f"gather {b.group(g)}", dp.gather[g], dp.link)
            b.wait((issued[g],))
            ready.add(g)
            for nxt in order[at[g] + 1: at[g] + 1 + dp.prefetch]:
                if nxt not in issued:
                    issued[nxt] = b.collective(Kind.GATHER, f"gather {b.group(nxt)}", dp.gather[nxt], dp.link)
        b.compute(f"forward {i}", u.forward, u.tp_forward)


def _zero3_backward(b: _Builder, units: list[Unit], dp: DataParallelPlan, queue: _Reductions, final: bool) -> None:
    backward = list(reversed(units))
    order = _first_uses(backward)
    at = {g: n for n, g in enumerate(order)}
    last = {g: i for i, u in enumerate(backward) for g in u.groups}  # where each group's gradient completes
    issued: dict[int, int] = {}
    done: set[int] = set()
    for i, u in enumerate(backward):
        mine = [g for g in u.groups if g not in done]
        for g in mine:
            if g not in issued:
                issued[g] = b.collective(Kind.REGATHER, f"regather {b.group(g)}", dp.regathers * dp.gather[g],
                                         dp.link)
        if mine:  # then the next ``prefetch`` groups, before waiting for its own
            for nxt in order[at[mine[-1]] + 1: at[mine[-1]] + 1 + dp.prefetch]:
                if nxt not in issued:
                    issued[nxt] = b.collective(Kind.REGATHER, f"regather {b.group(nxt)}",
                                               dp.regathers * dp.gather[nxt], dp.link)
        done.update(mine)
        b.compute(f"backward {len(units) - 1 - i}", u.backward, u.tp_backward, tuple(issued[g] for g in mine))
        for g in [g for g in u.groups if last[g] == i]:
            queue.land()
            queue.issue(b.collective(Kind.REDUCE_SCATTER, f"reduce_scatter {b.group(g)}", dp.reduce[g], dp.link), g,
                        final)


def _backward_with_buckets(b: _Builder, units: list[Unit], dp: DataParallelPlan | None,
                           queue: _Reductions | None = None, final: bool = False) -> None:
    """Backward of one microbatch; with ``dp``, its gradient buckets issued as their bytes are produced (the
    buckets completed at one point issued as one collective: DDP's go out together, and ZeRO's queue waits for
    each before the next, so nothing runs between them either way)."""
    produced, issued = 0.0, 0
    buckets = dp.buckets if dp is not None else None

    def issue(done: int) -> None:
        nonlocal issued
        if done <= issued:
            return
        if dp.zero > 0:  # ZeRO's queue: one reduction in flight
            queue.land()
            if done - issued > 1:
                queue.issue(_buckets(b, dp, issued, done - 1), (issued, done - 1), final)
                queue.land()
                issued = done - 1
        event = _buckets(b, dp, issued, done)
        if dp.zero > 0:
            queue.issue(event, (issued, done), final)
        issued = done

    for i in reversed(range(len(units))):
        u = units[i]
        b.compute(f"backward {i}", u.backward, u.tp_backward)
        produced += u.gradients
        if buckets is not None and dp.overlap:
            issue(buckets.complete(produced))
    if buckets is not None:
        b.wait((b.last_tp,) if b.last_tp is not None else ())
        issue(buckets.count)


def _buckets(b: _Builder, dp: DataParallelPlan, start: int, stop: int) -> int:
    """One collective standing for buckets ``start`` .. ``stop - 1``."""
    name, nbytes = _span(dp.buckets, start, stop)
    return b.collective(Kind.BUCKET, name, dp.buckets.seconds(nbytes, stop - start), dp.link)


def _span(x: Buckets, start: int, stop: int) -> tuple[str, float]:
    """The name and the bytes of buckets ``start`` .. ``stop - 1``."""
    name = f"bucket {start}" if stop - start == 1 else f"buckets {start}-{stop - 1}"
    return name, x.end(stop - 1) - x.end(start - 1)


def _first_uses(units: list[Unit]) -> list[int]:
    """The groups in the order ``units`` first use them."""
    out: dict[int, None] = {}
    for u in units:
        out.update(dict.fromkeys(u.groups))
    return list(out)
