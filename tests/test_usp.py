"""Unified sequence parallelism (``cp_attention="usp"``, ``Mesh(cp=(ring, a2a))``): heads exchanged for
sequence inside each ``cp_a2a`` group, a ring over ``cp_ring``, equals attention over the whole sequence."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import autopar
import models
from autopar import Mesh
from autopar.core.collectives import Binding, bind
from autopar.core.errors import UnsupportedError
from autopar.core.ring_attention import positions
from autopar.core.usp import usp_attention
from autopar.planner.config import Config
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



def test_split_cp_sub_axes() -> None:
    """``Mesh(cp=(ring, a2a))``: cp index ``r * a2a + a``; the a2a groups are consecutive cp ranks, the ring
    groups one per a2a index; the split survives ``split_dp``, ``repr`` and a DeviceMesh's named dims."""
    mesh = Mesh(dp=2, cp=(2, 2))  # rank = dp * 4 + cp
    assert mesh.size == 8 and mesh.cp == 4 and (mesh["cp_ring"], mesh["cp_a2a"]) == (2, 2)
    assert mesh.groups("cp_a2a") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("cp_ring") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [mesh.coord(r, "cp_ring") for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [mesh.coord(r, "cp_a2a") for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert repr(mesh) == "Mesh(dp=2, cp=(2, 2))" and mesh != Mesh(dp=2, cp=4)
    assert Mesh(dp=4, cp=(2, 2)).split_dp(2) == Mesh(dp=(2, 2), cp=(2, 2))
    named = SimpleNamespace(mesh_dim_names=("dp", "cp_ring", "cp_a2a"), mesh=torch.empty(2, 2, 2))
    assert Mesh.from_device_mesh(named) == mesh
    for rank in range(mesh.size):
        ring, group = mesh.group_of(rank, "cp_ring"), mesh.group_of(rank, "cp_a2a")
        assert set(ring) & set(group) == {rank} and set(ring) | set(group) <= set(mesh.group_of(rank, "cp"))
        assert mesh.coords(rank).cp == mesh.coord(rank, "cp_ring") * 2 + mesh.coord(rank, "cp_a2a")


IDS = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
TARGET = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(4))


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


def test_planner_searches_and_prices_usp_where_heads_are_fewer_than_cp() -> None:
    """LLaMA with 2 heads on cp = 4: the all-to-all alone cannot split them, usp on cp=(2, 2) can; the planner
    offers it, prices its all-to-alls and ring blocks as the runtime's plan counts them, names it in its
    explanation, and the choice travels to ``parallelize`` with its split."""
    from autopar.planner import plan

    model = models.llama(heads=2, kv_heads=2)
    result = plan(model, 4, cluster="cpu", global_batch=2, seq_len=16, precision="fp64", optimizer="adam",
                  tp=(1,), pp=(1,), zero=(0,), recompute=("none",), cp=(4,), top=None, example_inputs=(IDS,))
    forms = {(c.cp_attention, c.cp_a2a) for c in result.every if c.cp == 4}
    assert forms == {("ring", 0), ("usp", 2)}  # no all-to-all over 4 ranks for 2 heads
    usp = result.candidate(Config(dp=1, cp=4, microbatch_size=2, cp_attention="usp", cp_a2a=2))
    assert usp.parallelism.mesh == Mesh(cp=(2, 2)) and usp.parallelism.cp_attention == "usp"
    attentions, calls, nbytes = result.cost.ring_exchanges(usp.config)
    assert (attentions, calls) == (2, 2 * (8 + 1 + 3))  # per attention: 8 all-to-alls, 1 + 3 ring exchanges
    runtime = autopar.parallelize(models.llama(heads=2, kv_heads=2), usp.parallelism, loss_fn=models.lm_loss,
                                  optimizer=models.adamw)
    runtime.compile((IDS,), {}, TARGET)
    planned = [c for c in runtime.plan.collectives if c.axis in ("cp_ring", "cp_a2a")]
    assert sum(c.count for c in planned) == calls
    assert nbytes == pytest.approx(sum(c.bytes for c in planned), rel=0.05)  # (the output's log-sum-exp column)
    text = " ".join(result.explanation)
    assert "usp on cp=(2, 2)" in text and float(usp.estimate.time["context_parallel"]) > 0


def test_usp_refusals() -> None:
    """Heads the a2a size does not divide, usp without a split cp (or a split cp without usp), a cp split that is
    not ring x a2a, mask tensors, tp: each a clear error naming the numbers and the fix."""
    with pytest.raises(UnsupportedError, match=r"Mesh\(cp=\(ring, a2a\)\) with ring x a2a = cp = 4 and both above"):
        autopar.parallelize(models.llama(), Mesh(cp=4), cp_attention="usp")
    with pytest.raises(UnsupportedError, match=r"both above 1"):
        autopar.parallelize(models.llama(), Mesh(cp=(1, 4)), cp_attention="usp")
    with pytest.raises(UnsupportedError, match=r"the split cp=\(2, 2\) \(ring, a2a\) is read by cp_attention='usp'"):
        autopar.parallelize(models.llama(), Mesh(cp=(2, 2)))
    with pytest.raises(UnsupportedError, match=r"cp_attention='usp'.*use cp_attention='ring' with tp=2"):
        autopar.parallelize(models.llama(), Mesh(cp=(2, 2), tp=2), cp_attention="usp")
    with pytest.raises(ValueError, match=r"ring x cp_a2a = cp with both above 1 \(cp_a2a in \[2\]\)"):
        Config(dp=1, cp=4, cp_attention="usp", cp_a2a=3)
    with pytest.raises(ValueError, match=r"cp=\(2, 2, 1\).*a pair \(ring, a2a\)"):
        Mesh(cp=(2, 2, 1))
    pm = autopar.parallelize(models.llama(d=24, heads=3, kv_heads=3), Mesh(cp=(2, 2)), loss_fn=models.lm_loss,
                             optimizer=models.adamw, cp_attention="usp")
    with pytest.raises(UnsupportedError, match=r"heads \[3, 3, 3\] do not divide by the a2a size 2 of cp=\(2, 2\).*"
                                               r"cp_attention='ring' with Mesh\(cp=4\)"):
        pm.compile((IDS,), {}, TARGET)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[:, 12:] = 0
    pm = autopar.parallelize(models.bert(), Mesh(cp=(2, 2)), loss_fn=models.lm_loss, optimizer=models.adamw,
                             cp_attention="usp")
    with pytest.raises(UnsupportedError, match=r"is a tensor; cp_attention='usp' evaluates causal masks or none"):
        pm.compile((IDS,), {"attention_mask": mask}, TARGET)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, kw", [(Mesh(dp=2, cp=(2, 2)), dict(zero=3)),
                                      (Mesh(pp=2, cp=(2, 2)), dict(microbatches=2)),
                                      (Mesh(cp=(2, 2)), dict(recompute="full"))], ids=["zero3", "pp2", "full"])
def test_usp_composes(launcher, mesh: Mesh, kw: dict) -> None:
    """usp with ZeRO-3 over dp x cp, a pipeline and full recomputation (which runs each usp attention again)."""
    ids, target = torch.cat([IDS, IDS.flip(0)]), torch.cat([TARGET, TARGET.flip(1)])
    assert_equivalent(models.factory(models.llama), mesh, (ids,), target, models.lm_loss, models.adamw, steps=2,
                      rtol=1e-9, atol=1e-10, launcher=launcher, cp_attention="usp", **kw)


def test_the_planner_offers_usp_only_where_the_runtime_runs_it() -> None:
    """A sliding window is a mask tensor, which usp refuses: the planner's usp candidates for Mistral are not
    runnable (with the reason), the ring's are, and the runtime refuses the usp mesh as the planner says."""
    from autopar.planner import plan

    result = plan(models.mistral(heads=2, kv_heads=2, window=3), 4, cluster="cpu", global_batch=2, seq_len=16,
                  precision="fp64", optimizer="adam", tp=(1,), pp=(1,), zero=(0,), recompute=("none",), cp=(4,),
                  top=None, example_inputs=(IDS,))
    assert result.profile.masked_attention
    usp = [c for c in result.every.values() if c.config.cp_attention == "usp"]
    ring = [c for c in result.every.values() if c.config.cp == 4 and c.config.cp_attention == "ring"]
    assert usp and ring and all(c.runnable for c in ring)
    assert all(not c.runnable and "mask tensor" in c.not_runnable for c in usp)
    pm = autopar.parallelize(models.mistral(heads=2, kv_heads=2, window=3), usp[0].parallelism,
                             loss_fn=models.lm_loss, optimizer=models.adamw)
    with pytest.raises(UnsupportedError, match="mask"):
        pm.compile((IDS,), {}, TARGET)


def test_a_causal_mask_built_from_shapes_alone_leaves_usp_runnable(launcher) -> None:
    """GPT-2's symbolic capture builds its causal mask from the sequence length alone, which the runtime's
    capture folds into ``is_causal``: the planner offers usp (evaluating that mask at the export's example
    sizes), and the usp candidate it offers trains as one device."""
    from autopar.planner import plan

    result = plan(models.gpt2(heads=4, dtype=torch.float32), 4, cluster="cpu", global_batch=2, seq_len=16,
                  precision="fp32", optimizer="adam", tp=(1,), pp=(1,), zero=(0,), recompute=("none",), cp=(4,),
                  top=None, example_inputs=(IDS,))
    assert not result.profile.masked_attention
    usp = [c for c in result.every.values() if c.config.cp_attention == "usp"]
    assert usp and all(c.runnable for c in usp), [c.not_runnable for c in usp]
    assert_equivalent(models.factory(models.gpt2, heads=4), usp[0].mesh, (IDS,), TARGET, models.lm_loss,
                      models.adamw, steps=2, rtol=1e-9, atol=1e-10, launcher=launcher, cp_attention="usp")
