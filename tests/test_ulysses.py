"""``autopar::ulysses_attention``: heads exchanged for sequence over cp ranks equals attention over the whole
sequence, forward and backward, in float64."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autopar.core.collectives import Binding, bind
from autopar.core.ring_attention import positions
from autopar.core.ulysses import ulysses_attention

B, H, S, D = 2, 4, 16, 8


def _rank(causal: bool) -> float:
    cp, me = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, S, D, dtype=torch.float64, generator=gen) for _ in range(4))
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*full, is_causal=causal, scale=0.3)
    want.backward(dout)
    mine = positions(S // cp, cp, me)  # the rank's tokens, balanced chunks
    local = [x[:, :, mine].clone().requires_grad_() for x in (q, k, v)]
    with bind(Binding({"cp": dist.group.WORLD})):
        out = ulysses_attention(*local, 0.3, causal, "cp", cp)[0]
        out.backward(dout[:, :, mine])
    errors = [(out - want[:, :, mine]).abs().max()]
    errors += [(x.grad - f.grad[:, :, mine]).abs().max() for x, f in zip(local, full)]
    return float(max(errors))


@pytest.mark.parametrize("cp, causal", [(2, True), (2, False), pytest.param(4, True, marks=pytest.mark.slow)])
def test_ulysses_equals_whole_sequence_attention(launcher, cp: int, causal: bool) -> None:
    assert max(launcher(_rank, cp, causal)) < 1e-13
