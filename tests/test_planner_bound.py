"""The planner's branch and bound (autopar/planner/bound.py) ranks as timing every configuration would.

A small GPT on 64 DGX-A100 devices, with less memory per device so that some
configurations do not fit and the search adds recomputation mixes and
sequence-parallel twins, and hybrid-sharded meshes (ZeRO over a shard group
inside a node): the plan that times only what can rank and the exhaustive one
(``top=None``) give the same first rows, the same explanation (it compares the
best with the best of every other tp and pp size and of the other kind of
sharding, and reads ZeRO, recomputation and sequence-parallel twins) and the
same best of each tp and pp size and of hybrid and plain sharding, while the first times a small share of the configurations. The
lower bound is below the step time of every configuration that fits.
"""
from __future__ import annotations

import pytest

from autopar.planner import gpt, plan
from autopar.planner.cluster import Cluster
from autopar.planner.model_profile import profile_model

TOP = 5


@pytest.fixture(scope="module")
def profile():
    return profile_model(gpt(8, 256, 8, vocab=1024), tp_sizes=(1, 2, 4))


def _best_by(candidates: list, axis: str) -> dict[int, object]:
    best: dict[int, object] = {}
    for c in candidates:  # ranked: the first of each size (of hybrid sharding or not) is its best
        if c.fits:
            best.setdefault(c.config.dp_shard > 0 if axis == "hybrid" else getattr(c.config, axis), c.config)
    return best


@pytest.mark.parametrize("memory", [3e9, 0.8e9])
def test_branch_and_bound_ranks_as_the_exhaustive_search(profile, memory: float) -> None:
    cluster = Cluster.preset("dgx-a100").replace(memory=memory)
    args = dict(cluster=cluster, global_batch=256, seq_len=4096, profile=profile)
    fast, full = plan(None, 64, top=TOP, **args), plan(None, 64, top=None, **args)
    assert fast.considered == full.considered and fast.fitting == full.fitting
    assert full.timed == full.fitting and fast.timed < full.fitting / 20  # the bound ruled out most
    assert [(c.config, c.step_time) for c in fast.candidates[:TOP]] == \
        [(c.config, c.step_time) for c in full.candidates[:TOP]]
    assert fast.explanation == full.explanation
    for axis in ("tp", "pp", "hybrid"):
        assert _best_by(fast.candidates, axis) == _best_by(full.candidates, axis)
    assert any(c.config.sequence_parallel for c in full.candidates)  # the twins are part of the search
    assert len(_best_by(full.candidates, "hybrid")) == 2  # hybrid sharding is too, and some of it fits
    for c in full.candidates:
        if c.fits:
            floor, bound = (full.cost.step_time_bound(c.config, simulated=s) for s in (False, True))
            assert floor <= bound * (1 + 1e-12) and bound <= c.step_time * (1 + 1e-12), c.config.describe()


def test_a_bounded_out_configuration_is_still_found_and_timed_on_demand(profile) -> None:
    result = plan(None, 64, cluster="dgx-a100", global_batch=256, seq_len=4096, profile=profile, top=1)
    ranked = {c.config for c in result.candidates}
    skipped = next(c for c in result.every.values() if c.fits and c.config not in ranked)
    assert not skipped.timed and result.candidate(skipped.config) is skipped
    assert skipped.step_time == pytest.approx(float(result.cost.estimate(skipped.config).step_time), rel=1e-12)
    assert skipped.timed and skipped.step_time >= result.best.step_time
    assert f"({result.timed} timed, the others' lower bounds could not rank)" in str(result)


def test_branch_and_bound_ranks_a_local_batch_as_the_exhaustive_search(profile) -> None:
    """Under a local batch candidates rank by the time per local batch (``Candidate.pace``); the bound is
    divided by dp alike."""
    args = dict(cluster="dgx-a100", local_batch=4, seq_len=4096, profile=profile)
    fast, full = plan(None, 64, top=TOP, **args), plan(None, 64, top=None, **args)
    assert len({c.config.dp for c in full.candidates if c.fits}) > 2  # configurations of different work per step
    assert [(c.config, c.pace) for c in fast.candidates[:TOP]] == [(c.config, c.pace) for c in full.candidates[:TOP]]
    assert fast.explanation == full.explanation and fast.timed < full.timed
    for axis in ("tp", "pp"):
        assert _best_by(fast.candidates, axis) == _best_by(full.candidates, axis)
