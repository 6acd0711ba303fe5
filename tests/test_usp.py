"""Unified sequence parallelism (``cp_attention="usp"``, ``Mesh(cp=(ring, a2a))``): heads exchanged for
sequence inside each ``cp_a2a`` group, a ring over ``cp_ring``, equals attention over the whole sequence."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autopar
import models
from autopar import Mesh
from autopar.core.collectives import Binding, bind
from autopar.core.ring_attention import positions
from autopar.core.usp import usp_attention
from autopar.testing import assert_equivalent

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


IDS = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
TARGET = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(4))


@pytest.mark.slow
def test_usp_llama_equals_one_device(launcher) -> None:
    """LLaMA, cp = 4 as (ring 2, a2a 2): every attention a usp exchange; AdamW, float64 (updates within 1e-12)."""
    assert_equivalent(models.factory(models.llama), Mesh(cp=(2, 2)), (IDS,), TARGET, models.lm_loss, models.adamw,
                      steps=2, rtol=1e-9, atol=1e-10, launcher=launcher, cp_attention="usp")


def _exchanges() -> tuple[dict[str, int], dict[str, int], list[tuple[str, int, int]], str]:
    pm = autopar.parallelize(models.llama(), Mesh(cp=(2, 2)), loss_fn=models.lm_loss, optimizer=models.adamw,
                             cp_attention="usp")
    pm.step(IDS, target=TARGET)
    return (pm.communication(calls=True), pm.communication(),
            [(c.axis, c.count, c.bytes) for c in pm.plan.collectives if c.axis.startswith("cp")], pm.graph(0).code)


def test_usp_exchanges_run_as_planned(launcher) -> None:
    """The plan's all-to-alls on cp_a2a (4 per attention forward, 4 backward) and ring blocks on cp_ring (1
    forward, 3 backward at ring = 2) are the calls and bytes a step runs."""
    for calls, sent, planned, code in launcher(_exchanges, 4):
        a2a = [(n, b) for axis, n, b in planned if axis == "cp_a2a"]
        ring = [(n, b) for axis, n, b in planned if axis == "cp_ring"]
        assert [n for n, _ in a2a] == [8, 8] and [n for n, _ in ring] == [2, 6]  # 2 layers
        assert len(planned) == 4
        assert (calls["all_to_all@cp_a2a"], sent["all_to_all@cp_a2a"]) == tuple(map(sum, zip(*a2a)))
        assert (calls["ring_send_recv@cp_ring"], sent["ring_send_recv@cp_ring"]) == tuple(map(sum, zip(*ring)))
        assert code.count("torch.ops.autopar.usp_attention.default(") == 2
