"""Hybrid sharding, ``Mesh(dp=(replicate, shard))``: ZeRO over the dp_shard ranks of each replica, the shards'
gradients all-reduced over dp_replicate. Training equals one device; memory follows the ZeRO formulas with the
shard size in place of dp; the collectives run on the sub-axes the plan names; bad meshes are refused by name."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import models
from autopar import Mesh, parallelize
from autopar.testing import assert_equivalent

IDS = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(2))
HSDP = Mesh(dp=(2, 2))  # 2 replicas of 2 shards: ranks 0-1 and 2-3 each hold one copy of the shards


# the mesh --------------------------------------------------------------------------------------------------------

def test_the_rank_layout_splits_dp_into_replicas_of_shard_groups() -> None:
    mesh = Mesh(dp=(2, 2), tp=2)  # dp index = replicate * 2 + shard; rank = dp * 2 + tp
    assert mesh.size == 8 and mesh.dp == 4 and (mesh.dp_replicate, mesh.dp_shard) == (2, 2)
    assert mesh.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert mesh.groups("dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]  # inside a node of 4 ranks
    assert mesh.groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]  # across the two nodes
    assert [mesh.coord(r, "dp_shard") for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert repr(mesh) == "Mesh(dp=(2, 2), tp=2)" and mesh != Mesh(dp=4, tp=2)
    assert Mesh(dp=8, tp=2).split_dp(4) == Mesh(dp=(2, 4), tp=2)
    torchtitan = SimpleNamespace(mesh_dim_names=("dp_replicate", "dp_shard", "tp"), mesh=torch.empty(2, 4, 2))
    assert Mesh.from_device_mesh(torchtitan) == Mesh(dp=(2, 4), tp=2)


@given(replicate=st.integers(1, 3), shard=st.integers(1, 3), others=st.sampled_from([{}, {"tp": 2}, {"pp": 2, "tp": 2}]),
       dp_first=st.booleans())
def test_shard_and_replicate_groups_cut_each_dp_group_into_a_grid(replicate: int, shard: int, others: dict,
                                                                  dp_first: bool) -> None:
    """Each dp group is replicate x shard ranks: a rank's shard group and replicate group meet only in it, and
    the shard groups (and the replicate groups) partition the ranks."""
    dp = {"dp": (replicate, shard)}
    mesh = Mesh(**dp, **others) if dp_first else Mesh(**others, **dp)
    for axis in ("dp_shard", "dp_replicate"):
        groups = mesh.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(mesh.size))
        assert all(len(g) == mesh[axis] for g in groups)
    for rank in range(mesh.size):
        shard_group, replicas = mesh.group_of(rank, "dp_shard"), mesh.group_of(rank, "dp_replicate")
        assert set(shard_group) & set(replicas) == {rank}
        assert set(shard_group) | set(replicas) <= set(mesh.group_of(rank, "dp"))
        assert shard_group[mesh.coord(rank, "dp_shard")] == rank == replicas[mesh.coord(rank, "dp_replicate")]
        assert mesh.coords(rank).dp == mesh.coord(rank, "dp_replicate") * shard + mesh.coord(rank, "dp_shard")


@pytest.mark.parametrize("make, message", [
    (lambda: Mesh(dp=8).split_dp(3), r"shard=3 on dp=8: the shard size must divide dp .* use one of \[1, 2, 4, 8\]"),
    (lambda: Mesh(dp=(2, 2, 2)), r"dp=\(2, 2, 2\): hybrid sharding takes a pair \(replicate, shard\)"),
    (lambda: Mesh(dp=(2, 0)), r"dp=\(2, 0\): hybrid sharding takes a pair"),
    (lambda: Mesh(tp=(2, 2)), r"tp=\(2, 2\) must be an integer >= 1 \(only dp takes a pair"),
    (lambda: parallelize(models.gpt2(), Mesh(dp=(2, 2), tp=2), loss_fn=models.lm_loss, optimizer=models.adamw),
     r"Mesh\(dp=\(2, 2\), tp=2\) asks for hybrid sharding \(ZeRO over dp_shard=2 inside each of dp_replicate=2 "
     r"replicas\), but zero=0; pass zero=1, 2 or 3, or use Mesh\(dp=4, tp=2\)"),
])
def test_bad_hybrid_meshes_are_refused_with_the_numbers(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_plan_and_graphs_show_the_layout() -> None:
    pm = parallelize(models.gpt2(), HSDP, loss_fn=models.lm_loss, optimizer=models.adamw, zero=3,
                     example_inputs=(IDS,), example_target=TARGET)
    text = str(pm.plan)
    assert ("hybrid sharding: dp=4 as 2 replicas x 2 shards; ZeRO shards over dp_shard (rank 0's group [0, 1]), "
            "and each shard's gradient is all-reduced over dp_replicate, the ranks holding that shard "
            "(rank 0's group [0, 2])") in text
    assert "zero=3: stored sharded over dp_shard, gathered per layer" in text
    assert "all_gather     on dp_shard" in text and "reduce_scatter on dp_shard" in text
    assert "all_reduce     on dp_replicate" in text and " on dp:" not in text
    for rank in range(4):
        assert f"'dp_shard', {HSDP.group_of(rank, 'dp_shard')})" in pm.graph(rank).code


# training equals one device -----------------------------------------------------------------------------------

@pytest.mark.parametrize("zero", [1, 2, 3])
def test_every_stage_equals_single_device(launcher, zero: int) -> None:
    """GPT-2 (tied embeddings), 3 steps, float64, AdamW; stage 2 with SGD with momentum, 2 microbatches (a
    reduce-scatter per microbatch, one all-reduce across replicas per step) and every step clipped (each slice
    is held by 2 replicas: counted once in the norm)."""
    extra = {"microbatches": 2, "max_grad_norm": 0.05} if zero == 2 else {}
    opt = models.sgd if zero == 2 else models.adamw
    assert_equivalent(models.factory(models.gpt2), HSDP, (IDS,), TARGET, models.lm_loss, opt, steps=3,
                      rtol=1e-9, atol=1e-10, launcher=launcher, zero=zero, bucket_mb=0.02, **extra)


@pytest.mark.slow
@pytest.mark.parametrize("sizes,zero", [(dict(dp=(2, 2), tp=2), 3), (dict(dp=(2, 2), pp=2), 3),
                                        (dict(dp=(2, 2), tp=2), 1), (dict(dp=(2, 2), pp=2), 2)])
def test_composed_with_tp_and_pp_equals_single_device(launcher, sizes: dict, zero: int) -> None:
    """8 ranks: LLaMA (GQA) under tp; GPT-2 with its tied embeddings on both pipeline ends under pp."""
    mesh = Mesh(**sizes)
    name = "llama" if mesh.tp > 1 else "gpt2"
    assert_equivalent(models.factory(getattr(models, name)), mesh, (IDS,), TARGET, models.lm_loss, models.adamw,
                      steps=3, rtol=1e-9, atol=1e-10, launcher=launcher, zero=zero, bucket_mb=0.02,
                      microbatches=2 if mesh.pp > 1 else 1)


# memory and collectives ---------------------------------------------------------------------------------------

WIDTH, LAYERS = 64, 8
PSI = LAYERS * (WIDTH * WIDTH + WIDTH)  # fp32 elements
LAYER = 4 * (WIDTH * WIDTH + WIDTH)  # bytes of one gathered layer


def _formula(stage: int, n: int) -> float:
    """fp32 AdamW over ``n`` shards (zero_prefetch=1: two layers gathered at once)."""
    return {1: 8 * PSI + 8 * PSI / n, 2: 4 * PSI + 12 * PSI / n, 3: 16 * PSI / n + 2 * LAYER}[stage]


def _accounts() -> dict:
    x, y = torch.randn(32, WIDTH), torch.randn(32, WIDTH)
    out = {}
    for stage in (1, 2, 3):
        pm = parallelize(models.mlp((WIDTH,) * (LAYERS + 1), dtype=torch.float32), HSDP, loss_fn=models.mse,
                         zero=stage, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), example_inputs=(x,),
                         example_target=y)
        for _ in range(2):
            pm.step(x, target=y)
        calls = pm.communication(calls=True)
        planned = {f"zero_{c.op}@{c.axis}": c.count for c in pm.plan.collectives}
        out[stage] = (pm.memory(), sum(pm.plan.memory.values()), calls, planned)
    return out


def test_memory_follows_the_formulas_over_the_shard_size_and_collectives_run_on_the_sub_axes(launcher) -> None:
    """State is divided by dp_shard = 2, not dp = 4 (the dp=4 formula is 17-44% lower); two steps
    run what the plan says, per step: the all-gathers and reduce-scatters on dp_shard, one all-reduce per flat
    group on dp_replicate (stages 1-2: one bucket; stage 3: one group per layer), nothing on the whole of dp."""
    for rank, accounts in enumerate(launcher(_accounts, 4)):
        for stage, (measured, estimate, calls, planned) in accounts.items():
            assert measured["total"] == pytest.approx(_formula(stage, 2), rel=0.05), (rank, stage, measured)
            assert abs(measured["total"] / _formula(stage, 4) - 1) > 0.15, (rank, stage)
            assert estimate == pytest.approx(measured["total"], rel=0.05), (rank, stage)
            per_step = {k: v / 2 for k, v in calls.items()}
            if stage == 3:  # layer 0's input needs no gradient: its parameters are not saved, not re-gathered
                per_step["zero_all_gather@dp_shard"] += 1
            assert per_step == planned, (rank, stage, calls, planned)
            assert planned["zero_all_reduce@dp_replicate"] == (LAYERS if stage == 3 else 1)  # a flat group each


def _replica_bytes() -> dict:
    """Bytes per collective of a step under precision="bf16" (fp32 shard gradients), by reduce_dtype."""
    x, y = torch.randn(32, WIDTH), torch.randn(32, WIDTH)
    out = {}
    for reduce_dtype in ("fp32", "bf16"):
        pm = parallelize(models.mlp((WIDTH,) * 3, dtype=torch.float32), HSDP, loss_fn=models.mse, zero=3,
                         optimizer=models.sgd, precision="bf16", reduce_dtype=reduce_dtype, example_inputs=(x,),
                         example_target=y)
        pm.step(x, target=y)
        out[reduce_dtype] = pm.communication()
    return out


def test_the_all_reduce_across_replicas_runs_in_reduce_dtype(launcher) -> None:
    """Counted at run time: with reduce_dtype="bf16" the all-reduce over dp_replicate moves half the bytes of
    fp32's, as the reduce-scatters over dp_shard do (the shard gradients stay fp32)."""
    for rank, out in enumerate(launcher(_replica_bytes, 4)):
        fp32, bf16 = out["fp32"], out["bf16"]
        for key in ("zero_all_reduce@dp_replicate", "zero_reduce_scatter@dp_shard"):
            assert fp32[key] > 0 and fp32[key] == 2 * bf16[key], (rank, key, fp32, bf16)
