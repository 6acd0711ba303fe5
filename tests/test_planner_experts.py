"""The planner's expert parallelism: the ep degree searched, its cost and memory, checked against runs.

A routed-experts model written as a loop (Hugging Face's eager experts) runs dense dispatch at ep=1 (every
expert on every token: E/k times the routed FLOPs) and routed rows under ep, at the price of four all-to-alls
per layer and microbatch; ep divides the expert state. The planner must prefer ep where the experts dominate
and the ep group's link is fast, and ep=1 where the all-to-alls cross a slow link; its memory and all-to-all
bytes must be what a run at dp=2, ep=2 measures.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import models
from autopar import parallelize
from autopar.core.errors import UnsupportedError
from autopar.passes.expert_parallel import check_composes
from autopar.planner import plan
from autopar.planner.cluster import Cluster, Link
from autopar.planner.config import Config
from autopar.planner.model_profile import profile_model

BATCH, SEQ = 8, 16
ONLY_DP = dict(tp=(1,), pp=(1,), zero=(0,), recompute=("none",))


def _big_mixtral(experts: int = 8) -> torch.nn.Module:
    """A Mixtral whose experts hold most of the FLOPs (hidden 1,024, 8 experts of width 3,584, top-2), on the
    meta device, its experts a loop (what expert parallelism takes)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(hidden_size=1024, intermediate_size=3584, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=8, vocab_size=1024, max_position_embeddings=4096, use_cache=False,
                        num_local_experts=experts, num_experts_per_tok=2)
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg)
    model.config._experts_implementation = "eager"
    return model


@pytest.fixture(scope="module")
def big_profile():
    return profile_model(_big_mixtral(), tp_sizes=(1,))


def _fast_node() -> Cluster:
    return Cluster.preset("dgx-a100")


def _slow_links() -> Cluster:
    """One device per node, 1 Gb/s Ethernet (125 MB/s) between them: every ep group crosses a slow link."""
    return Cluster.preset("dgx-a100").replace(devices_per_node=1, inter=Link(bandwidth=1.25e8, latency=1e-4))


def test_ep_wins_when_the_experts_dominate_and_the_link_is_fast(big_profile) -> None:
    result = plan(None, 8, cluster=_fast_node(), global_batch=64, seq_len=2048, precision="fp32", optimizer="adam",
                  profile=big_profile, top=None, **ONLY_DP)
    best = result.best
    assert best.config.ep > 1 and best.runnable, result.table(6)
    assert f" 8 ep{best.config.ep} x 1 x 1 " in result.table(1)  # the mesh column names ep
    dense = result.candidate(dataclasses.replace(best.config, ep=1))
    assert dense.estimate.time["compute"] > 2 * best.estimate.time["compute"]  # dense dispatch: E/k = 4x
    assert float(best.estimate.time["expert_parallel"]) > 0
    assert any(line.startswith("ep=1 instead of") for line in result.explanation), result.explanation


def test_ep_loses_when_the_all_to_alls_cross_slow_links(big_profile) -> None:
    """64 sequences per rank: the all-to-alls move 4 T k H per layer and outgrow the dp gradient reduction
    (which ep shrinks too: 1/ep of the expert gradients) and the dense dispatch they save."""
    result = plan(None, 8, cluster=_slow_links(), global_batch=512, seq_len=2048, precision="fp32",
                  optimizer="adam", profile=big_profile, top=None, **ONLY_DP)
    best = result.best
    assert best.config.ep == 1, result.table(6)
    twin = result.candidate(dataclasses.replace(best.config, ep=2))
    saved = float(best.estimate.time["compute"] - twin.estimate.time["compute"])
    assert float(twin.estimate.time["expert_parallel"]) > saved > 0
    assert any(line.startswith("ep=2 instead of 1") for line in result.explanation), result.explanation


def test_ep_degrees_divide_dp_and_the_expert_count_and_dense_models_get_none() -> None:
    profile = profile_model(_big_mixtral(experts=6), tp_sizes=(1,))
    assert profile.experts.ep_sizes(12) == [2, 3, 6]
    assert profile.experts.ep_sizes(8) == [2]
    result = plan(models.gpt2(dtype=torch.float32), 4, cluster="cpu", global_batch=BATCH, seq_len=SEQ,
                  precision="fp32", top=None, **ONLY_DP)
    assert result.profile.experts is None and all(c.ep == 1 for c in result.every)


def test_runnable_ep_candidates_are_exactly_those_the_runtime_accepts(big_profile) -> None:
    """``parallelize(model, "auto")`` keeps runnable candidates only: none of them may raise for ep."""
    for precision in ("fp32", "mixed"):
        result = plan(None, 8, cluster=_fast_node(), global_batch=64, seq_len=2048, precision=precision,
                      profile=big_profile, top=None, tp=(1, ), recompute=("none", "full"))
        eps = [c for c in result.every.values() if c.config.ep > 1]
        assert eps
        for c in eps:
            options = c.parallelize_options()
            composes = True
            try:
                check_composes(c.mesh, zero=options["zero"], precision=options["precision"],
                               recompute=options["recompute"])
            except UnsupportedError:
                composes = False
            assert c.runnable == composes, (c.config.describe(), c.not_runnable)


def test_grouped_matmul_experts_are_planned_and_offered_under_ep() -> None:
    model = _big_mixtral()
    model.config._experts_implementation = "grouped_mm"  # Hugging Face's default: one grouped matmul
    result = plan(model, 8, cluster=_fast_node(), global_batch=64, seq_len=2048, precision="fp32", top=None,
                  **ONLY_DP)
    assert result.profile.experts.forms == {"grouped"}
    ep = result.candidate(Config(dp=8, ep=2, microbatch_size=8))
    assert ep.runnable, ep.not_runnable  # tests/test_expert_grouped.py runs it


# --- against a run: Mesh(dp=2, ep=2) on a small float64 Mixtral with eager experts ---------------------------

def _small_mixtral() -> torch.nn.Module:
    return models.mixtral_eager(layers=1, aux=False)


def _run(parallelism, steps: int) -> tuple[dict, dict]:
    ids = torch.randint(3, 96, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    pm = parallelize(_small_mixtral(), parallelism, loss_fn=models.lm_loss, optimizer=models.adamw)
    for _ in range(steps):
        pm.step(ids, target=ids)
    return pm.memory(), pm.communication()


def test_ep_memory_and_all_to_all_bytes_are_the_measured_ones(launcher) -> None:
    """dp=2, ep=2: parameter, gradient and optimizer bytes per rank within 5% of ``pm.memory()``; the
    all-to-all bytes the ranks send per step equal the formula (dispatch and combine, forward and backward:
    what the ranks send in all is 4 T k H per rank, whatever the routing; the row counts E int64 per layer)."""
    result = plan(_small_mixtral(), 2, cluster="cpu", global_batch=BATCH, seq_len=SEQ, precision="fp64",
                  optimizer="adam", top=None, **ONLY_DP)
    chosen = result.candidate(Config(dp=2, ep=2, microbatch_size=BATCH // 2))
    replicated = result.candidate(Config(dp=2, microbatch_size=BATCH // 2))
    assert chosen.runnable and repr(chosen.mesh) == "Mesh(dp=2, ep=2)"
    steps = 1
    runs = launcher(_run, 2, chosen.parallelism, steps)
    calls, nbytes = result.cost.expert_all_to_all(chosen.config)
    experts = result.profile.experts
    counts = sum(x.experts * 8 for x in experts.layers)
    for memory, comm in runs:
        for key in ("parameters", "gradients", "optimizer"):
            assert memory[key] == pytest.approx(float(chosen.memory[key]), rel=0.05), (key, memory, chosen.memory)
            assert float(chosen.memory[key]) < 0.7 * float(replicated.memory[key])  # experts: 79% of the model
        assert comm["all_to_all@ep"] == steps * counts
    sent = sum(comm["all_to_all_v@ep"] for _, comm in runs)
    assert sent == 2 * steps * (nbytes - counts)
    assert calls == 5 * len(experts.layers)


def test_zero_shards_expert_state_over_the_ranks_holding_those_experts(big_profile) -> None:
    """Under ZeRO an expert's state is sharded over the dp / ep ranks that hold it: ep x (dp / ep) = dp, so
    ep leaves ZeRO-3's parameter, gradient and optimizer bytes per rank where they were (not divided twice)."""
    result = plan(None, 8, cluster=_fast_node(), global_batch=64, seq_len=2048, precision="mixed", top=None,
                  profile=big_profile, **{**ONLY_DP, "zero": (3,)})
    alone, with_ep = (result.candidate(Config(dp=8, zero=3, ep=e, microbatch_size=8)) for e in (1, 2))
    for key in ("parameters", "gradients", "optimizer"):
        assert float(with_ep.memory[key]) == pytest.approx(float(alone.memory[key]), rel=1e-9), key


def _experts_dominate() -> torch.nn.Module:
    """A float32 Mixtral (eager experts) whose 8 experts of width 512 dominate: the planner picks ep=2."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=4, vocab_size=96, max_position_embeddings=64, use_cache=False,
                        pad_token_id=0, bos_token_id=0, eos_token_id=0, num_local_experts=8, num_experts_per_tok=2)
    model = MixtralForCausalLM(cfg).train()
    model.config._experts_implementation = "eager"
    return model


def _auto_step() -> tuple[str, float]:
    ids = torch.randint(3, 96, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    pm = parallelize(_experts_dominate(), "auto", example_inputs=(ids,), example_target=ids,
                     loss_fn=models.lm_loss, optimizer=models.adamw)
    return repr(pm.mesh), float(pm.step(ids, target=ids))


@pytest.mark.slow
def test_parallelize_auto_picks_ep_where_it_wins_and_runs_it(launcher) -> None:
    """``parallelize(model, "auto")`` on 2 CPU ranks chooses ``Mesh(dp=2, ep=2)`` for a model whose experts
    dominate, and the runtime runs it on every rank (the loss equals one device's first-step loss)."""
    results = launcher(_auto_step, 2)
    assert {mesh for mesh, _ in results} == {"Mesh(dp=2, ep=2)"}, results
    ids = torch.randint(3, 96, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    out = _experts_dominate()(ids)
    expected = float(models.lm_loss(out, ids))
    assert all(loss == pytest.approx(expected, rel=1e-5) for _, loss in results), (results, expected)


def test_routing_imbalance_scales_the_busiest_ranks_expert_work_and_all_to_alls(big_profile) -> None:
    """``expert_imbalance``: the busiest rank's routed rows over the mean; ep's expert FLOPs and all-to-all
    bytes scale with it (the latency does not), ep=1's dense dispatch does not."""
    config = Config(dp=8, ep=2, microbatch_size=8)
    runs = {f: plan(None, 8, cluster=_fast_node(), global_batch=64, seq_len=2048, precision="fp32", top=None,
                    profile=big_profile, expert_imbalance=f, **ONLY_DP) for f in (1.0, 1.5)}
    even, skewed = (runs[f].candidate(config).estimate.time for f in (1.0, 1.5))
    assert 1.3 < float(skewed["expert_parallel"]) / float(even["expert_parallel"]) <= 1.5
    assert float(skewed["compute"]) > float(even["compute"])
    dense = [runs[f].candidate(Config(dp=8, microbatch_size=8)).estimate.time["compute"] for f in (1.0, 1.5)]
    assert float(dense[0]) == float(dense[1])
    with pytest.raises(ValueError, match="expert_imbalance=0.5"):
        plan(None, 8, cluster=_fast_node(), global_batch=64, seq_len=2048, profile=big_profile,
             expert_imbalance=0.5, **ONLY_DP)


def test_the_bounded_plan_keeps_the_best_of_each_ep_degree(big_profile) -> None:
    """The plan's candidates hold the best of every ep degree, as timing every configuration would (the expert
    benchmark's table and the explanation read them)."""
    args = dict(cluster=_fast_node(), global_batch=64, seq_len=2048, precision="mixed", profile=big_profile,
                tp=(1,), recompute=("none",))
    fast, full = plan(None, 8, top=1, **args), plan(None, 8, top=None, **args)

    def best_by_ep(result) -> dict:
        best: dict = {}
        for c in result.candidates:
            if c.fits:
                best.setdefault(c.config.ep, (c.config, c.step_time))
        return best

    assert len(best_by_ep(full)) > 2 and best_by_ep(fast) == best_by_ep(full)
    assert fast.timed < full.timed
