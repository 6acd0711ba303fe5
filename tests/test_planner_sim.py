"""The planner's step time comes from simulating the step program the runtime runs (autopar/planner/step_sim.py).

- The simulated program issues ZeRO-3's gathers, re-gathers and reduce-scatters among each layer's backward in
  the order the runtime's own timeline (``pm.timeline(layers=True)``) shows them on 2 gloo ranks, for
  ``zero_prefetch`` 0, 1 and 2 and two microbatches: the same order means the same collectives hidden behind
  compute and the same waits (with prefetch 0 every re-gather is issued when its layer's backward begins, so
  backward waits for it; with prefetch 1 it is issued a layer ahead).
- Simulating two and three microbatches and repeating the difference gives the whole program's simulation.
- Nothing overlaps for free: a step is never shorter than its dp link is busy, and with ``contention`` 1 the
  overlapped step is as long as the serial one. The removed ``overlap`` figure is an error saying why.
"""
from __future__ import annotations

import pytest
import torch

import models
from autopar import Mesh, parallelize
from autopar.planner import gpt, plan
from autopar.planner.cluster import Cluster, Link
from autopar.planner.cost_model import PRECISIONS, Config, CostModel, precision_of
from autopar.planner.megatron import HELD_OUT_ERROR
from autopar.planner.model_profile import profile_model
from autopar.planner.step_sim import Kind, simulate

LAYERS = 4
IDS = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(1))
RUNS = ((0, 1), (1, 1), (2, 1), (1, 2))  # (zero_prefetch, microbatches)
SHOWN = ("gather", "regather", "backward", "reduce_scatter")


def _timelines() -> dict:
    out = {}
    for prefetch, microbatches in RUNS:
        torch.manual_seed(0)
        pm = parallelize(models.gpt2(layers=LAYERS, d=32), Mesh(dp=2), loss_fn=models.lm_loss, optimizer=models.sgd,
                         zero=3, zero_prefetch=prefetch, microbatches=microbatches)
        for _ in range(2):
            pm.step(IDS, target=IDS)
        out[prefetch, microbatches] = [what for what, _, _ in pm.timeline(layers=True)]
    return out


@pytest.fixture(scope="module")
def runtime(launcher) -> list[dict]:
    return launcher(_timelines, 2)


@pytest.fixture(scope="module")
def small():
    profile = profile_model(models.gpt2(layers=LAYERS, d=32), example_inputs=(IDS,), tp_sizes=(1,))
    return profile, CostModel(profile, Cluster.preset("cpu").replace(cores=0), precision_of(torch.float64),
                              seq_len=IDS.shape[1])


def _blocks(whats: list[str]) -> list[str]:
    """The transformer blocks' events, in order: ``"regather transformer.h.2"``, ``"backward transformer.h.3"``."""
    return [w for w in whats if w.split(" ")[0] in SHOWN and w.split(" ")[-1].startswith("transformer.h.")]


def _simulated(small, prefetch: int, microbatches: int) -> list[str]:
    """The simulated program's events in issue order, named as the runtime's timeline names them."""
    profile, cost = small
    config = Config(dp=2, zero=3, zero_prefetch=prefetch, microbatches=microbatches, microbatch_size=2)
    names = {f"unit {i}": name for i, name in enumerate(profile.layer_names()) if name is not None}
    out = []
    for e in cost.step_program(config):
        if e.kind not in (Kind.COMPUTE, Kind.GATHER, Kind.REGATHER, Kind.REDUCE_SCATTER):
            continue
        kind, _, what = e.name.partition(" ")
        if e.kind is Kind.COMPUTE:
            what = profile.layer_names()[int(what)] or what
        out.append(f"{kind} {names.get(what, what)}")
    return out


@pytest.mark.parametrize("prefetch, microbatches", RUNS)
def test_the_simulated_zero3_order_is_the_runtimes(runtime, small, prefetch: int, microbatches: int) -> None:
    want = _blocks(_simulated(small, prefetch, microbatches))
    assert len(want) == microbatches * 4 * LAYERS  # each block: gather, regather, backward, reduce-scatter
    for timeline in runtime:
        assert _blocks(timeline[prefetch, microbatches]) == want


def test_prefetch_decides_which_regathers_backward_waits_for(small) -> None:
    """Structural, whatever the seconds: without prefetch every block's backward waits for its re-gather; with
    it, a block's re-gather is issued before the block above computes, so it runs beside that compute."""
    _, cost = small
    for prefetch in (0, 1):
        config = Config(dp=2, zero=3, zero_prefetch=prefetch, microbatches=1, microbatch_size=2)
        program = cost.step_program(config)
        timeline = simulate(program, cost.cluster.contention)
        for i, e in enumerate(program):
            if e.kind is Kind.REGATHER and e.name.startswith("regather unit"):  # the blocks' own parameters
                consumer = next(j for j in range(i, len(program)) if i in program[j].after)
                computes_between = any(program[j].kind is Kind.COMPUTE for j in range(i, consumer))
                assert computes_between == (prefetch > 0), (prefetch, e.name)
                if not prefetch:
                    assert timeline.waited[consumer] > 0, e.name


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_two_microbatches_repeated_equal_the_whole_program(small, zero: int) -> None:
    _, cost = small
    config = Config(dp=2, zero=zero, microbatches=6, microbatch_size=1)
    charged = cost.dp_exposure(config)
    program = cost.step_program(config)
    timeline = simulate(program, cost.cluster.contention)
    base = sum(e.seconds for e in program if e.kind in (Kind.COMPUTE, Kind.TP))
    assert charged.exposed + charged.contention == pytest.approx(timeline.makespan - base, rel=1e-9)
    assert charged.contention == pytest.approx(timeline.stretch, rel=1e-9, abs=1e-15)
    assert charged.exposed > 0  # (gloo's latency: something shows)


def test_a_runtime_that_gathers_recomputed_layers_twice_moves_twice_the_backward_bytes(small) -> None:
    """``recompute_gathers`` (DeepSpeed's ZeRO-3 under full recomputation: the recomputed forward's gather, then
    backward's) doubles each re-gather's seconds, and only under full recomputation."""
    profile, cost = small
    twice = CostModel(profile, cost.cluster, cost.precision, seq_len=IDS.shape[1], recompute_gathers=True)
    for recompute, times in (("full", 2), ("selective", 1), ("none", 1)):
        config = Config(dp=2, zero=3, microbatches=1, microbatch_size=2, recompute=recompute)
        once, again = cost.step_program(config), twice.step_program(config)
        for kind in (Kind.GATHER, Kind.REGATHER, Kind.REDUCE_SCATTER):
            a = sum(e.seconds for e in once if e.kind is kind)
            b = sum(e.seconds for e in again if e.kind is kind)
            assert b == pytest.approx(a * (times if kind is Kind.REGATHER else 1), rel=1e-12), (recompute, kind)


@pytest.fixture(scope="module")
def gpt_profile():
    return profile_model(gpt(8, 256, 8, vocab=1024), tp_sizes=(1, 2))


def test_nothing_overlaps_for_free(gpt_profile) -> None:
    config = Config(dp=64, zero=3, microbatches=2, microbatch_size=2)

    def estimate(bandwidth: float, contention: float | None = None):
        cluster = Cluster.preset("dgx-a100").replace(inter=Link(bandwidth, 1e-6))
        if contention is not None:
            cluster = cluster.replace(contention=contention)
        return CostModel(gpt_profile, cluster, PRECISIONS["mixed"], seq_len=2048).estimate(config)

    slow = estimate(1e9)  # ZeRO-3's traffic outweighs compute: the link sets the step
    assert slow.step_time >= slow.links["dp"].busy and slow.links["dp"].exposed > 0.5 * slow.time["compute"]
    assert estimate(1e9, 0.0).step_time == pytest.approx(slow.step_time, rel=1e-3)  # slowed compute still waits
    balanced, free, serial = estimate(30e9), estimate(30e9, 0.0), estimate(30e9, 1.0)  # half of compute
    assert balanced.links["dp"].hidden > 0.5 * balanced.links["dp"].busy
    assert free.step_time < balanced.step_time < serial.step_time
    alone = float(serial.time["compute"] + serial.time["tensor_parallel"] + serial.time["optimizer"])
    assert serial.step_time == pytest.approx(alone + serial.links["dp"].busy, rel=1e-6)  # contention 1: serial
    with pytest.raises(ValueError, match="overlap=1.0 is no longer a cluster figure: nothing overlaps for free"):
        Cluster.preset("dgx-a100").replace(overlap=1.0)
    with pytest.raises(ValueError, match="my.json: overlap=0.5 is no longer a cluster figure"):
        Cluster.from_dict({"overlap": 0.5}, source="my.json")


def test_the_plan_says_what_each_axis_link_carries_and_when_the_lead_is_within_the_error(gpt_profile) -> None:
    result = plan(None, 64, cluster="dgx-a100", global_batch=256, seq_len=2048, profile=gpt_profile, top=5)
    text = str(result)
    best = result.best.estimate
    assert "communication per axis, from the simulated step program" in text
    for axis in best.links:
        assert f"{axis} (" in text
    lead = result.candidates[1].step_time / result.best.step_time - 1
    assert (f"within the calibration's held-out error of {HELD_OUT_ERROR:.0%}" in text) == (lead < HELD_OUT_ERROR)
