"""Context parallelism as the planner sees it: what cp changes in a configuration's memory and time.

A cp rank holds ``seq / cp`` tokens of every sequence (a balanced pair of chunks, ``i`` and ``2 cp - 1 - i``
of ``2 cp``, as ``Mesh(dp=, cp=)`` runs it), so per rank and microbatch:

- every per-token number of a segment is divided by ``cp``: FLOPs (linear parts exactly; the attention's
  quadratic part too, since the balanced causal chunks give every rank ``1 / cp`` of the attention's work),
  memory traffic, saved activations, entering bytes, tp collectives. The math path's saved attention matrix is
  divided by ``cp`` as well, an overestimate: the ring keeps per-block log-sum-exps, not the matrix;
- parameters, gradients and optimizer state are replicated over cp; ZeRO shards them over dp x cp
  (``Config.zero_ranks``, torchtitan's FSDP over ``dp_shard_cp``) and gradients are averaged over dp x cp;
- each attention exchanges K/V blocks around the cp ring (``passes/context_parallel.py`` on the runtime side):
  forward ``cp - 1`` blocks of the rank's K and V per microbatch; backward ``cp - 1`` blocks again and ``cp``
  exchanges of their gradients' partial sums (the last one home), ``2 cp - 1`` in all. Each exchange is
  started before the current block is computed, so a step exposes only ``max(0, send - block compute)``:
  a forward step's block is ``1 / cp`` of the rank's attention FLOPs, a backward step's twice that and it
  sends twice the bytes (K, V and dK, dV); the last gradient exchange home has nothing left to overlap.

With ``cp_attention="usp"`` (``Mesh(cp=(ring, a2a))``) each attention runs the all-to-alls of the heads exchange
on its ``a2a`` group (``heads_exchange_*`` at the a2a size, on the link that group spans) and then the ring of
``ring`` ranks on the exchanged tokens: the same K/V bytes per rank, blocks ``1 / ring`` of the rank's attention
(``ring_*`` at the ring size, on the link the whole cp group spans).

Invariant: at ``cp == 1`` ``sharded`` returns its values unchanged and the ring costs nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from autopar.planner.cluster import Link
from autopar.planner.comm_time import collective, p2p
from autopar.planner.expr import largest
from autopar.planner.segment_values import SegmentValues

LONG_SEQUENCE = 16_384  # tokens from which the planner searches cp even when a configuration without it fits
PER_TOKEN = ("flops", "traffic", "activations", "entering", "entering_head", "kept_selective", "communicated",
             "ring_kv", "attention_flops")


def context_sizes(devices: int, seq_len: int, allowed: tuple[int, ...] | None = None) -> list[int]:
    """The cp degrees above 1 a plan of ``devices`` can take: divisors of ``devices`` whose balanced split
    (``2 cp`` chunks) divides the sequence; only those in ``allowed`` when given."""
    return [n for n in range(2, devices + 1) if devices % n == 0 and seq_len % (2 * n) == 0
            and (allowed is None or n in allowed)]


def sharded(values: SegmentValues, cp: int) -> SegmentValues:
    """``values`` (a segment at one tp size and microbatch, whole sequences) as one cp rank of ``cp`` runs it:
    every per-token number divided by ``cp``, parameters unchanged."""
    if cp == 1:
        return values
    changes: dict[str, Any] = {k: getattr(values, k) / cp for k in PER_TOKEN}
    changes["collectives"] = tuple((op, d, nbytes / cp) for op, d, nbytes in values.collectives)
    return dataclasses.replace(values, **changes)


def ring_step(units: list[SegmentValues], cp: int, microbatches: int) -> tuple[int, int, Any]:
    """(attentions, exchanges, bytes) a cp rank holding ``units`` (already ``sharded``) sends in one step:
    per attention and microbatch ``cp - 1`` K/V blocks forward and ``2 cp - 1`` exchanges backward, each of the
    rank's K and V bytes (what ``passes/context_parallel.py`` adds to the runtime's plan)."""
    if cp == 1:
        return 0, 0, 0
    attentions = sum(1 for u in units if _has_ring(u))
    kv = sum(u.ring_kv for u in units)
    per = (cp - 1) + (2 * cp - 1)
    return attentions, attentions * microbatches * per, kv * microbatches * per


def ring_seconds(units: list[SegmentValues], cp: int, link: Link, flops_per_s: float) -> Any:
    """Exposed seconds of one microbatch's ring exchanges on a cp rank holding ``units`` (``sharded``), the
    block computations overlapping the sends (module doc)."""
    if cp == 1:
        return 0
    out: Any = 0
    for u in units:
        if not _has_ring(u):
            continue
        send = p2p(u.ring_kv, link)
        block = u.attention_flops / cp / flops_per_s
        forward = (cp - 1) * _exposed(send, block)
        backward = (cp - 1) * _exposed(2 * send, 2 * block) + send
        out += forward + backward
    return out


def ring_busy(units: list[SegmentValues], cp: int, link: Link) -> Any:
    """Seconds one microbatch's ring exchanges take on the link, overlapped or not."""
    return sum(p2p(u.ring_kv, link) for u in units if _has_ring(u)) * ((cp - 1) + (2 * cp - 1)) if cp > 1 else 0


def heads_exchange_step(units: list[SegmentValues], cp: int, microbatches: int) -> tuple[int, int, Any]:
    """(attentions, all-to-alls, bytes) a cp rank holding ``units`` (``sharded``) sends in one step with
    ``cp_attention="all_to_all"``: per attention and microbatch 4 all-to-alls forward (Q, K, V, the output) and
    4 backward (the output's gradient, dQ, dK, dV), each of the rank's whole tensor; Q and the output are taken
    as large as K (the rewrite requires every head count to divide by cp, and Hugging Face's attentions receive
    K and V with the query's heads after ``repeat_kv``), so the bytes are ``4 ring_kv`` per attention."""
    if cp == 1:
        return 0, 0, 0
    attentions = sum(1 for u in units if _has_ring(u))
    return attentions, attentions * microbatches * 8, sum(4 * u.ring_kv for u in units) * microbatches


def heads_exchange_seconds(units: list[SegmentValues], cp: int, link: Link) -> Any:
    """Seconds of one microbatch's all-to-alls on a cp rank holding ``units`` (``sharded``): 8 per attention of
    a K-sized tensor each, none overlapped (the attention waits for its inputs, backward for its gradient)."""
    if cp == 1:
        return 0
    return sum(8 * collective("all_to_all", cp * u.ring_kv / 2, cp, link) for u in units if _has_ring(u))


def usp_step(units: list[SegmentValues], split: tuple[int, int], microbatches: int) -> tuple[int, int, Any]:
    """(attentions, exchanges, bytes) of ``cp_attention="usp"`` on ``split`` = (ring, a2a): the all-to-alls at the
    a2a size plus the ring at the ring size (``Mesh(cp=(ring, a2a))``; ``passes/context_parallel.py``)."""
    ring, a2a = split
    attentions, exchanges, nbytes = heads_exchange_step(units, a2a, microbatches)
    _, blocks, ring_bytes = ring_step(units, ring, microbatches)
    return attentions, exchanges + blocks, nbytes + ring_bytes


def usp_seconds(units: list[SegmentValues], split: tuple[int, int], links: tuple[Link, Link],
                flops_per_s: float) -> Any:
    """Seconds of one microbatch's usp exchanges: the all-to-alls on ``links[1]`` (the a2a group's), none
    overlapped, and the ring's exposed part on ``links[0]`` (the cp group's), its blocks overlapping the sends."""
    ring, a2a = split
    return heads_exchange_seconds(units, a2a, links[1]) + ring_seconds(units, ring, links[0].p2p(), flops_per_s)


def _has_ring(u: SegmentValues) -> bool:
    return not (isinstance(u.ring_kv, (int, float)) and u.ring_kv == 0)


def _exposed(send: Any, block: Any) -> Any:
    return largest([send - block, 0])
