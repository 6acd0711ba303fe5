"""The plan is data: placements, pipeline, collectives, memory and the tp layer are values; its text is
rendered from them, the same text as before the plan became data (tests/data/plan_text.json)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import models
from autopar import Mesh, parallelize
from autopar.core.plan import CollectiveRow, FlatShard, MatmulRow, ZeroShard

IDS = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(2))
EXPECTED = json.loads((Path(__file__).parent / "data" / "plan_text.json").read_text())
CASES = {
    "gpt2_tp2": lambda: parallelize(models.gpt2(layers=2), Mesh(tp=2), example_inputs=(IDS,), example_target=TARGET,
                                    loss_fn=models.lm_loss, optimizer=models.adamw),
    "llama_pp2_mb2": lambda: parallelize(models.llama(layers=2), Mesh(pp=2), example_inputs=(IDS,),
                                         example_target=TARGET, loss_fn=models.lm_loss, optimizer=models.adamw,
                                         microbatches=2),
    "gpt2_dp2_zero3": lambda: parallelize(models.gpt2(), Mesh(dp=2), example_inputs=(IDS,), example_target=TARGET,
                                          loss_fn=models.lm_loss, optimizer=models.adamw, zero=3),
    "gpt2_dp2pp2tp2": lambda: parallelize(models.gpt2(layers=4), Mesh(dp=2, pp=2, tp=2), example_inputs=(IDS,),
                                          example_target=TARGET, loss_fn=models.lm_loss, optimizer=models.adamw,
                                          microbatches=2),
}
_plans: dict = {}


def _plan(name: str):
    if name not in _plans:
        _plans[name] = CASES[name]().plan
    return _plans[name]


@pytest.mark.parametrize("name", list(CASES))
def test_plan_text_is_unchanged(name: str) -> None:
    plan = _plan(name)
    assert str(plan) == EXPECTED[name]["full"]
    assert plan.summary() == EXPECTED[name]["summary"]


def test_tp_plan_holds_placements_layer_and_directions() -> None:
    plan = _plan("gpt2_tp2")
    by_name = {p.name: p for p in plan.params}
    assert by_name["transformer.wte.weight"].placements == (Shard(0),)
    assert by_name["transformer.h.0.ln_1.weight"].placement("tp") == Replicate()
    assert by_name["transformer.h.0.attn.c_attn.bias"].interleave == 3
    assert plan.tensor_parallel.block == "transformer.h.0"
    assert MatmulRow("attn.c_proj", "addmm", "row-parallel") in plan.tensor_parallel.rows
    assert any(isinstance(r, CollectiveRow) and r.op == "all_reduce" for r in plan.tensor_parallel.rows)
    assert plan.tensor_parallel.inside == ("aten.cross_entropy_loss.default",)
    assert {(c.axis, c.direction, c.op) for c in plan.collectives} == {("tp", "forward", "all_reduce"),
                                                                      ("tp", "backward", "all_reduce")}
    assert plan.local_batch == (8, 8) and plan.tied == {"lm_head.weight": "transformer.wte.weight"}


def test_pipeline_plan_is_stages_and_cuts() -> None:
    pipeline = _plan("llama_pp2_mb2").pipeline
    assert pipeline.cuts == ("model.layers.1",) and pipeline.microbatches == 2
    assert pipeline.bubble == pytest.approx(1 / 3)
    assert [(st.index, st.rank, st.params) for st in pipeline.stages] == [(0, 0, 10), (1, 1, 11)]
    assert _plan("gpt2_dp2pp2tp2").pipeline.shared == (("transformer.wte.weight", (0, 1)),)


def test_zero_plan_holds_flat_shards_and_the_estimate() -> None:
    plan = _plan("gpt2_dp2_zero3")
    wte = plan.params[0]
    assert wte.placement("dp") == FlatShard() and wte.zero == ZeroShard(3, "transformer.wte")
    assert list(plan.memory) == ["parameters", "gradients", "optimizer", "gathered"]
    assert plan.memory.largest_on is None and _plan("gpt2_dp2pp2tp2").memory.largest_on == 0
    assert {c.op for c in plan.collectives if c.axis == "dp"} == {"all_gather", "reduce_scatter"}
