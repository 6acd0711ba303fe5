"""Unified sequence parallelism (USP): the all-to-all head exchange and the ring on two sub-axes of ``cp``,
``torch.ops.autopar.usp_attention``.

``Mesh(cp=(R, A))`` splits the cp axis into ``cp_ring`` (outer, ``R``) and ``cp_a2a`` (inner, ``A``): cp index
``c = r * A + a``. ``usp_attention(q, k, v, scale, causal, ring_axis, a2a_axis, a2a)`` has the contract of
``autopar::ulysses_attention``: the rank's queries ``q`` (B, H, s, D), its ``s`` tokens in the balanced layout of
``R * A`` ranks, attend to the keys and values of the whole sequence.

1. The all-to-all over ``cp_a2a`` (``ulysses.exchanged_forward``) gives each rank ``H / A`` heads of its ``A``
   group's tokens. Those tokens, in their order, are again a balanced pair of chunks, of the ring of ``R``: the
   ranks ``r * A .. r * A + A - 1`` hold chunks ``r * A .. r * A + A - 1`` and their mirrors of ``2 R A``, i.e.
   chunks ``r`` and ``2 R - 1 - r`` of ``2 R`` (``A`` times longer), which is what ring rank ``r`` holds.
2. Ring attention over ``cp_ring`` (``ring_attention``'s forward) on those ``A s`` tokens and ``H / A`` heads:
   K/V blocks around the ring, per-block causal masks from the chunks' global positions.
3. The all-to-all back. Backward is the mirror: the output's gradient exchanged, the ring's backward, ``dq``,
   ``dk``, ``dv`` exchanged back.

Bytes per rank and attention: the all-to-alls' (Q, K, V, the output; backward their gradients) as
``ulysses_attention``'s, on ``cp_a2a``; the ring's K/V blocks ``R - 1`` times forward and ``2 R - 1`` times
backward (blocks again and their gradients' sums), each as many bytes as the rank's own K and V, on ``cp_ring``.
The head count must divide by ``A`` (not by ``R * A``).

Invariant: ``out`` equals ``softmax(q k^T * scale + mask) v`` over the whole sequence (the causal mask or none),
rows in the rank's order, up to the order of floating-point sums; the backward is its exact gradient.
"""
from __future__ import annotations

import torch

from autopar.core import ring_attention as ring
from autopar.core.ulysses import exchanged_backward, exchanged_forward, fake_outputs, register_exchange_autograd


@torch.library.custom_op("autopar::usp_attention", mutates_args=())
def usp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, ring_axis: str,
                  a2a_axis: str, a2a: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                    torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse) on the rank's tokens, then what backward reads: the rank's head group of its ``cp_a2a`` group's
    Q, K, V, the ring's output and log-sum-exp on them."""
    return exchanged_forward(q, k, v, lambda *qkv: ring._forward(*qkv, scale, causal, ring_axis), a2a_axis)


@torch.library.custom_op("autopar::usp_attention_backward", mutates_args=())
def usp_attention_backward(dout: torch.Tensor, qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool, ring_axis: str,
                           a2a_axis: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return exchanged_backward(dout, (qg, kg, vg, out, lse),
                              lambda *saved: ring._backward(*saved, scale, causal, ring_axis), a2a_axis)


usp_attention.register_fake(lambda q, k, v, scale, causal, ring_axis, a2a_axis, a2a: fake_outputs(
    q, k, v, scale, causal, a2a_axis, a2a))
usp_attention_backward.register_fake(lambda dout, qg, kg, vg, out, lse, scale, causal, ring_axis, a2a_axis: (
    torch.empty_like(dout), torch.empty_like(dout), torch.empty_like(dout)))
register_exchange_autograd(usp_attention, usp_attention_backward)
