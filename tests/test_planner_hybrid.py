"""Hybrid sharding in the planner: ZeRO over a shard group inside a node, the replicas' all-reduces beside backward.

- Memory per device of a hybrid candidate is ZeRO's formula with N = the shard size (docs/zero.md): mixed
  precision, Adam, Ψ elements: stage 1 ``4Ψ + 12Ψ/S``, stage 2 ``2Ψ + 14Ψ/S``, stage 3 ``16Ψ/S``.
- The simulated step holds one all-reduce across replicas per flat group (ZeRO-3's layers, ZeRO 1-2's buckets),
  each issued in the last microbatch once the group's reduction has been waited for, as the runtime's queue
  does, on the link between nodes; the layers below compute beside them, and what the step runs on after
  everything else is their exposed part. The shard group's gathers and reduce-scatters run inside the node.
- The search considers hybrid meshes (the branch-and-bound equality with the exhaustive search over them is in
  tests/test_planner_bound.py) and its explanation says whether hybrid sharding wins, and why.
"""
from __future__ import annotations

import dataclasses

import pytest

from autopar.planner import gpt, plan
from autopar.planner.cluster import Cluster
from autopar.planner.comm_time import ring_all_reduce
from autopar.planner.cost_model import PRECISIONS, Config, CostModel
from autopar.planner.dp_comm import zero3_groups
from autopar.planner.model_profile import profile_model
from autopar.planner.step_sim import Kind, simulate

MIXED = PRECISIONS["mixed"]  # 2 + 2 + 12 bytes per parameter with Adam


@pytest.fixture(scope="module")
def cost() -> CostModel:
    profile = profile_model(gpt(4, 256, 8, vocab=1024), tp_sizes=(1, 2))
    return CostModel(profile, Cluster.preset("dgx-a100"), MIXED, seq_len=512)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hybrid_memory_is_zeros_formula_over_the_shard_size(cost: CostModel, zero: int) -> None:
    params = cost.profile.total_params  # tp=pp=1: every rank holds them all, all trainable
    shard = 4
    want = {1: 4 * params + 12 * params / shard, 2: 2 * params + 14 * params / shard, 3: 16 * params / shard}[zero]
    config = Config(dp=16, zero=zero, dp_shard=shard, microbatch_size=2)
    memory = cost.estimate(config, timed=False).memory
    got = float(memory["parameters"] + memory["gradients"] + memory["optimizer"])
    assert got == pytest.approx(want, rel=1e-12)
    plain = cost.estimate(dataclasses.replace(config, dp_shard=0), timed=False).memory  # over all 16 ranks
    assert float(plain["optimizer"]) == pytest.approx(float(memory["optimizer"]) * shard / 16, rel=1e-12)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_each_groups_all_reduce_across_replicas_follows_its_last_reduction(cost: CostModel, zero: int) -> None:
    config = Config(dp=16, zero=zero, dp_shard=8, microbatches=2, microbatch_size=2)  # 2 nodes of 8 shards
    program = cost.step_program(config)
    across = [i for i, e in enumerate(program) if e.kind is Kind.REPLICATE]
    reductions = [i for i, e in enumerate(program) if e.kind in (Kind.REDUCE_SCATTER, Kind.BUCKET)]
    if zero == 3:  # one per layer's flat group, of its shard gradient in bf16
        groups = zero3_groups([u for st in cost._rank_units(config, 2)[0] for u in st], 8)
        want = [ring_all_reduce(g.elements // 8 * MIXED.grad, 2, cost.cluster.inter) for g in groups]
        assert sorted(program[k].seconds for k in across) == pytest.approx(sorted(want))
    else:  # one per bucket of the last microbatch (those completed at one point as one event), every byte once
        assert len(across) == len(reductions) // (2 if zero == 2 else 1)
        names = [program[k].name.split()[2] for k in across]  # "3" or "0-2"
        count = sum(int(n.split("-")[-1]) - int(n.split("-")[0]) + 1 for n in names)
        nbytes = cost.profile.total_params * MIXED.grad // 8
        assert sum(program[k].seconds for k in across) == pytest.approx(
            ring_all_reduce(nbytes, 2, cost.cluster.inter, count), rel=1e-6)
    assert {program[k].stream for k in across} == {"inter"}
    others = {e.stream for e in program if e.kind in (Kind.GATHER, Kind.REGATHER, Kind.REDUCE_SCATTER, Kind.BUCKET)}
    assert others == {"intra"}  # the shard group's collectives stay inside the node
    timeline = simulate(program, cost.cluster.contention)
    final = {program[i].name.removeprefix("reduce_scatter "): i for i in reductions}  # each group's last one
    for k in across:
        name = program[k].name.removeprefix("all_reduce ").removesuffix(" across replicas")
        assert timeline.start[k] >= timeline.end[final[name]], name  # after its gradient is complete
    others_end = max(t for i, t in enumerate(timeline.end) if program[i].kind not in (Kind.REPLICATE, Kind.WAIT))
    charged = cost.dp_exposure(config)
    assert charged.replicate == pytest.approx(sum(program[k].seconds for k in across))
    assert charged.replicate_exposed == pytest.approx(timeline.makespan - others_end)
    links = cost.estimate(config).links
    assert links["dp_replicate"].link == "inter" and links["dp_shard"].link == "intra"
    assert links["dp_replicate"].busy == pytest.approx(charged.replicate)
    assert links["dp_replicate"].exposed == pytest.approx(charged.replicate_exposed)
    if zero == 3:  # the layers below compute while the upper layers' gradients cross the network
        last_compute = max(timeline.end[i] for i, e in enumerate(program) if e.kind is Kind.COMPUTE)
        assert min(timeline.start[k] for k in across) < last_compute
        assert charged.replicate_exposed < charged.replicate


def test_the_search_weighs_hybrid_sharding_and_says_why(cost: CostModel) -> None:
    result = plan(None, 32, cluster="dgx-a100", global_batch=64, seq_len=512, profile=cost.profile, tp=(1,), pp=(1,),
                  top=None)
    assert any(c.config.dp_shard for c in result.candidates)
    assert all(c.config.dp_shard * c.config.pp * c.config.tp <= 8 for c in result.candidates)
    said = [line for line in result.explanation if line.startswith("hybrid sharding")]
    assert len(said) == 1 and ("wins" in said[0] or "loses" in said[0]) and "beside backward" in said[0]
    hybrid = min((c for c in result.candidates if c.fits and c.config.dp_shard), key=lambda c: c.step_time)
    assert hybrid.mesh.hybrid and hybrid.mesh.dp_shard == hybrid.config.dp_shard


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_the_charged_exposure_is_the_whole_programs(cost: CostModel, zero: int) -> None:
    """Microbatches after the second are repeated from a two-microbatch simulation (``dp_comm``); the all-reduce
    across replicas is once per step, not per microbatch."""
    config = Config(dp=16, zero=zero, dp_shard=8, microbatches=5, microbatch_size=1)
    charged = cost.dp_exposure(config)
    program = cost.step_program(config)
    timeline = simulate(program, cost.cluster.contention)
    base = sum(e.seconds for e in program if e.kind in (Kind.COMPUTE, Kind.TP))
    assert charged.exposed + charged.contention == pytest.approx(timeline.makespan - base, rel=1e-9)
    assert charged.exposed >= charged.replicate_exposed and charged.replicate > 0
