"""Gradient buckets: how a rank's gradients, in the order backward produces them, are cut into collectives.

One rule serves data parallelism's all-reduces (``runtime.grad_sync``), ZeRO's
reduce-scatters (``core.zero_layout``) and the planner's cost of both
(``autopar.planner.cost_model``), so the three agree. As DDP does, a bucket closes once
it holds at least its cap (the first bucket's cap is ``FIRST_BUCKET_BYTES``,
the others' ``bucket_bytes``) or when the dtype changes; a tensor is never
split. The small first bucket is launched early in backward, so its
collective overlaps the rest of backward even when one ``bucket_bytes`` holds
the whole model.
"""
from __future__ import annotations

import math
from typing import Hashable

FIRST_BUCKET_BYTES = 2**20  # DDP's dist._DEFAULT_FIRST_BUCKET_BYTES


def first_cap(bucket_bytes: int) -> int:
    """The first bucket's cap: ``FIRST_BUCKET_BYTES``, or ``bucket_bytes`` when that is smaller."""
    return min(FIRST_BUCKET_BYTES, bucket_bytes)


def assign_buckets(nbytes: list[int], kinds: list[Hashable], bucket_bytes: int) -> list[list[int]]:
    """Indices of tensors (sizes ``nbytes``, dtypes ``kinds``, in arrival order) grouped into buckets.

    Invariant: the buckets, concatenated, are ``range(len(nbytes))`` in order; each holds one kind.
    """
    buckets: list[list[int]] = []
    size = 0
    for i, (n, kind) in enumerate(zip(nbytes, kinds)):
        cap = first_cap(bucket_bytes) if len(buckets) == 1 else bucket_bytes
        if not buckets or size >= cap or kinds[buckets[-1][0]] != kind:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += n
    return buckets


def bucket_sizes(total: float, bucket_bytes: int) -> list[float]:
    """Bytes of each bucket that ``total`` bytes of gradients make, in launch order (the planner's view).

    As if tensors could be cut anywhere: the first bucket holds ``first_cap``,
    each next one ``bucket_bytes``, the last what is left. The last bucket is
    complete only when backward ends, so its collective is the one that never
    overlaps backward.
    """
    first = min(first_cap(bucket_bytes), total)
    rest = total - first
    full = max(0, math.ceil(rest / bucket_bytes) - 1)
    return [first, *[bucket_bytes] * full, *([rest - full * bucket_bytes] if rest > 0 else [])]
