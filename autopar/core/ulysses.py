"""Attention over the ``cp`` axis by exchanging heads for sequence (DeepSpeed-Ulysses' layout):
``torch.ops.autopar.ulysses_attention``.

``ulysses_attention(q, k, v, scale, causal, axis, cp, mask)`` -> ``(out, lse, ...)``, the same contract as
``autopar::ring_attention``: the rank's queries ``q`` (B, H, s, D), its ``s`` tokens in the balanced layout
(``ring_attention.balanced_chunks``), attend to the keys and values of the whole sequence. One all-to-all
sends head group ``j`` (``H / cp`` heads) of the rank's tokens to cp rank ``j`` and receives every rank's
tokens of its own group; the gathered tokens are put in sequence order and the attention runs over the whole
sequence for ``H / cp`` heads (SDPA's CPU flash kernel on the CPU, the same sums written out elsewhere); a
second all-to-all returns each rank's tokens of every head. ``mask`` (optional): the single-device mask of the
whole sequence, (B or 1, H or 1, S or 1, S) in sequence order, boolean or added to the scores; the rank reads
its head group's rows of it (every row: it attends for all queries), the scores written out, a row no key may
attend 0 as under SDPA. Backward is the mirror: the output's gradient
exchanged, the attention's backward from the saved head group's Q, K, V, output and log-sum-exp (as many
bytes as the rank's own Q, K, V and output), and ``dq``, ``dk``, ``dv`` exchanged back.

Against the ring: two all-to-alls of Q, K, V and the output (``4 (cp - 1) / cp`` of the rank's bytes per
tensor) instead of ``cp - 1`` K/V blocks around the ring, and not overlapped with compute; the head count must
divide by cp.

Invariant: ``out`` equals the ring's (and one device's) ``softmax(q k^T * scale + mask) v`` over the whole
sequence, rows in the rank's order, up to the order of floating-point sums; the backward is its exact gradient.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from autopar.core.collectives import _BINDING, bind, current
from autopar.core.ring_attention import _block, _block_backward, _finite, positions

aten = torch.ops.aten


def _order(local: int, cp: int, device: torch.device) -> torch.Tensor:
    """Global position of each gathered token (every rank's ``local`` tokens, rank by rank)."""
    return torch.cat([positions(local, cp, r, device) for r in range(cp)])


def _heads_to_sequence(x: torch.Tensor, axis: str) -> torch.Tensor:
    """(B, H, s, D) of the rank's tokens -> (B, H / cp, S, D) of its head group, tokens in sequence order."""
    g = current().group(axis)
    cp = dist.get_world_size(g)
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()  # (cp, B, H/cp, s, D): group j to rank j
    got = _exchange(send, axis, g)  # (cp, B, H/cp, s, D): rank r's tokens
    gathered = got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)
    return gathered.index_select(2, torch.argsort(_order(s, cp, x.device)))


def _sequence_to_heads(y: torch.Tensor, axis: str) -> torch.Tensor:
    """The inverse: (B, H / cp, S, D) in sequence order -> (B, H, s, D) of the rank's tokens."""
    g = current().group(axis)
    cp = dist.get_world_size(g)
    b, hg, n, d = y.shape
    s = n // cp
    ranked = y.index_select(2, _order(s, cp, y.device)).reshape(b, hg, cp, s, d)
    got = _exchange(ranked.permute(2, 0, 1, 3, 4).contiguous(), axis, g)  # (cp, B, H/cp, s, D): group r
    return got.transpose(0, 1).reshape(b, cp * hg, s, d)


def _exchange(send: torch.Tensor, axis: str, g: Any) -> torch.Tensor:
    into = torch.empty_like(send)
    current().record("all_to_all", axis, send)
    dist.all_to_all_single(into, send, group=g)
    return into


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
               mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of whole-sequence attention: SDPA's CPU kernel, with a mask or elsewhere the ring's
    written-out block (a row no key may attend: 0, its log-sum-exp -inf)."""
    if q.device.type == "cpu" and mask is None:
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return _block(q, k, v, scale, "diagonal" if causal else "all", mask)


def _attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, scale: float, causal: bool,
                        mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    if q.device.type == "cpu" and mask is None:
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                          scale=scale)
    return _block_backward(dout, q, k, v, out, _finite(lse), (dout * out).sum(-1, keepdim=True), scale,
                           "diagonal" if causal else "all", mask)


def _head_group(mask: torch.Tensor | None, axis: str) -> torch.Tensor | None:
    """The rank's head group of a whole-sequence mask (..., H or 1, S or 1, S): the heads the exchange gives it
    (group ``j`` of ``H / cp`` heads to cp rank ``j``); a mask broadcast over heads as it is."""
    if mask is None or mask.dim() < 3 or mask.shape[-3] == 1:
        return mask
    g = current().group(axis)
    cp, me = dist.get_world_size(g), dist.get_rank(g)
    heads = mask.shape[-3] // cp
    return mask.narrow(-3, me * heads, heads)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def exchanged_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Attend,
                      axis: str) -> tuple[torch.Tensor, ...]:
    """(out, lse) on the rank's tokens of ``attend(q, k, v) -> (out, lse)`` run on the rank's head group of every
    ``axis`` rank's tokens, and the gathered (q, k, v, out, lse) its backward reads."""
    qg, kg, vg = (_heads_to_sequence(x.contiguous(), axis) for x in (q, k, v))
    out, lse = attend(qg, kg, vg)
    mine = _sequence_to_heads(torch.cat([out, lse.unsqueeze(-1).to(out.dtype)], dim=-1), axis)
    return mine[..., :-1].contiguous(), mine[..., -1].to(lse.dtype).contiguous(), qg, kg, vg, out, lse


def exchanged_backward(dout: torch.Tensor, saved: tuple[torch.Tensor, ...], attend_backward: Callable[..., tuple],
                       axis: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mirror: ``dout`` exchanged, ``attend_backward(dout, qg, kg, vg, out, lse) -> (dq, dk, dv)`` on the
    head group (``saved``: what ``exchanged_forward`` returned after the rank's output), the gradients back."""
    grads = attend_backward(_heads_to_sequence(dout.contiguous(), axis), *saved)
    dq, dk, dv = (_sequence_to_heads(x.contiguous(), axis) for x in grads)
    return dq, dk, dv


@torch.library.custom_op("autopar::ulysses_attention", mutates_args=())
def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, axis: str,
                      cp: int, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                         torch.Tensor, torch.Tensor, torch.Tensor,
                                                                         torch.Tensor]:
    """(out, lse) on the rank's tokens, then what backward reads: the rank's head group of Q, K, V, the output
    and the log-sum-exp over the whole sequence (as many bytes as the rank's own Q, K, V and output). ``mask``
    (optional): the single-device mask over the whole sequence, (B or 1, H or 1, S or 1, S) in sequence order,
    boolean (True: attend) or added to the scores; the rank reads its head group of it."""
    return exchanged_forward(q, k, v, lambda *qkv: _attention(*qkv, scale, causal, _head_group(mask, axis)), axis)


@torch.library.custom_op("autopar::ulysses_attention_backward", mutates_args=())
def ulysses_attention_backward(dout: torch.Tensor, qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool,
                               axis: str, mask: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return exchanged_backward(dout, (qg, kg, vg, out, lse),
                              lambda *saved: _attention_backward(*saved, scale, causal, _head_group(mask, axis)),
                              axis)


def fake_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, axis: str,
                 cp: int, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    b, h, s, d = q.shape
    group = [x.new_empty(b, h // cp, cp * s, x.shape[-1]) for x in (q, k, v, v)]
    return (q.new_empty(b, h, s, v.shape[-1]), q.new_empty(b, h, s), *group, q.new_empty(b, h // cp, cp * s))


ulysses_attention.register_fake(fake_outputs)
ulysses_attention_backward.register_fake(lambda dout, qg, kg, vg, out, lse, scale, causal, axis, mask=None: (
    torch.empty_like(dout), torch.empty_like(dout), torch.empty_like(dout)))


def register_exchange_autograd(op: Any, backward_op: Any, tail: int = 0) -> None:
    """``op(q, k, v, *args, degree, *extra)`` (``tail`` trailing ``extra`` inputs, such as a mask) returns the
    rank's (out, lse) and then what ``backward_op(dout, *saved, *args, *extra)`` reads; its gradients are those
    of ``q``, ``k``, ``v`` (graphs read ``out`` only: the other outputs and ``extra`` take no gradient)."""
    def setup(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.save_for_backward(*output[2:])
        degree = len(inputs) - 1 - tail
        ctx.args, ctx.others = (*inputs[3:degree], *inputs[degree + 1:]), (None,) * (len(inputs) - 3)
        ctx.binding = _BINDING.get()  # backward binds it again (it may run on another thread)

    def backward(ctx: Any, dout: torch.Tensor, *_: torch.Tensor | None) -> tuple:
        with bind(ctx.binding):
            dq, dk, dv = backward_op(dout.contiguous(), *ctx.saved_tensors, *ctx.args)
        return dq, dk, dv, *ctx.others

    op.register_autograd(backward, setup_context=setup)


register_exchange_autograd(ulysses_attention, ulysses_attention_backward, tail=1)
