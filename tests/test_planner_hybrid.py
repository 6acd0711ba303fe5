"""Hybrid sharding in the planner: ZeRO over a shard group inside a node, the replicas' all-reduce after backward.

- Memory per device of a hybrid candidate is ZeRO's formula with N = the shard size (docs/zero.md): mixed
  precision, Adam, Ψ elements: stage 1 ``4Ψ + 12Ψ/S``, stage 2 ``2Ψ + 14Ψ/S``, stage 3 ``16Ψ/S``.
- The simulated step holds the all-reduce across replicas once, issued after the last backward and the last
  reduction, on the link between nodes, with nothing computing beside it: all of it is exposed and in the
  step time. The shard group's gathers and reduce-scatters run inside the node.
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


@pytest.mark.parametrize("zero", [1, 3])
def test_the_replicas_all_reduce_runs_after_backward_between_nodes_exposed(cost: CostModel, zero: int) -> None:
    config = Config(dp=16, zero=zero, dp_shard=8, microbatches=2, microbatch_size=2)  # 2 nodes of 8 shards
    program = cost.step_program(config)
    across = [i for i, e in enumerate(program) if e.kind is Kind.REPLICATE]
    assert len(across) == 1
    k = across[0]
    groups = zero3_groups([u for st in cost._rank_units(config, 2)[0] for u in st], 8)
    nbytes = sum(g.elements for g in groups) // 8 * MIXED.grad  # each flat group's shard gradient, bf16
    assert program[k].seconds == pytest.approx(ring_all_reduce(nbytes, 2, cost.cluster.inter, len(groups)))
    assert program[k].stream == "inter"
    others = {e.stream for e in program if e.kind in (Kind.GATHER, Kind.REGATHER, Kind.REDUCE_SCATTER, Kind.BUCKET)}
    assert others == {"intra"}  # the shard group's collectives stay inside the node
    timeline = simulate(program, cost.cluster.contention)
    last_backward = max(i for i, e in enumerate(program) if e.kind is Kind.COMPUTE)
    reductions = [i for i, e in enumerate(program) if e.kind in (Kind.REDUCE_SCATTER, Kind.BUCKET)]
    assert k > last_backward and timeline.start[k] >= max(timeline.end[i] for i in [last_backward, *reductions])
    assert timeline.makespan == pytest.approx(timeline.end[k])  # nothing after it hides it: all of it shows
    alone = [e._replace(seconds=0.0) if i == k else e for i, e in enumerate(program)]
    assert timeline.makespan - simulate(alone, cost.cluster.contention).makespan == pytest.approx(program[k].seconds)
    assert cost.dp_exposure(config).replicate == pytest.approx(program[k].seconds)
    links = cost.estimate(config).links
    assert links["dp_replicate"].link == "inter" and links["dp_shard"].link == "intra"
    assert links["dp_replicate"].exposed == links["dp_replicate"].busy == pytest.approx(program[k].seconds)


def test_the_search_weighs_hybrid_sharding_and_says_why(cost: CostModel) -> None:
    result = plan(None, 32, cluster="dgx-a100", global_batch=64, seq_len=512, profile=cost.profile, tp=(1,), pp=(1,),
                  top=None)
    assert any(c.config.dp_shard for c in result.candidates)
    assert all(c.config.dp_shard * c.config.pp * c.config.tp <= 8 for c in result.candidates)
    said = [line for line in result.explanation if line.startswith("hybrid sharding")]
    assert len(said) == 1 and ("wins" in said[0] or "loses" in said[0]) and "after backward" in said[0]
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
    assert charged.exposed >= charged.replicate > 0
