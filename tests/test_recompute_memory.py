"""Activation bytes per microbatch with each recompute mode, measured, against the planner's prediction.

Measured: the bytes of every storage the forward allocated that is still alive when it returns (what autograd,
and recomputation's checkpoints, keep for backward), counted by ``runtime.memory.NewStorages``. Predicted: the
planner's kept activations of the same microbatch (``planner.recompute_cost.kept`` over the profile's segments,
the term the cost model multiplies by the microbatches in flight). Both within 10%; measured on GPT-2 and LLaMA
(RoPE's cos and sin enter every layer, its norms compute in float32).
"""
from __future__ import annotations

import gc

import pytest
import torch

import models
from autopar import Mesh, parallelize
from autopar.planner import recompute_cost
from autopar.planner.cluster import Cluster
from autopar.planner.cost_model import Config, CostModel, precision_of
from autopar.planner.model_profile import profile_model
from autopar.planner.search import evaluate
from autopar.passes.recompute import recompute
from autopar.runtime.memory import NewStorages

B, S = 4, 32
IDS = torch.randint(3, 96, (B, S), generator=torch.Generator().manual_seed(1))
MODELS = {"gpt2": dict(layers=4, d=64, heads=4), "llama": dict(layers=4, d=64, heads=4, kv_heads=2)}


def activation_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes the forward of one microbatch leaves alive for its backward, by recompute mode."""
    program = parallelize(model, Mesh(dp=1), example_inputs=(IDS,), example_target=IDS,
                          loss_fn=models.lm_loss).compile((IDS,), {}, IDS)
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    out = {}
    for mode in ("none", "selective", "full"):
        gm = recompute(program.graphs[0], lambda layer: mode).gm  # what recompute=mode compiles to
        gc.collect()
        with NewStorages(track_peak=False) as new:
            loss = program.captured.run(state, [IDS, IDS], gm)
            gc.collect()
            out[mode] = new.live()
        loss.backward()
    return out


def predicted_bytes(model: torch.nn.Module) -> dict[str, float]:
    """The planner's kept bytes per mode; each mode's candidate is one autopar runs, and says how."""
    profile = profile_model(model, example_inputs=(IDS[:2, :16],), tp_sizes=(1,))
    cluster, precision = Cluster.preset("cpu"), precision_of(torch.float64)
    cost = CostModel(profile, cluster, precision, seq_len=S)
    units = [cost.values(seg, 1, B) for seg in profile.sequence()]
    for mode in ("none", "selective", "full"):
        candidate = evaluate(cost, Config(dp=1, microbatch_size=B, recompute=mode), cluster, precision, profile)
        assert candidate.runnable and candidate.parallelize_options()["recompute"] == mode, candidate.not_runnable
    return {mode: float(recompute_cost.kept(mode, units)) for mode in ("none", "selective", "full")}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_activation_bytes_match_the_planners_prediction(name: str) -> None:
    model = getattr(models, name)(**MODELS[name])
    predicted = predicted_bytes(model)
    measured = activation_bytes(model)
    for mode in predicted:
        assert measured[mode] == pytest.approx(predicted[mode], rel=0.10), (mode, measured, predicted)
    assert measured["none"] > measured["selective"] > measured["full"]
    assert measured["full"] < measured["none"] / 4  # four layers keep only their inputs
