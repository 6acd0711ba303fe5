"""Activation bytes per microbatch with each recompute mode, measured, against the planner's prediction.

Measured: the bytes of every storage the forward allocated that is still alive when it returns (what autograd,
and recomputation's checkpoints, keep for backward), counted by ``runtime.memory.NewStorages``. Predicted: the
planner's kept activations of the same microbatch (``planner.recompute_cost.kept`` over the profile's segments,
the term the cost model multiplies by the microbatches in flight). Both within 10%; measured on GPT-2 and LLaMA
(RoPE's cos and sin enter every layer, its norms compute in float32).

Where a step's backward follows its forward directly (one rank, one microbatch), ``recompute=`` keeps the last
layer's activations when the simulated peak of the step does not rise; measured on real tensors, the peak with
the layer kept is then at most the peak with it recomputed, and where the simulation refuses it is higher; the
simulated peaks are the measured ones.
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
from autopar.passes.peak_memory import simulated_peak
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
        gm = recompute(program.graph(0), lambda layer: mode).gm  # every layer recomputed with mode
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


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n != "llama" else []) for n in sorted(MODELS)])
def test_activation_bytes_match_the_planners_prediction(name: str) -> None:
    """LLaMA in the default run (rotary, grouped-query attention); the other models under -m slow."""
    model = getattr(models, name)(**MODELS[name])
    predicted = predicted_bytes(model)
    measured = activation_bytes(model)
    for mode in predicted:
        assert measured[mode] == pytest.approx(predicted[mode], rel=0.10), (mode, measured, predicted)
    assert measured["none"] > measured["selective"] > measured["full"]
    assert measured["full"] < measured["none"] / 4  # four layers keep only their inputs


def _measured_peak(model: torch.nn.Module, program: object, gm: object, ids: torch.Tensor) -> int:
    """The most bytes one forward and backward of ``gm`` allocate alive at once, gradients included."""
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    model.zero_grad(set_to_none=True)
    gc.collect()
    with NewStorages() as new:
        program.captured.run(state, [ids, ids], gm).backward()
    return new.peak


@pytest.mark.parametrize("kw, shape, kept", [
    (dict(layers=4, d=64, heads=4), (B, S), True),  # parameters and gradients set the peak
    (dict(layers=2, d=16, heads=2), (16, 64), False),  # activations do: the end of the forward would rise
])
def test_the_last_layer_is_kept_only_where_the_measured_peak_stays(kw: dict, shape: tuple, kept: bool) -> None:
    ids = torch.randint(3, 96, shape, generator=torch.Generator().manual_seed(1))
    model = models.gpt2(**kw)
    make = lambda mode: parallelize(model, Mesh(dp=1), example_inputs=(ids,), example_target=ids,  # noqa: E731
                                    loss_fn=models.lm_loss, recompute=mode).compile((ids,), {}, ids)
    last = f"transformer.h.{kw['layers'] - 1}"
    assert (last in dict(make("full").plan.recompute.skipped)) == kept
    program = make("none")
    grads = [slot.kind == "param" for slot in program.captured.slots]
    peaks, simulated = [], []
    for choice in (lambda layer: "full", lambda layer: "none" if layer == last else "full"):
        gm = recompute(program.graph(0), choice).gm
        peaks.append(_measured_peak(model, program, gm, ids))
        simulated.append(simulated_peak(gm, grads, len(program.captured.mutated_buffers), {"dp": 1}))
    assert (peaks[1] <= peaks[0]) == kept, peaks
    assert simulated == pytest.approx(peaks, rel=0.01)  # the simulation the decision rests on
