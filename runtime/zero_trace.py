"""ZeRO's per-layer events on one rank: when each gather and gradient reduction was issued and waited for, and
when each layer's backward computed. ``pm.timeline(layers=True)`` shows them among the step's actions.

An event is ``(what, start, end)`` in ``time.perf_counter`` seconds, the clock of the executor's timeline:

| what                    | start                                      | end                                         |
|-------------------------|--------------------------------------------|---------------------------------------------|
| ``gather <group>``      | a forward all-gather (or prefetch) issued  | waited for (the forward reads it), or dropped |
| ``regather <group>``    | backward's all-gather of a layer issued    | waited for (backward reads it), or dropped  |
| ``backward <group>``    | the layer's first saved parameter unpacked | the layer's parameter gradient complete     |
| ``reduce_scatter <group>`` | the gradient's reduction issued          | waited for (its slice added to the shard's gradient) |
| ``all_reduce <group>``  | hybrid sharding: the shard gradient's all-reduce across replicas issued | waited for (before the optimizer) |

Only the order and the times are recorded; nothing here waits or allocates.
"""
from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass


class ZeroEvent(enum.Enum):
    GATHER = "gather"
    REGATHER = "regather"
    BACKWARD = "backward"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"  # hybrid sharding: a shard gradient across the replicas


@dataclass
class Span:
    """One event: open from ``start`` until ``close()`` sets ``end``."""

    kind: ZeroEvent
    group: str
    start: float
    end: float | None = None

    def close(self) -> None:
        if self.end is None:
            self.end = time.perf_counter()

    def __str__(self) -> str:
        return f"{self.kind.value} {self.group}"


class ZeroTrace:
    """The rank's recent ZeRO events, oldest first (the last ``keep``; a step records a few per layer)."""

    def __init__(self, keep: int = 1 << 16) -> None:
        self.spans: deque[Span] = deque(maxlen=keep)

    def open(self, kind: ZeroEvent, group: str) -> Span:
        span = Span(kind, group, time.perf_counter())
        self.spans.append(span)
        return span

    def between(self, start: float, end: float) -> list[tuple[str, float, float]]:
        """``(what, start, end)`` of the events that started in ``[start, end]`` (an event still open ends at
        ``end``), in the order they were issued."""
        return [(str(s), s.start, s.end if s.end is not None else end) for s in self.spans if start <= s.start <= end]
