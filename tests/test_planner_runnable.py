"""The planner's ``runnable`` tells the truth: what it marks runnable, ``parallelize`` runs and trains as one
device does; what it marks not runnable, ``parallelize`` refuses with the same reason.

``benchmarks/plan_runnable_sweep.py`` runs a covering sample of the runnable candidates of GPT-2, LLaMA, BERT,
Mixtral and a float32 LLaMA under bf16/mixed on 2 and 4 gloo ranks (every pair of mesh, ZeRO stage, schedule,
microbatches, recompute, cp attention and precision in at least one run); the slow test here runs a small one.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import models
from autopar import parallelize
from autopar.core.errors import UnsupportedError
from autopar.planner import plan
from autopar.planner.cluster import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
IDS = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(1))


def _cp_candidates(make, devices: int = 2) -> list:
    result = plan(make(), devices, cluster=Cluster.preset("cpu").replace(devices_per_node=devices), global_batch=8,
                  seq_len=16, precision="fp64", optimizer="adam", cp=(devices,), tp=(1,), pp=(1,), zero=(0,),
                  recompute=("none",), top=None)
    return [c for c in result.every.values() if c.config.cp > 1]


def _compile(make, candidate) -> None:
    pm = parallelize(make(), candidate.parallelism, loss_fn=models.lm_loss, optimizer=models.adamw)
    pm.compile((IDS,), {}, IDS)


def test_cp_is_not_runnable_for_an_eager_attention_the_runtime_refuses() -> None:
    """Gemma-2 computes attention as matmul-softmax-matmul: context parallelism rewrites only
    scaled_dot_product_attention, so the runtime refuses it, and the planner says so rather than offering it."""
    cands = _cp_candidates(models.gemma2)
    assert cands and not any(c.runnable for c in cands)
    assert all("attn_implementation='sdpa'" in c.not_runnable and "matmul" in c.not_runnable for c in cands)
    with pytest.raises(UnsupportedError, match=r"relates the local sequence .* to itself.*sdpa"):
        _compile(models.gemma2, cands[0])


@pytest.mark.slow  # (the default run's control is the eager LLaMA below, which passes the same check)
def test_cp_stays_runnable_for_sdpa_attention() -> None:
    """The control: GPT-2's attention is scaled_dot_product_attention; its ring candidate is runnable and
    compiles."""
    cands = _cp_candidates(models.gpt2)
    ring = [c for c in cands if c.config.cp_attention == "ring"]
    assert ring and all(c.runnable for c in ring)
    _compile(models.gpt2, ring[0])


def _llama_eager() -> torch.nn.Module:
    model = models.llama()
    model.config._attn_implementation = "eager"
    return model


def test_cp_stays_runnable_for_an_eager_attention_the_runtime_rewrites() -> None:
    """LLaMA's eager matmul-softmax-matmul is the chain ``passes/context_eager.py`` rewrites to
    scaled_dot_product_attention before context parallelism: its ring candidate is runnable (that it runs at
    cp=2 as one device does: tests/test_context_eager.py)."""
    cands = _cp_candidates(_llama_eager)
    ring = [c for c in cands if c.config.cp_attention == "ring"]
    assert ring and all(c.runnable for c in ring), [c.not_runnable for c in ring]


@pytest.mark.slow
def test_a_covering_sample_of_runnable_candidates_trains_as_one_device(launcher) -> None:
    import plan_runnable_sweep as sweep

    cands = [x for x in sweep.candidates(["gpt2", "mixtral"], [2], None) if x[2].runnable]
    chosen = sweep.covering(cands, 12)
    assert len(chosen) == 12
    for name, _, c in chosen:
        sweep.run_one(launcher, name, c)
