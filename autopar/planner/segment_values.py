"""A segment's numbers at one tp size, microbatch size and sequence length, as the cost model reads them.

``SegmentValues`` holds a segment's forward FLOPs, memory traffic, saved and
entering bytes, tp collectives and parameters as floats (or sympy expressions
in the microbatch size ``b``); the cost model makes one per ``(segment, tp,
b)`` and every layer of a kind shares it. ``state_elements`` counts what a
rank stores for the segments it holds.

Invariant: a layer's own parameters (under its module path) are stored once
per layer instance; every other parameter (the head's, the tail's, one a
layer uses but does not own) once per rank, whatever number of its segments
use it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SegmentValues:
    """A segment's numbers at one (tp, b, s): floats, or sympy expressions in ``b``."""

    flops: Any  # forward, counting a matmul of narrower weight dim w as (1 + cluster.narrow / w) times its FLOPs
    traffic: Any  # forward bytes read and written by memory-bound operators
    activations: Any  # bytes saved for backward per microbatch
    entering: Any  # bytes received per microbatch
    entering_head: Any  # the part of ``entering`` the head made (read by every layer, one tensor)
    kept_selective: Any  # bytes of matmul and attention outputs (kept by selective recomputation)
    communicated: Any  # bytes of tp collectives' forward outputs (kept by recomputation)
    collectives: tuple[tuple[str, str, Any], ...]  # (op, direction, bytes)
    ops: int
    params: dict[str, int]
    trainable: frozenset[str]
    kind: str
    owner: str  # a layer's module path and a dot: the parameters under it are the layer's own
    deferred: dict[str, int] = field(default_factory=dict)  # parameter -> its matmuls whose gradient W computes
    ring_kv: Any = 0  # bytes of the attentions' K and V per microbatch (a context-parallel ring's block)
    attention_flops: Any = 0  # forward FLOPs of the attentions (part of ``flops``)
    # derived: the parameters stored once per rank, and the elements of the others
    common: dict[str, int] = field(init=False, repr=False)
    own: int = field(init=False, repr=False)
    own_trainable: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        common = self.params if self.kind != "layer" else {
            k: e for k, e in self.params.items() if not k.startswith(self.owner)}
        object.__setattr__(self, "common", common)
        object.__setattr__(self, "own", sum(e for k, e in self.params.items() if k not in common))
        object.__setattr__(self, "own_trainable", sum(e for k, e in self.params.items()
                                                      if k not in common and k in self.trainable))

    def shared(self) -> dict[str, int]:
        """Parameters stored once per rank: the head's, the tail's, those a layer uses but does not own (T5's)."""
        return self.common


def state_elements(units: list[SegmentValues]) -> tuple[int, int]:
    """(parameter, trainable parameter) elements a rank stores for ``units``: every layer instance's own
    parameters, and once each the others (``SegmentValues.shared``: a tied embedding is one tensor)."""
    total = trainable = 0
    shared: dict[str, tuple[int, bool]] = {}
    for u in units:
        total += u.own
        trainable += u.own_trainable
        if u.common:
            shared.update({k: (e, k in u.trainable) for k, e in u.common.items()})
    return total + sum(e for e, _ in shared.values()), trainable + sum(e for e, t in shared.values() if t)
