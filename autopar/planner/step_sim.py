"""A rank's step program simulated on streams: compute, and each link its collectives run on.

A program is the list of what one rank's host issues, in order
(``step_program.py`` builds it as the runtime issues it):

- ``COMPUTE``: a kernel on the compute stream; it starts when the stream is
  free and every event in ``after`` has ended (the host waits for them), and
  the host moves on when it ends (the host runs the compute, as a CPU rank
  does; a GPU host that runs ahead issues no earlier, since the runtime
  waits on each layer's gather before it launches the layer).
- ``WAIT``: the host waits for ``after`` to end, the compute stream idle.
- a collective (any other kind): issued where the host stands, it starts when
  its link is free (one collective at a time per link, in issue order) and
  ``after`` has ended; the host does not wait for it.

While any collective runs beside a compute kernel, the kernel progresses at
``1 - contention`` of its speed (``Cluster.contention``: the share of the
device's throughput the collective's kernels take).

Invariant: ``Timeline.end`` is at least the compute stream's busy time and at
least each link's busy time; with ``contention`` 1 overlapping a collective
with compute saves nothing.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

COMPUTE_STREAM = "compute"


class Kind(enum.Enum):
    COMPUTE = "compute"
    WAIT = "wait"
    TP = "tp"  # a tensor-parallel collective (the next compute waits for it)
    GATHER = "gather"  # ZeRO-3: a layer's parameters gathered for forward
    REGATHER = "regather"  # ... and again for backward
    REDUCE_SCATTER = "reduce_scatter"  # ZeRO-3: a layer's gradient
    BUCKET = "bucket"  # ZeRO 0-2: a gradient bucket's all-reduce or reduce-scatter
    REPLICATE = "replicate"  # hybrid sharding: the shards' gradients all-reduced across replicas


class Event(NamedTuple):
    kind: Kind
    name: str  # what it acts on: a unit index or a group, for reading and tests
    seconds: float = 0.0
    stream: str = COMPUTE_STREAM  # a link's name for a collective
    after: tuple[int, ...] = ()  # indices of earlier events that must end first


@dataclass
class Timeline:
    """When each event of a program started and ended, and what the compute stream lost."""

    start: list[float]
    end: list[float]
    issued: list[float]  # where the host stood when it issued the event
    waited: list[float]  # compute's idle seconds before a COMPUTE or WAIT event (0 for collectives)
    lost: list[float]  # seconds a COMPUTE event lost to contention (0 for the others)

    @property
    def makespan(self) -> float:
        return max(self.end, default=0.0)

    @property
    def stretch(self) -> float:
        """Seconds compute lost to contention."""
        return sum(self.lost)

    def upto(self, k: int) -> tuple[float, float]:
        """(makespan, stretch) of the first ``k`` events: a program's prefix that ends where another would (a
        shorter program whose final wait adds nothing the prefix's events do not)."""
        return max(self.end[:k], default=0.0), sum(self.lost[:k])


def simulate(program: list[Event], contention: float) -> Timeline:
    """Start and end of every event of ``program`` (the module doc)."""
    n = len(program)
    start, end, issued, waited, lost = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    free: dict[str, float] = {}
    intervals: dict[str, list[tuple[float, float]]] = {}  # each link's collectives, in order of start
    seen: dict[str, int] = {}  # each link's first interval that may still overlap compute
    host = 0.0  # the compute stream and the host move together
    latest = 0.0  # when the last collective issued so far ends
    for i, (_, _, seconds, stream, after) in enumerate(program):
        ready = 0.0 if not after else end[after[0]] if len(after) == 1 else max(end[j] for j in after)
        issued[i] = host
        if stream == COMPUTE_STREAM:
            s = host if host >= ready else ready
            waited[i] = s - host
            if seconds and contention and latest > s:
                d = _finish(intervals, seen, s, seconds, contention) - s
                lost[i] = d - seconds
            else:
                d = seconds
            start[i] = s
            host = end[i] = s + d
        else:
            s = max(host, ready, free.get(stream, 0.0))
            start[i] = s
            end[i] = t = s + seconds
            free[stream] = t
            if seconds:
                if t > latest:
                    latest = t
                intervals.setdefault(stream, []).append((s, t))
    return Timeline(start, end, issued, waited, lost)


def _finish(intervals: dict[str, list[tuple[float, float]]], seen: dict[str, int], at: float, work: float,
            contention: float) -> float:
    """When a kernel of ``work`` seconds started at ``at`` ends, at ``1 - contention`` of its speed while any link
    is busy (kernels start in time order, so a link's interval that ended before ``at`` is skipped for good)."""
    busy = []
    for stream, spans in intervals.items():
        k = seen.get(stream, 0)
        while k < len(spans) and spans[k][1] <= at:
            k += 1
        seen[stream] = k
        busy += spans[k:]
    busy.sort()
    rate, t = 1.0 - contention, at
    for lo, hi in busy:
        if hi <= t:
            continue
        if lo > t:  # alone until the next collective starts
            if work <= lo - t:
                return t + work
            work -= lo - t
            t = lo
        if rate > 0 and work <= (hi - t) * rate:
            return t + work / rate
        work -= (hi - t) * rate
        t = hi
    return t + work
