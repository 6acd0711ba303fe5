"""Hybrid sharding overlaps the all-reduce across replicas with backward, as FSDP2's HSDP does: a flat group's
shard gradient is all-reduced over dp_replicate as soon as the step's last reduction of it has landed, while
the layers below still compute their backward; the step waits for all of them before the optimizer.

Read from ``pm.timeline(layers=True)`` (``all_reduce <group>``: issued .. waited for). Exactness under the
schedules where a group's last reduction is found differently (several microbatches, full recomputation, a
split backward) is checked against one device in float64."""
from __future__ import annotations

import pytest
import torch

import models
from autopar import Mesh, parallelize
from autopar.testing import assert_equivalent

IDS = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(2))


def _timeline(zero: int, microbatches: int) -> list[tuple[str, float, float]]:
    torch.manual_seed(0)
    pm = parallelize(models.gpt2(layers=4, d=32), Mesh(dp=(2, 2)), loss_fn=models.lm_loss, optimizer=models.sgd,
                     zero=zero, bucket_mb=0.01, microbatches=microbatches)
    for _ in range(2):
        pm.step(IDS, target=IDS)
    return pm.timeline(layers=True)


def _check(events: list[tuple[str, float, float]], zero: int) -> None:
    backward_end = max(end for what, _, end in events if what.endswith("B0") or what.endswith("B1"))
    last_reduction: dict[str, float] = {}
    for what, _, end in events:
        if what.startswith("reduce_scatter "):
            last_reduction[what.partition(" ")[2]] = end
    across = {what.partition(" ")[2]: start for what, start, _ in events if what.startswith("all_reduce ")}
    assert set(across) == set(last_reduction), (sorted(across), sorted(last_reduction))  # one per flat group
    for group, start in across.items():  # after the group's gradient is complete on the shard group
        assert start >= last_reduction[group], (zero, group, start, last_reduction[group])
    early = [g for g, start in across.items() if start < backward_end]
    assert len(early) >= len(across) // 2, (zero, "all-reduces issued before backward ended:", early, events)


@pytest.mark.parametrize("zero,microbatches", [(1, 1), (2, 2), (3, 2)])
def test_the_all_reduce_across_replicas_runs_beside_backward(launcher, zero: int, microbatches: int) -> None:
    """On each of 4 ranks (2 replicas x 2 shards), GPT-2 of 4 layers in flat groups of one layer or less: every
    group's all-reduce over dp_replicate is issued after its last reduce-scatter of the step, and at least half
    of them before the last microbatch's backward has ended (before, all were issued after it)."""
    for events in launcher(_timeline, 4, zero, microbatches):
        _check(events, zero)


def test_stage_3_with_microbatches_and_recomputation_equals_single_device(launcher) -> None:
    """Two microbatches under full recomputation (each layer re-gathered for its recomputed forward): each group is
    reduced once per microbatch, so the all-reduce after the last microbatch's reduction sees the whole step."""
    assert_equivalent(models.factory(models.gpt2), Mesh(dp=(2, 2)), (IDS,), TARGET, models.lm_loss, models.adamw,
                      steps=3, rtol=1e-9, atol=1e-10, launcher=launcher, zero=3, microbatches=2, recompute="full")


@pytest.mark.slow
@pytest.mark.parametrize("zero", [2, 3])
def test_a_split_backward_equals_single_device(launcher, zero: int) -> None:
    """8 ranks, pp=2 with ZB-H1 (B and W apart): at stage 3 a layer is reduced in B and again in W, and only W's
    reduction of the last microbatch is final; at stage 2 a group's gradient is complete once, in W."""
    ids, target = IDS.repeat(2, 1), TARGET.repeat(2, 1)  # 4 microbatches of 2 rows on each of 4 dp ranks
    assert_equivalent(models.factory(models.gpt2), Mesh(dp=(2, 2), pp=2), (ids,), target, models.lm_loss,
                      models.adamw, steps=3, rtol=1e-9, atol=1e-10, launcher=launcher, zero=zero, microbatches=4,
                      schedule="zb-h1", bucket_mb=0.02)


# the planner simulates the order the runtime issues -------------------------------------------------------------

SHOWN = ("regather", "backward", "reduce_scatter", "all_reduce")


def _last_step_order() -> list[str]:
    torch.manual_seed(0)
    pm = parallelize(models.gpt2(layers=4, d=32), Mesh(dp=(2, 2)), loss_fn=models.lm_loss, optimizer=models.sgd,
                     zero=3, microbatches=2)
    for _ in range(2):
        pm.step(IDS, target=IDS)
    return [what for what, _, _ in pm.timeline(layers=True)]


def _blocks(whats: list[str]) -> list[str]:
    return [w for w in whats if w.split(" ")[0] in SHOWN and w.split(" ")[1].startswith("transformer.h.")]


def test_the_planner_simulates_the_order_the_runtime_issues(launcher) -> None:
    """The simulated step program of dp=(2, 2) at ZeRO-3 with two microbatches issues each block's re-gather,
    backward, reduce-scatter and (in the last microbatch) all-reduce across replicas in the order the runtime's
    timeline shows them on 4 gloo ranks: each all-reduce is issued as the next block's reduce-scatter is."""
    from autopar.planner.cluster import Cluster
    from autopar.planner.cost_model import Config, CostModel, precision_of
    from autopar.planner.model_profile import profile_model
    from autopar.planner.step_sim import Kind

    profile = profile_model(models.gpt2(layers=4, d=32), example_inputs=(IDS[:2],), tp_sizes=(1,))
    cost = CostModel(profile, Cluster.preset("cpu").replace(cores=0), precision_of(torch.float64),
                     seq_len=IDS.shape[1])
    names = {f"unit {i}": name for i, name in enumerate(profile.layer_names()) if name is not None}
    want = []
    for e in cost.step_program(Config(dp=4, zero=3, dp_shard=2, microbatches=2, microbatch_size=1)):
        if e.kind in (Kind.REGATHER, Kind.COMPUTE, Kind.REDUCE_SCATTER, Kind.REPLICATE):
            kind, _, what = e.name.removesuffix(" across replicas").partition(" ")
            if e.kind is Kind.COMPUTE:
                what = profile.layer_names()[int(what)] or what
            want.append(f"{kind} {names.get(what, what)}")
    want = _blocks(want)
    assert sum(w.startswith("all_reduce") for w in want) == 4
    for got in launcher(_last_step_order, 4):
        assert _blocks(got) == want
