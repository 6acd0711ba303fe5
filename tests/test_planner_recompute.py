"""The planner's recomputation per layer: full on only as many layers of each stage as it takes to fit.

- The cost of a mix lies between its two modes' (memory falls and time rises with each layer recomputed
  fully), and the runtime's form of it names the first layers of each stage.
- The search adds a mix where one mode for every layer does not fit and "full" does, with the fewest
  full layers that fit; the table and the explanation show it.
- ``parallelize(model, "auto")`` runs the planner's mix: the per-layer choice reaches the recompute pass.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import models
from autopar import parallelize
from autopar.planner import plan
from autopar.planner.cluster import Cluster
from autopar.planner.cost_model import PRECISIONS, Config, CostModel
from autopar.planner.model_profile import profile_model
from autopar.planner.result import rc_label

SEQ = 32
IDS = torch.randint(0, 96, (4, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def profile():
    return profile_model(models.gpt2(layers=8, d=64, heads=4, vocab=128, dtype=torch.float32), tp_sizes=(1,))


def test_a_mix_costs_between_its_modes_and_names_each_stages_first_layers(profile) -> None:
    cost = CostModel(profile, Cluster.preset("cpu"), PRECISIONS["fp32"], seq_len=SEQ)
    config = Config(dp=1, pp=2, microbatches=4, microbatch_size=2, recompute="selective")
    memory, time = [], []
    for k in range(5):  # each stage holds 4 layers: k = 4 is "full" on every layer
        est = cost.estimate(dataclasses.replace(config, full_layers=k))
        memory.append(float(est.total_memory))
        time.append(float(est.step_time))
    full = cost.estimate(dataclasses.replace(config, recompute="full"))
    assert memory == sorted(memory, reverse=True) and memory[-1] == pytest.approx(float(full.total_memory))
    assert time == sorted(time) and time[0] < time[-1] == pytest.approx(float(full.step_time))
    assert cost.layers_per_stage(config) == [4, 4]
    assert cost.recompute_choice(dataclasses.replace(config, full_layers=1)) == {
        "transformer.h.0": "full", "transformer.h.4": "full", "*": "selective"}
    assert cost.recompute_choice(config) == "selective"
    with pytest.raises(ValueError, match="full_layers=2 mixes full recomputation with recompute='none' or "
                                         "'selective' for the other layers, not 'full'"):
        Config(dp=1, recompute="full", full_layers=2)


def test_the_planner_recomputes_fully_only_the_layers_it_takes_to_fit(profile) -> None:
    cpu = Cluster.preset("cpu")
    cost = CostModel(profile, cpu, PRECISIONS["fp32"], seq_len=SEQ)
    none = Config(dp=1, pp=2, microbatches=8, microbatch_size=1)  # 1F1B, b = 1: the planner's only choice below
    budget = float(cost.estimate(dataclasses.replace(none, full_layers=2)).total_memory)
    assert float(cost.estimate(dataclasses.replace(none, full_layers=1)).total_memory) > budget
    result = plan(None, 2, cluster=cpu.replace(memory=budget), global_batch=8, seq_len=SEQ, profile=profile,
                  precision="fp32", pp=(2,), schedules=("1f1b",), recompute=("none", "full"), max_microbatch=1)
    best = result.best
    assert best.config == dataclasses.replace(none, full_layers=2)  # the fewest full layers that fit
    assert best.parallelize_options()["recompute"] == {"transformer.h.0": "full", "transformer.h.1": "full",
                                                       "transformer.h.4": "full", "transformer.h.5": "full",
                                                       "*": "none"}
    full = next(c for c in result.candidates if c.config == dataclasses.replace(none, recompute="full"))
    assert full.fits and full.step_time > best.step_time
    assert rc_label(best.config) == "f2" and rc_label(dataclasses.replace(best.config, recompute="selective")) == \
        "f2+s"
    text = str(result)
    assert " f2 " in result.table(1).splitlines()[1]
    assert "recomputation: full on 2 of each pipeline stage's 4 layers, none on the others" in text
    assert "where none on every layer needs" in text and "full on every layer takes" in text
    # no mix where one mode fits: with "selective" searched too, selective is the best
    roomy = plan(None, 2, cluster=cpu, global_batch=8, seq_len=SEQ, profile=profile, precision="fp32", pp=(2,),
                 schedules=("1f1b",), max_microbatch=1)
    assert not any(c.config.full_layers for c in roomy.candidates)


def _auto(memory: float) -> tuple[tuple, float]:
    from autopar.planner import auto

    local = auto._local_cluster
    auto._local_cluster = lambda devices: local(devices).replace(memory=memory)
    try:
        torch.manual_seed(0)
        pm = parallelize(models.gpt2(layers=4, dtype=torch.float32), "auto", example_inputs=(IDS,),
                         example_target=IDS, loss_fn=models.lm_loss, optimizer=models.adamw)
        loss = pm.step(IDS, target=IDS)
    finally:
        auto._local_cluster = local
    return pm.plan.recompute.modes, float(loss)


def test_parallelize_auto_runs_the_planners_mix(launcher) -> None:
    """One rank, a device too small for "none" or "selective" on every layer at any microbatch size, and
    for "full" beyond one sequence per microbatch: the best is a mix, and the rank's graph runs it."""
    model = models.gpt2(layers=4, dtype=torch.float32)
    cost = CostModel(profile_model(model, example_inputs=(IDS[:2],), tp_sizes=(1,)), Cluster.preset("cpu"),
                     PRECISIONS["fp32"], seq_len=SEQ)
    one = Config(dp=1, microbatches=4, microbatch_size=1)
    need = {rc: float(cost.estimate(dataclasses.replace(one, recompute=rc)).total_memory)
            for rc in ("none", "selective")}
    twice = float(cost.estimate(Config(dp=1, microbatches=2, microbatch_size=2, recompute="full")).total_memory)
    budget = min(*need.values(), twice) - 1
    assert float(cost.estimate(dataclasses.replace(one, recompute="selective", full_layers=3)).total_memory) <= budget
    [(modes, loss)] = launcher(_auto, 1, budget)
    chosen = dict(modes)
    assert set(chosen) == {f"transformer.h.{i}" for i in range(4)}
    full = [layer for layer, mode in chosen.items() if mode == "full"]
    assert 0 < len(full) < 4 and full == [f"transformer.h.{i}" for i in range(len(full))]  # the first layers
    assert set(chosen.values()) - {"full"} in ({"none"}, {"selective"})
    with torch.no_grad():
        assert loss == pytest.approx(float(models.lm_loss(model(IDS), IDS)), rel=1e-4)  # the single-device loss
