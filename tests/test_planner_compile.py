"""Planning compiled steps (``plan(compile=True)``, ``autopar plan --compile``): the cluster's compiled efficiency
prices the matmuls, and each candidate's ``parallelism`` asks ``parallelize`` for ``compile=True``."""
from __future__ import annotations

import json

import pytest
import torch

import models
from autopar import parallelize
from autopar.cli import main
from autopar.planner import auto_choice, plan
from autopar.planner.cluster import COMPILE_GAIN, H100_500W_COMPILED_EFFICIENCY, H100_500W_EFFICIENCY, Cluster
from autopar.planner.gpt import gpt


def test_a_compiled_cluster_takes_its_fit_or_the_h100_ratio() -> None:
    assert Cluster.preset("grand-teton-h100").compiled().efficiency == H100_500W_COMPILED_EFFICIENCY
    a100 = Cluster.preset("dgx-a100")
    assert a100.compiled().efficiency == pytest.approx(a100.efficiency * H100_500W_COMPILED_EFFICIENCY
                                                       / H100_500W_EFFICIENCY)
    assert COMPILE_GAIN > 6667 / 5762  # the matmuls gain more than torchtitan's tokens/s (1.16x) did
    assert Cluster.preset("cpu").compiled().efficiency == 1.0  # (already 1: planned as eager)


def test_compiled_plans_are_faster_by_the_compute_they_price_and_ask_for_compile() -> None:
    kw = dict(devices=16, cluster="grand-teton-h100", global_batch=32, seq_len=1024, top=3)
    eager, compiled = plan(gpt(4, 1024, 8), **kw), plan(gpt(4, 1024, 8), **kw, compile=True)
    assert compiled.compiled and not eager.compiled
    config = compiled.best.config
    e, c = eager.candidate(config).estimate, compiled.candidate(config).estimate
    # the matmuls at the compiled efficiency; memory-bound traffic is charged as eager (the fit absorbed fusion)
    assert float(e.time["compute"]) * H100_500W_EFFICIENCY / H100_500W_COMPILED_EFFICIENCY \
        < float(c.time["compute"]) < float(e.time["compute"])
    assert compiled.best.step_time < eager.candidate(config).step_time
    assert compiled.best.parallelism.compile and not eager.best.parallelism.compile
    assert "compiled (inductor)" in str(compiled) and "compiled (inductor)" not in str(eager)
    assert json.loads(compiled.to_json())["compiled"] is True


def test_parallelize_runs_a_compiled_candidate_compiled(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    ids = torch.zeros(4, 16, dtype=torch.long)
    model = models.llama(layers=2, d=32, dtype=torch.float32)
    chosen = auto_choice(model, "auto", example_inputs=(ids,), example_kwargs=None, optimizer=None, compile=True)
    assert chosen.parallelism.compile
    pm = parallelize(model, chosen.parallelism, loss_fn=models.lm_loss, example_inputs=(ids,), example_target=ids)
    assert pm.options.compile and pm.plan.compiled is not None


def test_the_cli_plans_compiled_steps(capsys) -> None:
    assert main(["plan", "autopar.planner:gpt(2, 64, 4)", "--devices", "4", "--cluster", "dgx-a100", "--seq", "32",
                 "--compile", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["compiled"] is True
