"""The planner's context parallelism: the cp degree searched for long sequences, its memory and ring, and what
autopar's runtime runs of it (``autopar/planner/context_cost.py``, docs/planner.md).

A cp rank holds ``1 / cp`` of every sequence: its activations are divided by cp, its parameters are not
(ZeRO shards them over dp x cp); each attention passes the rank's K and V around the ring, ``cp - 1`` times
forward and ``2 cp - 1`` times backward. The planner must pick cp where memory forces it, not at short
sequences, and mark runnable only what ``Mesh(dp=, cp=)`` runs.
"""
from __future__ import annotations

import dataclasses

import pytest

from autopar.planner import plan, runnable
from autopar.planner.cluster import Cluster
from autopar.planner.comm_time import p2p
from autopar.planner.config import Config
from autopar.planner.cost_model import PRECISIONS, CostModel
from autopar.planner.llama import llama
from autopar.planner.model_profile import profile_model

LAYERS, HIDDEN, HEADS = 2, 256, 4
DENSE = dict(tp=(1,), pp=(1,), recompute=("none",), top=None)


@pytest.fixture(scope="module")
def profile():
    """A small LLaMA (GQA: 2 key/value heads expanded to 4 before the attention) on the meta device; its
    profile is symbolic in the sequence length, so every test plans it at its own."""
    return profile_model(llama(LAYERS, HIDDEN, HEADS, 2, 512, vocab=1024), sequence=True, tp_sizes=(1,))


def _cluster(memory: float) -> Cluster:
    return Cluster.preset("grand-teton-h100").replace(memory=memory)


def _plan(profile, seq: int, memory: float = 90e9, **kw):
    return plan(None, 8, cluster=_cluster(memory), global_batch=8, seq_len=seq, profile=profile,
                **{"precision": "bf16", **DENSE, **kw})


def test_cp_chosen_where_memory_forces_it(profile):
    """At 8,192 tokens (below the long-sequence threshold) on a device too small for any configuration
    without cp, cp is searched and the best holds the sequence over cp ranks; it fits, and says why."""
    alone = _plan(profile, 8192, cp=())
    least = min(c.total_memory for c in alone.candidates)
    result = _plan(profile, 8192, memory=0.8 * least)
    best = result.best
    assert best.config.cp > 1 and best.fits
    assert not any(c.fits for c in result.candidates if c.config.cp == 1)
    assert any("cp wins on memory" in line for line in result.explanation), result.explanation


def test_cp_not_searched_or_chosen_at_short_sequences(profile):
    """At 2,048 tokens with room to spare cp is not searched at all; searched by hand (``cp=(2, 4)``) it loses
    to dp alone, which computes as much per rank without the ring."""
    short = _plan(profile, 2048)
    assert not any(c.config.cp > 1 for c in short.every.values())
    forced = _plan(profile, 2048, cp=(2, 4))
    assert any(c.config.cp > 1 for c in forced.every.values())
    assert forced.best.config.cp == 1
    assert any("cp does not win" in line for line in forced.explanation), forced.explanation


def test_long_sequences_search_cp(profile):
    """From 16,384 tokens cp is searched even where configurations without it fit."""
    result = _plan(profile, 16384)
    assert any(c.config.cp == 8 for c in result.every.values())
    assert any(c.fits for c in result.every.values() if c.config.cp == 1)


def test_memory_divided_by_cp(profile):
    """A cp rank's activations are 1/cp of the same configuration's without cp; its parameters, gradients and
    optimizer state are those of the replicated model at ZeRO 0, and ZeRO shards them over dp x cp. (In fp32:
    bf16 adds the weights' bf16 copies autograd saves, per rank whatever its tokens.)"""
    cost = CostModel(profile, _cluster(90e9), PRECISIONS["fp32"], seq_len=8192)
    for cp in (2, 4):
        plain, ctx = cost.estimate(Config(dp=2)).memory, cost.estimate(Config(dp=2, cp=cp)).memory
        assert float(ctx["activations"]) == pytest.approx(float(plain["activations"]) / cp, rel=1e-12)
        for key in ("parameters", "gradients", "optimizer"):
            assert float(ctx[key]) == pytest.approx(float(plain[key]), rel=1e-12)
    sharded = cost.estimate(Config(dp=2, cp=4, zero=3)).memory
    flat = cost.estimate(Config(dp=8, zero=3)).memory
    for key in ("parameters", "gradients", "optimizer"):
        assert float(sharded[key]) == pytest.approx(float(flat[key]), rel=1e-12)


@pytest.mark.parametrize("cp,m,b", [(2, 1, 1), (4, 2, 1), (8, 1, 2)])
def test_ring_bytes(profile, cp: int, m: int, b: int):
    """Per step a cp rank sends, per attention and microbatch, ``cp - 1`` blocks forward and ``2 cp - 1``
    backward of its K and V: 2 b (s / cp) x heads x head dim elements (K/V expanded to every head, as the
    attention receives them), in bf16."""
    seq = 4096
    cost = CostModel(profile, _cluster(90e9), PRECISIONS["bf16"], seq_len=seq)
    attentions, exchanges, nbytes = cost.ring_exchanges(Config(dp=1, cp=cp, microbatches=m, microbatch_size=b))
    kv = 2 * b * (seq // cp) * HIDDEN * 2
    assert (attentions, exchanges) == (LAYERS, LAYERS * m * (3 * cp - 2))
    assert float(nbytes) == pytest.approx(LAYERS * m * (3 * cp - 2) * kv, rel=1e-12)
    assert cost.ring_exchanges(Config(dp=cp * m * b)) == (0, 0, 0)


def test_ring_exposure_is_what_the_blocks_do_not_hide(profile):
    """On a slow link the ring's sends outlast the block computations and the excess shows in the step; on a
    link fast enough only the last gradient exchange home stays exposed."""
    cfg = Config(dp=1, cp=4)
    times = {}
    for name, bandwidth in (("slow", 1e8), ("fast", 1e14)):
        cluster = _cluster(90e9)
        cluster = cluster.replace(intra=dataclasses.replace(cluster.intra, bandwidth=bandwidth))
        cost = CostModel(profile, cluster, PRECISIONS["bf16"], seq_len=8192)
        times[name] = float(cost.estimate(cfg).time["context_parallel"])
        flops_per_s = cluster.peak("bf16") * cluster.efficiency
        expected = 0.0
        for u in [u for st in cost._rank_units(cfg, 1)[0] for u in st if u.ring_kv]:
            send, block = p2p(u.ring_kv, cluster.intra.p2p()), u.attention_flops / 4 / flops_per_s
            expected += 3 * max(send - block, 0) + 3 * max(2 * send - 2 * block, 0) + send
        assert times[name] == pytest.approx(expected, rel=1e-9)
    assert times["slow"] > 100 * times["fast"] > 0


def test_runnable_is_what_the_cp_runtime_accepts(monkeypatch, profile):
    """``Mesh(dp=, cp=, pp=, tp=)`` runs with ZeRO 1-3, bf16/mixed precision and recomputation
    (``program.check_context_parallel``). Without a runtime cp axis nothing with cp is runnable."""
    monkeypatch.setattr(runnable, "MESH_AXES", ("dp", "cp", "pp", "tp"))
    composed = [Config(dp=2, cp=2, microbatches=2), Config(dp=1, cp=2, tp=2), Config(dp=1, cp=2, pp=2),
                Config(dp=2, cp=2, zero=3), Config(dp=2, cp=2, recompute="selective")]
    for cfg in composed:
        for prec in ("fp32", "mixed"):
            assert runnable.context_parallel_refused(cfg, PRECISIONS[prec], profile) == "", (cfg, prec)
    monkeypatch.setattr(runnable, "MESH_AXES", ("dp", "pp", "tp"))
    assert "cp mesh axis" in runnable.context_parallel_refused(Config(dp=2, cp=2), PRECISIONS["fp32"], profile)


def test_runnable_only_never_picks_what_the_runtime_refuses(profile):
    """What ``parallelize(model, "auto")`` plans with (``runnable_only=True``): every candidate left, cp or not,
    is one the runtime runs, ZeRO with cp among them."""
    result = _plan(profile, 16384, runnable_only=True, precision="fp32", zero=(0, 3))
    assert result.candidates and all(c.runnable for c in result.candidates)
    assert any(c.config.cp > 1 and c.config.zero == 3 for c in result.candidates)


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_runnable_cp_candidates_are_exactly_those_the_runtime_accepts(profile, precision: str) -> None:
    """Each cp candidate's runnability against the runtime's own check (``program.check_context_parallel``)."""
    from autopar.core.errors import UnsupportedError
    from autopar.options import Options
    from autopar.compiler.program import check_context_parallel

    result = _plan(profile, 16384, precision=precision, zero=(0, 3), top=None)
    cps = [c for c in result.every.values() if c.config.cp > 1 and not c.config.dp_shard and c.config.ep == 1]
    assert cps
    for c in cps:
        opts = c.parallelize_options()
        options = Options(zero=opts["zero"], precision=opts["precision"], recompute=opts["recompute"],
                          sequence_parallel=opts["sequence_parallel"],
                          cp_attention=opts["cp_attention"])
        try:
            check_context_parallel(c.mesh, options)
            accepted = True
        except UnsupportedError:
            accepted = False
        assert c.runnable == accepted, (c.config.describe(), c.not_runnable)
