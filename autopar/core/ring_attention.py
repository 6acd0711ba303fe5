"""Ring attention over the ``cp`` axis: ``torch.ops.autopar.ring_attention`` and the sequence layout it assumes.

Layout (``balanced_chunks``): a sequence of ``S`` tokens is cut into ``2 * cp`` chunks of ``S / (2 * cp)``;
cp rank ``i`` holds chunks ``i`` and ``2 * cp - 1 - i``, concatenated, so that under a causal mask every
rank does the same work. ``positions`` are the global positions of a rank's tokens.

``ring_attention(q, k, v, scale, causal, axis, mask)`` -> ``(out, lse)``: the rank's queries ``q`` (B, H, s, D)
attend to the keys and values of the whole sequence. ``mask`` (optional): the rows of the single-device mask for
the rank's queries against every key in global order, (B or 1, H or 1, s or 1, S), boolean (True: attend) or
added to the scores; each block reads its columns, and a block it leaves entirely masked is skipped. Rows that
no key may attend give 0 (as SDPA's), not NaN. The K/V blocks travel around the cp group (rank ``r``
sends to ``r + 1``, receives from ``r - 1``; the next block's exchange is started before the current one is
computed); each block's partial result is merged into ``out`` by its log-sum-exp. The causal mask is
evaluated per pair of chunks from their global positions: a pair whose keys all lie after its queries is
skipped, one whose keys all lie before is computed without a mask, the diagonal pair with ``k_pos <= q_pos``.

``cp_sequence(x, dim, axis, length)``: the whole sequence (``length`` long) from every cp rank's chunks of ``x``
along ``dim``, in global order (the inputs a mask reads on whole sequences: a (batch, sequence) padding mask).

Backward (``ring_attention_backward``) recomputes each block's probabilities from the saved ``lse``
(flash-attention's recurrence): ``dq`` accumulates on the rank; the K/V blocks travel again (the next one
during the current one's computation), and each block's ``dk``, ``dv`` follow it: a rank adds its part to
what the ranks before it summed and passes the sum on (in that order, the single-device order of the sum);
after ``cp`` steps the sums arrive at the block's own rank.

Invariant: ``out`` equals ``softmax(q k^T * scale + mask) v`` over the whole sequence, rows in the rank's
order, up to the order of floating-point sums; the backward is its exact gradient.
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from autopar.core.collectives import _BINDING, axis_index, bind, current

CHUNKS_PER_RANK = 2
aten = torch.ops.aten


def balanced_chunks(cp: int, index: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp``) that cp rank ``index`` holds."""
    return index, 2 * cp - 1 - index


def positions(local: int, cp: int, index: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions of the ``local`` tokens cp rank ``index`` holds (int64, (local,))."""
    c = local // CHUNKS_PER_RANK
    return torch.cat([torch.arange(j * c, (j + 1) * c, device=device) for j in balanced_chunks(cp, index)])


# -- blocks: one pair of (query chunk, key chunk) -------------------------------------------------------------
def _visible(qc: int, kc: int, causal: bool) -> str:
    """How a query chunk sees a key chunk: "all", "none" (skipped) or "diagonal" (mask ``k_pos <= q_pos``)."""
    if not causal or kc < qc:
        return "all"
    return "none" if kc > qc else "diagonal"


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, how: str,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, c, c)
    if how == "diagonal":
        n = s.shape[-1]
        above = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return s


def _block_mask(mask: torch.Tensor | None, a: int, kc: int, c: int) -> torch.Tensor | None:
    """The part of the rank's mask rows for its query half ``a`` against global key chunk ``kc`` (of ``c``)."""
    if mask is None:
        return None
    rows = mask if mask.shape[-2] == 1 else mask[..., a * c:(a + 1) * c, :]
    return rows[..., kc * c:(kc + 1) * c]


def _empty(block: torch.Tensor | None) -> bool:
    """Whether a block's mask lets no query see any key (the block is skipped)."""
    if block is None:
        return False
    return not bool(block.any()) if block.dtype == torch.bool else bool((block == float("-inf")).all())


def _pairs(cp: int, me: int, src: int, causal: bool, mask: torch.Tensor | None = None,
           c: int = 0) -> list[tuple[int, int, str, torch.Tensor | None]]:
    """(query half, key half, visibility, block mask) for the rank's queries against the block of rank ``src``:
    the pairs the causal mask or ``mask`` (rows of chunk length ``c``) leave non-empty."""
    mine, theirs = balanced_chunks(cp, me), balanced_chunks(cp, src)
    out = []
    for a, qc in enumerate(mine):
        for b, kc in enumerate(theirs):
            how, block = _visible(qc, kc, causal), _block_mask(mask, a, kc, c)
            if how != "none" and not _empty(block):
                out.append((a, b, how, block))
    return out


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the -inf of rows no key may attend replaced by 0, so that their probabilities are 0, not NaN."""
    return torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)


def _fused(q: torch.Tensor, how: str, mask: torch.Tensor | None) -> bool:
    """Whether a block runs SDPA's CPU flash kernel: float32 CPU tensors, no mask tensor (the kernel's causal
    mask is the diagonal pair's, both chunks of one length). bfloat16 blocks write the scores out (the kernel's
    log-sum-exp is float32 there; the ring keeps it in the inputs' dtype), and so do float64 ones, which check
    a parallel run against one device within 1e-12: the kernel's blocked sums round differently from the
    whole sequence's kernel by about 1e-16, which AdamW's division by the root of small second moments turns
    into update differences above 1e-12 (1.6e-12 on GPT-2's attention weights at cp=2)."""
    return q.device.type == "cpu" and mask is None and q.dtype == torch.float32


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, how: str,
           mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the rank's query chunk ``q`` against one key chunk: the flash kernel on the CPU, else the
    scores written out (both keep O(chunk) per row: nothing of the block is saved)."""
    if _fused(q, how, mask):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, how == "diagonal", scale=scale)
    s = _scores(q, k, scale, how, mask)  # (B, H, c, c)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - _finite(lse).unsqueeze(-1)), v), lse


def _block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, delta: torch.Tensor, scale: float, how: str,
                    mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of dq, dk, dv, from the whole output ``out`` and its merged (finite) ``lse``: the
    flash kernel's backward given those recomputes exactly this block's probabilities."""
    if _fused(q, how, mask):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, how == "diagonal", scale=scale)
    p = torch.exp(_scores(q, k, scale, how, mask) - lse.unsqueeze(-1))  # (B, H, c, c)
    ds = p * (torch.matmul(dout, v.transpose(-2, -1)) - delta)
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-2, -1), q) * scale, \
        torch.matmul(p.transpose(-2, -1), dout)


# -- the ring -------------------------------------------------------------------------------------------------
def _exchange(tensors: list[torch.Tensor], axis: str, tag: int = 0) -> tuple[list[Any], torch.Tensor, list[torch.Tensor]]:
    """Starts sending ``tensors`` (packed flat) to the next rank of ``axis`` and receiving the previous one's
    (``tag`` tells two exchanges in flight apart); (requests, receive buffer, templates) for ``_received``."""
    g = current().group(axis)
    n, me = dist.get_world_size(g), dist.get_rank(g)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    into = torch.empty_like(flat)
    current().record("ring_send_recv", axis, flat)
    ops = [dist.P2POp(dist.isend, flat, dist.get_global_rank(g, (me + 1) % n), g, tag),
           dist.P2POp(dist.irecv, into, dist.get_global_rank(g, (me - 1) % n), g, tag)]
    return dist.batch_isend_irecv(ops), into, tensors


def _received(pending: tuple[list[Any], torch.Tensor, list[torch.Tensor]]) -> list[torch.Tensor]:
    requests, into, templates = pending
    start = time.perf_counter()
    for r in requests:
        r.wait()
    current().waits.append(("ring_wait", start, time.perf_counter()))  # the exchange's exposed part
    return [part.view_as(t) for part, t in zip(into.split([t.numel() for t in templates]), templates)]


def _halves(t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.chunk(CHUNKS_PER_RANK, dim=-2))


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, axis: str,
             mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    n, me = dist.get_world_size(current().group(axis)), axis_index(axis)
    qs = _halves(q)
    outs = [torch.zeros(*x.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device) for x in qs]
    lses = [torch.full(x.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device) for x in qs]
    block = [k.contiguous(), v.contiguous()]
    for step in range(n):
        pending = _exchange(block, axis) if step < n - 1 else None
        ks, vs = _halves(block[0]), _halves(block[1])
        for a, b, how, block_mask in _pairs(n, me, (me - step) % n, causal, mask, qs[0].shape[-2]):
            out_b, lse_b = _block(qs[a], ks[b], vs[b], scale, how, block_mask)
            merged = torch.logaddexp(lses[a], lse_b)  # the online-softmax merge
            m = _finite(merged)
            outs[a] = outs[a] * torch.exp(lses[a] - m).unsqueeze(-1) + out_b * torch.exp(lse_b - m).unsqueeze(-1)
            lses[a] = merged
        if pending is not None:
            block = _received(pending)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, scale: float, causal: bool, axis: str,
              mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    n, me = dist.get_world_size(current().group(axis)), axis_index(axis)
    qs, dos, lses = _halves(q), _halves(dout), list(_finite(lse).chunk(CHUNKS_PER_RANK, dim=-1))
    deltas = _halves((dout * out).sum(-1, keepdim=True))  # (B, H, c, 1) each
    outs = _halves(out)
    dqs = [torch.zeros_like(x) for x in qs]
    block, sums = [k.contiguous(), v.contiguous()], None  # sums: the block's dk, dv from the ranks before
    for step in range(n):
        pending = _exchange(block, axis, tag=0) if step < n - 1 else None  # the next block, during this one
        ks, vs = _halves(block[0]), _halves(block[1])
        before = _received(sums) if sums is not None else [torch.zeros_like(k), torch.zeros_like(v)]
        dks, dvs = _halves(before[0]), _halves(before[1])  # this block's sums from the ranks before, added to
        for a, b, how, block_mask in _pairs(n, me, (me - step) % n, causal, mask, qs[0].shape[-2]):
            dq, dk, dv = _block_backward(dos[a], qs[a], ks[b], vs[b], outs[a], lses[a], deltas[a], scale, how,
                                         block_mask)
            dvs[b] = dvs[b] + dv
            dqs[a] = dqs[a] + dq
            dks[b] = dks[b] + dk
        sums = _exchange([torch.cat(dks, dim=-2), torch.cat(dvs, dim=-2)], axis, tag=1)  # on to the block's next
        if pending is not None:
            block = _received(pending)
    dk, dv = _received(sums)
    return torch.cat(dqs, dim=-2), dk.clone(), dv.clone()  # (views of one receive buffer)


# -- the ops ---------------------------------------------------------------------------------------------------
@torch.library.custom_op("autopar::ring_attention", mutates_args=())
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                   axis: str, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, scale, causal, axis, mask)


@torch.library.custom_op("autopar::ring_attention_backward", mutates_args=())
def ring_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool,
                            axis: str, mask: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dout, q, k, v, out, lse, scale, causal, axis, mask)


@torch.library.custom_op("autopar::cp_positions", mutates_args=())
def cp_positions(local: int, axis: str, device: torch.device) -> torch.Tensor:
    """The global positions of this rank's ``local`` tokens (``positions``)."""
    g = current().group(axis)
    return positions(local, dist.get_world_size(g), dist.get_rank(g), device)


@torch.library.custom_op("autopar::cp_sequence", mutates_args=())
def cp_sequence(x: torch.Tensor, dim: int, axis: str, length: int) -> torch.Tensor:
    """The whole sequence (``length`` long) along ``dim`` from every cp rank's pair of chunks of ``x``, in
    global order."""
    g = current().group(axis)
    n = dist.get_world_size(g)
    pieces = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(n)]
    current().record("all_gather", axis, x)
    dist.all_gather(pieces, x.contiguous(), group=g)
    chunks: list[torch.Tensor | None] = [None] * (CHUNKS_PER_RANK * n)
    for r, piece in enumerate(pieces):
        for j, part in zip(balanced_chunks(n, r), piece.chunk(CHUNKS_PER_RANK, dim=dim)):
            chunks[j] = part
    return torch.cat(chunks, dim=dim)


ring_attention.register_fake(lambda q, k, v, scale, causal, axis, mask=None: (
    q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1])))
ring_attention_backward.register_fake(lambda dout, q, k, v, out, lse, scale, causal, axis, mask=None: (
    torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)))
cp_positions.register_fake(lambda local, axis, device: torch.empty(local, dtype=torch.int64, device=device))


cp_sequence.register_fake(lambda x, dim, axis, length: x.new_empty(x.shape[:dim] + (length,) + x.shape[dim + 1:]))


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, scale, causal, axis, mask = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.args, ctx.mask = (scale, causal, axis), mask  # (the mask takes no gradient)
    ctx.binding = _BINDING.get()  # backward binds it again (it may run on another thread)


def _ring_backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None) -> tuple:
    """The gradients of ``q``, ``k``, ``v`` (the graphs read ``out`` only: ``lse`` gets no gradient)."""
    q, k, v, out, lse = ctx.saved_tensors
    with bind(ctx.binding):
        dq, dk, dv = ring_attention_backward(dout.contiguous(), q, k, v, out, lse, *ctx.args, ctx.mask)
    return dq, dk, dv, None, None, None, None


ring_attention.register_autograd(_ring_backward, setup_context=_setup)
