"""Ring attention below float64 runs each (query chunk, key chunk) block with SDPA's CPU flash kernel, forward
and backward (``ring_attention._block``): equal to SDPA on the whole sequence within float32 rounding."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autopar.core.collectives import Binding, bind
from autopar.core.ring_attention import _fused, positions


def _against_sdpa(causal: bool) -> float:
    cp, me = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 3, 8 * cp, 16, generator=gen) for _ in range(4))
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*whole, is_causal=causal, scale=0.3)
    expected = [want, *torch.autograd.grad(want, whole, grad)]
    pos = positions(8, cp, me)
    mine = [x[:, :, pos].clone().requires_grad_() for x in (q, k, v)]
    with bind(Binding({"cp": dist.group.WORLD})):
        out, _ = torch.ops.autopar.ring_attention(*mine, 0.3, causal, "cp")
        got = [out, *torch.autograd.grad(out, mine, grad[:, :, pos])]
    return max(float((a - b[:, :, pos]).abs().max() / b.abs().max()) for a, b in zip(got, expected))


@pytest.mark.parametrize("cp, causal", [(2, True), (2, False)])
def test_flash_blocks_equal_sdpa_in_float32(launcher, cp: int, causal: bool) -> None:
    assert _fused(torch.zeros(1), "all", None) and not _fused(torch.zeros(1, dtype=torch.float64), "all", None)
    assert max(launcher(_against_sdpa, cp, causal)) < 1e-5
