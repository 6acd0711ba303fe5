"""Unified sequence parallelism (``cp_attention="usp"``, ``Mesh(cp=(ring, a2a))``): heads exchanged for
sequence inside each ``cp_a2a`` group, a ring over ``cp_ring``, equals attention over the whole sequence."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autopar import Mesh
from autopar.core.collectives import Binding, bind
from autopar.core.ring_attention import positions
from autopar.core.usp import usp_attention

B, H, S, D = 2, 4, 16, 8


def _groups(mesh: Mesh) -> dict[str, dist.ProcessGroup]:
    """This rank's process group on each cp sub-axis (every rank creates every group, in one order)."""
    mine = {}
    for axis in ("cp_ring", "cp_a2a"):
        for ranks in mesh.groups(axis):
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine[axis] = group
    return mine


def _rank(split: tuple[int, int], causal: bool) -> float:
    mesh, me = Mesh(cp=split), dist.get_rank()
    cp = mesh.cp
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, S, D, dtype=torch.float64, generator=gen) for _ in range(4))
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*full, is_causal=causal, scale=0.3)
    want.backward(dout)
    mine = positions(S // cp, cp, me)  # the rank's tokens, balanced chunks of cp = ring x a2a
    local = [x[:, :, mine].clone().requires_grad_() for x in (q, k, v)]
    with bind(Binding(_groups(mesh))):
        out = usp_attention(*local, 0.3, causal, "cp_ring", "cp_a2a", split[1])[0]
        out.backward(dout[:, :, mine])
    errors = [(out - want[:, :, mine]).abs().max()]
    errors += [(x.grad - f.grad[:, :, mine]).abs().max() for x, f in zip(local, full)]
    return float(max(errors))


@pytest.mark.parametrize("causal", [True, False])
def test_usp_equals_whole_sequence_attention(launcher, causal: bool) -> None:
    """cp = 4 as a ring of 2 groups of 2: forward and the gradients of Q, K, V within 1e-13, float64."""
    assert max(launcher(_rank, 4, (2, 2), causal)) < 1e-13
