"""The planner's step time comes from simulating the step program the runtime runs (autopar/planner/step_sim.py).

- The simulated program issues ZeRO-3's gathers, re-gathers and reduce-scatters among each layer's backward in
  the order the runtime's own timeline (``pm.timeline(layers=True)``) shows them on 2 gloo ranks, for
  ``zero_prefetch`` 0, 1 and 2 and two microbatches: the same order means the same collectives hidden behind
  compute and the same waits (with prefetch 0 every re-gather is issued when its layer's backward begins, so
  backward waits for it; with prefetch 1 it is issued a layer ahead); with every block recomputed too.
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
RUNS = ((0, 1, "none"), (1, 1, "none"), (2, 1, "none"), (1, 2, "none"), (1, 1, "full"), (2, 1, "full"))
# (zero_prefetch, microbatches, recompute)
SHOWN = ("gather", "regather", "backward", "reduce_scatter")


def _timelines() -> dict:
    out = {}
    for prefetch, microbatches, recompute in RUNS:
        torch.manual_seed(0)
        pm = parallelize(models.gpt2(layers=LAYERS, d=32), Mesh(dp=2), loss_fn=models.lm_loss, optimizer=models.sgd,
                         zero=3, zero_prefetch=prefetch, microbatches=microbatches, recompute=recompute)
        for _ in range(2):
            pm.step(IDS, target=IDS)
        out[prefetch, microbatches, recompute] = [what for what, _, _ in pm.timeline(layers=True)]
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


def _simulated(small, prefetch: int, microbatches: int, recompute: str = "none") -> list[str]:
    """The simulated program's events in issue order, named as the runtime's timeline names them."""
    profile, cost = small
    config = Config(dp=2, zero=3, zero_prefetch=prefetch, microbatches=microbatches, microbatch_size=2,
                    recompute=recompute)
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


@pytest.mark.parametrize("prefetch, microbatches, recompute", RUNS)
def test_the_simulated_zero3_order_is_the_runtimes(runtime, small, prefetch: int, microbatches: int,
                                                   recompute: str) -> None:
    want = _blocks(_simulated(small, prefetch, microbatches, recompute))
    assert len(want) == microbatches * 4 * LAYERS  # each block: gather, regather, backward, reduce-scatter
    for timeline in runtime:
        assert _blocks(timeline[prefetch, microbatches, recompute]) == want


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


@pytest.mark.parametrize("bucket_mb", [25, 0.005])
def test_zero2s_one_queue_spans_the_microbatches(small, bucket_mb: float) -> None:
    """ZeRO-2 reduces every microbatch's buckets through the rank's one queue, as ``runtime/zero_group.py``'s
    ``ReduceQueue`` does: each reduction is issued only after the one before it, the previous microbatch's last
    included, has been waited for."""
    profile, cost = small
    cost = CostModel(profile, cost.cluster, cost.precision, seq_len=IDS.shape[1], bucket_bytes=int(bucket_mb * 2**20))
    program = cost.step_program(Config(dp=2, zero=2, microbatches=3, microbatch_size=1))
    buckets = [i for i, e in enumerate(program) if e.kind is Kind.BUCKET]
    assert len(buckets) >= 3
    for a, b in zip(buckets, buckets[1:]):
        assert any(program[k].kind is Kind.WAIT and a in program[k].after for k in range(a + 1, b)), (a, b)


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


def _per_submodule(max_live: int, max_reuse: int = 0, reduce: float = 0.25, microbatches: int = 1,
                   tied: bool | None = None) -> tuple:
    """Two units of two submodules (4 and 8 elements each, one parameter each) gathered per submodule as
    DeepSpeed's 2021 coordinator does: the program and its simulated timeline. ``tied``: a third unit uses a0
    too (as a tied embedding), held from the model's forward to the end of backward (True) or not (False)."""
    from autopar.planner.step_program import DataParallelPlan, Unit, step_program
    from autopar.planner.submodule_fetch import Submodule, SubmoduleFetch

    units = [Unit(1.0, 2.0, submodules=(Submodule(f"u{i}.a", (2 * i,), 1 / 3), Submodule(f"u{i}.b", (2 * i + 1,), 2 / 3)))
             for i in range(2)]
    if tied is not None:
        units.append(Unit(1.0, 2.0, submodules=(Submodule("u0.a", (0,), 1.0),)))
    fetch = SubmoduleFetch(prefetch_bucket=1, max_live=max_live, max_reuse=max_reuse, persistence=1,
                           hold_shared=bool(tied))
    plan = DataParallelPlan(zero=3, link="dp", fetch=fetch, elements=(4, 8, 4, 8), gather=(0.5,) * 4,
                            reduce=(reduce,) * 4, names=("a0", "b0", "a1", "b1"))
    program = step_program(units, plan, microbatches)
    return program, simulate(program, 0.0)


def _first(program: list, kind: Kind, name: str) -> int:
    return next(k for k, e in enumerate(program) if e.kind is kind and e.name == name)


def test_per_submodule_a_live_budget_under_one_submodule_prefetches_nothing() -> None:
    """With fewer live elements allowed than a submodule holds, each gather waits for its own use (after the
    previous submodule's compute), so forward runs gathers and compute in series; with room, the next
    submodule's gather is issued before the current one computes and runs beside it."""
    serial, timeline = _per_submodule(max_live=4)
    b0 = _first(serial, Kind.GATHER, "gather b0")
    a0 = max(k for k in range(b0) if serial[k].kind is Kind.COMPUTE)
    assert serial[a0].name == "forward 0" and timeline.start[b0] >= timeline.end[a0] - 1e-12
    assert sum(1 for e in serial[:_first(serial, Kind.COMPUTE, "backward 1")] if e.kind is Kind.GATHER) == 4
    forward = timeline.end[max(k for k, e in enumerate(serial) if e.name == "forward 1")]
    assert forward == pytest.approx(4 * 0.5 + 2 * 1.0)
    ahead, timeline = _per_submodule(max_live=100)
    b0 = _first(ahead, Kind.GATHER, "gather b0")
    assert b0 < _first(ahead, Kind.COMPUTE, "forward 0") and timeline.start[b0] < timeline.end[b0 + 1]


def test_per_submodule_a_submodule_used_again_soon_is_kept() -> None:
    """The last submodule of forward is used again at once by backward: kept within ``max_reuse`` (no re-gather),
    re-gathered with a reuse distance of 0 (DeepSpeed's counts the elements of the uses between: the others' are
    at least 8); every parameter is reduce-scattered once per microbatch. The trace spans the step, but what is
    still gathered when a microbatch's backward ends is released (``_partition_all_parameters``): the next
    microbatch gathers everything again."""
    for reuse, regathered in ((1, {"a0", "b0", "a1"}), (0, {"a0", "b0", "a1", "b1"})):
        for microbatches in (1, 2):
            program, _ = _per_submodule(max_live=100, max_reuse=reuse, microbatches=microbatches)
            names = [e.name.split()[1] for e in program if e.kind is Kind.REGATHER]
            assert set(names) == regathered and len(names) == len(regathered) * microbatches, (reuse, names)
            scattered = sorted(e.name for e in program if e.kind is Kind.REDUCE_SCATTER)
            assert scattered == sorted(f"reduce_scatter {n}" for n in ("a0", "b0", "a1", "b1") * microbatches)
            gathered = [e.name for e in program if e.kind is Kind.GATHER]
            assert len(gathered) == 4 * microbatches, (reuse, gathered)


def test_per_submodule_the_host_waits_for_the_device_before_each_use() -> None:
    """A gradient's reduce-scatter is issued as its backward is launched and runs beside it, but the next
    submodule's fetch waits for the device (``torch.cuda.synchronize``): its compute starts after it ends."""
    program, timeline = _per_submodule(max_live=100, reduce=3.0)
    rs = _first(program, Kind.REDUCE_SCATTER, "reduce_scatter b1")
    assert rs < _first(program, Kind.COMPUTE, "backward 1")
    assert timeline.start[rs] < timeline.end[_first(program, Kind.COMPUTE, "backward 1")]
    after = next(k for k in range(rs + 1, len(program)) if program[k].kind is Kind.COMPUTE
                 and program[k].name == "backward 1" and program[k].seconds == pytest.approx(2 / 3))
    assert timeline.start[after] >= timeline.end[rs] - 1e-12


def test_per_submodule_a_parameter_several_units_use_is_held_through_the_microbatch() -> None:
    """A parameter two units use (a tied embedding) is the model's external parameter: gathered as the model's
    forward begins, before any unit computes, and never again until the microbatch's backward ends; without
    ``hold_shared`` it is released after its uses and gathered again at the next."""
    for microbatches in (1, 2):
        program, _ = _per_submodule(max_live=100, tied=True, microbatches=microbatches)
        a0 = [k for k, e in enumerate(program) if e.kind in (Kind.GATHER, Kind.REGATHER) and e.name.endswith(" a0")]
        assert len(a0) == microbatches and a0[0] == 0
        loose, _ = _per_submodule(max_live=100, tied=False, microbatches=microbatches)
        assert sum(e.name.endswith(" a0") for e in loose if e.kind in (Kind.GATHER, Kind.REGATHER)) \
            == 4 * microbatches


def test_per_submodule_cost_model_gathers_each_large_parameter(small) -> None:
    """``CostModel(zero3_fetch=...)``: one gather per parameter of at least ``persistence`` elements per use,
    smaller ones never; without it the plan is per layer as before."""
    from autopar.planner.submodule_fetch import SubmoduleFetch

    profile, cost = small
    fetch = SubmoduleFetch(persistence=1000)
    per = CostModel(profile, cost.cluster, cost.precision, seq_len=IDS.shape[1], zero3_fetch=fetch)
    config = Config(dp=2, zero=3, microbatches=1, microbatch_size=2)
    program = per.step_program(config)
    large = {f"{i}:{n}" if n.startswith("transformer.h.") else n for i, seg in enumerate(profile.sequence())
             for n, e in profile.part(seg, 1).params.items() if e >= 1000}
    assert {e.name.split(" ", 1)[1] for e in program if e.kind is Kind.GATHER} == large
    assert sum(e.kind is Kind.GATHER for e in cost.step_program(config)) < len(large)
    assert float(per.estimate(config).step_time) > 0
