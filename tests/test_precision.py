"""precision="bf16": fp32 masters, bf16 compute, as FSDP2's MixedPrecisionPolicy(bf16, reduce_dtype=fp32).

Numerics: the parallel run equals ``MixedPrecisionReference`` (the policy as a plain eager loop) within
bf16 rounding (``autopar.testing.MixedBounds`` states the bounds and why) on GPT-2, LLaMA and BERT over
dp, tp, pp, ZeRO 1-3 and a dp x pp x tp mesh; 50 steps of a small GPT stay within 3% of the fp32 loss.
Structure: parameters are fp32 placeholders cast once to bf16; tp collectives, pipeline hops and ZeRO-3
gathers carry bf16 (half the bytes, counted at run time); the loss is fp32; the plan shows it all.
Bad input is refused with the option and the fix. ``tests/test_precision_memory.py``: memory.
"""
from __future__ import annotations

import pytest
import torch

import models
from autopar import Mesh, parallelize
from autopar.core.plan import dtype_name
from autopar.passes.mixed_precision import CAST, COMPUTE
from autopar.precision import check_model, policy
from autopar.testing import MIXED, mixed_errors, parallel_run, reference_run
from harness.mixed import assert_mixed
from harness.probe import saved_tensors, sent_bytes

IDS = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(2))
FP32 = torch.float32
COLLECTIVES = ("all_reduce", "grad_all_reduce", "all_gather", "reduce_scatter", "all_to_all", "zero_all_gather")


def _model(name: str, **kw: object) -> object:
    return models.factory(getattr(models, name), dtype=FP32, **kw)


def _compiled(name: str, mesh: Mesh, **options: object):
    return parallelize(_model(name)(), mesh, example_inputs=(IDS,), example_target=TARGET, loss_fn=models.lm_loss,
                       optimizer=models.adamw, precision="bf16", **options)


# --- numerics -----------------------------------------------------------------------------------------------
# SGD, so that a gradient off by a constant factor shows (AdamW normalises it away), each parameter bounded on its
# own (``harness.mixed``); AdamW in the reduce_dtype="bf16" cases under -m slow
DEFAULT_CASES = [("gpt2", dict(pp=2, tp=2), dict(microbatches=2), models.sgd),
                 ("llama", dict(dp=2), dict(zero=3), models.sgd)]
SLOW_CASES = [(name, mesh, opts, models.sgd)
              for name in ("gpt2", "llama", "bert")
              for mesh, opts in [(dict(dp=2), {}), (dict(tp=2), {}), (dict(pp=2), dict(microbatches=2)),
                                 (dict(dp=2), dict(zero=1)), (dict(dp=2), dict(zero=2)), (dict(dp=2), dict(zero=3)),
                                 (dict(dp=2, pp=2, tp=2), dict(microbatches=2, zero=3))]]
SLOW_CASES += [("gpt2", dict(dp=2), dict(zero=stage, reduce_dtype="bf16"), optimizer)
               for stage in (0, 1, 2, 3) for optimizer in (models.sgd, models.adamw)]
SLOW_CASES += [("gpt2", dict(dp=(2, 2)), dict(zero=stage), models.sgd) for stage in (1, 2, 3)]  # hybrid sharding


@pytest.mark.parametrize("name, mesh, options, optimizer", DEFAULT_CASES)
def test_bf16_matches_the_mixed_precision_reference(launcher, name: str, mesh: dict, options: dict,
                                                    optimizer: object) -> None:
    assert_mixed(_model(name), Mesh(**mesh), (IDS,), TARGET, models.lm_loss, optimizer, 3, launcher, "bf16",
                 **options)


@pytest.mark.slow
@pytest.mark.parametrize("name, mesh, options, optimizer", SLOW_CASES)
def test_bf16_matches_the_reference_on_every_mesh_and_stage(launcher, name: str, mesh: dict, options: dict,
                                                            optimizer: object) -> None:
    assert_mixed(_model(name), Mesh(**mesh), (IDS,), TARGET, models.lm_loss, optimizer, 3, launcher, "bf16",
                 **options)


def test_the_first_loss_is_the_bf16_computation_not_the_fp32_one(launcher) -> None:
    """Before any update the forward is the same bf16 arithmetic as the reference's (here 5e-8 apart); fp32
    arithmetic is 2e-5 away: nothing silently computes in fp32."""
    runs = parallel_run(_model("gpt2"), Mesh(dp=2), (IDS,), TARGET, models.lm_loss, models.sgd, 1, launcher=launcher,
                        precision="bf16", zero=2)
    bf16 = reference_run(_model("gpt2"), (IDS,), TARGET, models.lm_loss, models.sgd, 1, precision="bf16")
    fp32 = reference_run(_model("gpt2"), (IDS,), TARGET, models.lm_loss, models.sgd, 1)
    got = runs[0].losses[0]
    assert got == pytest.approx(bf16.losses[0], rel=1e-6)
    assert got != pytest.approx(fp32.losses[0], rel=5e-6)
    assert mixed_errors(bf16, runs[0])["update"] < MIXED.update


def _loss_curves(steps: int) -> dict[str, list[float]]:
    ids = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(3))
    out = {}
    for precision in ("fp32", "bf16"):
        pm = parallelize(models.gpt2(layers=2, d=64, dtype=FP32), Mesh(dp=2), loss_fn=models.lm_loss,
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3), precision=precision)
        out[precision] = [pm.step(ids, target=ids) for _ in range(steps)]
    return out


def test_fifty_steps_stay_within_three_percent_of_the_fp32_loss(launcher) -> None:
    """A small GPT-2 (2 layers, width 64, dp=2, AdamW) learning a fixed batch: the loss falls from 3.9 to
    0.035, and at every step bf16's loss is within 3% of fp32's (measured: at most 1.4%)."""
    curves = launcher(_loss_curves, 2, 50)[0]
    fp32, bf16 = curves["fp32"], curves["bf16"]
    assert fp32[-1] < 0.05 * fp32[0]  # it learns
    for step, (a, b) in enumerate(zip(fp32, bf16)):
        assert abs(a - b) <= 0.03 * a, (step, a, b)


# --- structure -----------------------------------------------------------------------------------------------
def test_parameters_are_fp32_placeholders_cast_once_to_bf16() -> None:
    pm = _compiled("llama", Mesh(dp=2))
    gm = pm.graph(0)
    params = [nd for nd in gm.graph.nodes if nd.op == "placeholder" and nd.name.startswith("p_")]
    assert params and all(nd.meta["val"].dtype == FP32 and nd.meta[COMPUTE] == torch.bfloat16 for nd in params)
    for nd in params:
        (cast,) = nd.users
        assert CAST in cast.meta and cast.kwargs["dtype"] == torch.bfloat16
    # the model's own dtype logic runs as captured in bf16: RMSNorm's float32 region and back
    casts = [nd.kwargs.get("dtype", nd.args[1] if len(nd.args) > 1 else None)
             for nd in gm.graph.nodes if nd.target == torch.ops.aten.to.dtype]
    assert FP32 in casts and torch.bfloat16 in casts
    loss = next(nd for nd in gm.graph.nodes if nd.op == "output").args[0][-1]
    assert loss.meta["val"].dtype == FP32
    text = str(pm.plan)
    assert "precision: bf16 compute" in text and "fp32, computed in bf16" in text
    assert "all_reduce     on dp: 1 x, 0.09 MiB total in fp32" in text


def test_tp_collectives_and_pipeline_hops_are_bf16_with_the_fp32_plan() -> None:
    """The tp solver sees the bf16 graph, so sums over ranks are not charged as narrower than the parameters:
    the placements are the fp32 plan's (Megatron's), and the plan's tp bytes are half of fp32's."""
    pm = _compiled("gpt2", Mesh(pp=2, tp=2), microbatches=2)
    pm32 = parallelize(_model("gpt2")(), Mesh(pp=2, tp=2), example_inputs=(IDS,), example_target=TARGET,
                       loss_fn=models.lm_loss, optimizer=models.adamw, microbatches=2)
    assert [p.placements for p in pm.plan.params] == [p.placements for p in pm32.plan.params]
    for rank in range(4):
        nodes = [nd for nd in pm.graph(rank).graph.nodes
                 if getattr(nd.target, "namespace", None) == "autopar" and nd.target._opname in COLLECTIVES]
        assert nodes and {nd.meta["val"].dtype for nd in nodes} == {torch.bfloat16}, rank
    program = pm.compile((IDS,), target=TARGET)
    assert {b.dtype for st in program.pipeline_stages for b in st.send} == {torch.bfloat16}
    assert [sp.dtypes for sp in pm.plan.pipeline.stages][0] and "sends 1 tensors (bf16," in str(pm.plan)
    bf16 = {(c.direction, c.op): c.bytes for c in pm.plan.collectives if c.axis == "tp"}
    fp32 = {(c.direction, c.op): c.bytes for c in pm32.plan.collectives if c.axis == "tp"}
    assert bf16 and {k: 2 * v for k, v in bf16.items()} == fp32
    assert all(c.dtypes == (torch.bfloat16,) for c in pm.plan.collectives if c.axis == "tp")


def _run_time_dtypes(mesh: Mesh) -> dict[str, dict]:
    out = {}
    for precision in ("fp32", "bf16"):
        pm = parallelize(models.gpt2(dtype=FP32), mesh, loss_fn=models.lm_loss, optimizer=models.sgd,
                         precision=precision, microbatches=2, example_inputs=(IDS,), example_target=TARGET)
        with sent_bytes() as sent, saved_tensors() as saved:
            loss = pm.step(IDS, target=TARGET)
        out[precision] = {"loss": loss, "tp": sum(v for k, v in pm.communication().items() if k.endswith("@tp")),
                          "hops": dict(sent), "saved": saved.floating(), "saved_bf16": saved.bytes(torch.bfloat16)}
    return out


@pytest.mark.parametrize("mesh", [Mesh(tp=2), Mesh(pp=2)], ids=["tp2", "pp2"])
def test_tp_collectives_pipeline_hops_and_activations_are_bf16_at_run_time(launcher, mesh: Mesh) -> None:
    """Measured in a step (GPT-2, two microbatches), fp32 against bf16 on each rank: the tp collectives move
    half the bytes (the loss's per-token sums over the vocabulary shards stay fp32: at most 51% measured),
    every pipeline hop sends bf16 and half the bytes, the floating tensors saved for backward are bf16 (at
    least 79% of their bytes measured; the rest is the fp32 loss), and the first loss is bf16's arithmetic:
    4e-5 off fp32's, where an fp32 run is 1e-7 off one device."""
    for rank, run in enumerate(launcher(_run_time_dtypes, mesh.size, mesh)):
        a, b = run["fp32"], run["bf16"]
        if mesh.tp > 1:
            assert 0 < b["tp"] <= 0.52 * a["tp"], (rank, a, b)
        if mesh.pp > 1:
            assert set(a["hops"]) == {FP32} and b["hops"] == {torch.bfloat16: a["hops"][FP32] // 2}, (rank, a, b)
        assert a["saved_bf16"] == 0 and b["saved_bf16"] >= 0.75 * b["saved"], (rank, a, b)
        assert abs(b["loss"] - a["loss"]) > 5e-6 * a["loss"], (rank, a, b)


def test_zero3_gathers_bf16_and_the_casts_are_gone() -> None:
    pm = _compiled("gpt2", Mesh(dp=2), zero=3)
    gm = pm.graph(1)
    gathers = [nd for nd in gm.graph.nodes if nd.target == torch.ops.autopar.zero_all_gather.default]
    assert gathers and all(nd.kwargs["dtype"] == torch.bfloat16 for nd in gathers)
    assert not [nd for nd in gm.graph.nodes if CAST in nd.meta]  # the views of the bf16 buffer are used as they are
    dp = {c.op: c for c in pm.plan.collectives if c.axis == "dp"}
    assert dp["all_gather"].dtypes == (torch.bfloat16,) and dp["reduce_scatter"].dtypes == (FP32,)
    assert dp["all_gather"].bytes == dp["reduce_scatter"].bytes  # twice per layer in bf16 = once in fp32
    assert "all_gather     on dp: 10 x, 0.12 MiB total in bf16" in str(pm.plan)


def _communication(options: dict) -> dict[str, int]:
    pm = parallelize(models.gpt2(dtype=FP32), Mesh(dp=2), loss_fn=models.lm_loss, optimizer=models.adamw, zero=3,
                     **options)
    pm.step(IDS, target=TARGET)
    return pm.communication()


def test_zero3_moves_half_the_bytes_in_its_gathers(launcher) -> None:
    """Counted at run time: bf16 gathers move half of fp32's bytes; the reduce-scatters move fp32, or bf16
    with reduce_dtype="bf16"."""
    fp32, bf16, both = (launcher(_communication, 2, options)[0] for options in
                        ({}, dict(precision="bf16"), dict(precision="bf16", reduce_dtype="bf16")))
    gather, scatter = "zero_all_gather@dp", "zero_reduce_scatter@dp"
    assert fp32[gather] == 2 * bf16[gather] == 2 * both[gather]
    assert fp32[scatter] == bf16[scatter] == 2 * both[scatter]


def _bucket_dtypes(reduce_dtype: str | None, mesh: Mesh = Mesh(dp=2)) -> tuple[set, set]:
    pm = parallelize(models.gpt2(dtype=FP32), mesh, loss_fn=models.lm_loss, optimizer=models.sgd,
                     precision="bf16", reduce_dtype=reduce_dtype, example_inputs=(IDS,), example_target=TARGET,
                     microbatches=2 if mesh.pp > 1 else 1)
    grads = []
    pm.optimizer.register_step_pre_hook(lambda opt, *_: grads.extend(p.grad.dtype for p in pm.parameters()))
    pm.step(IDS, target=TARGET)
    return {b.flat.dtype for b in pm.runtime.grad_sync.buckets}, set(grads)


def test_dp_buckets_reduce_in_reduce_dtype_into_fp32_gradients(launcher) -> None:
    assert launcher(_bucket_dtypes, 2, None)[0] == ({FP32}, {FP32})
    assert launcher(_bucket_dtypes, 2, "bf16")[0] == ({torch.bfloat16}, {FP32})


def test_dp_buckets_reduce_in_reduce_dtype_on_every_pipeline_rank(launcher) -> None:
    """dp=2 x pp=2: each pipeline rank's dp buckets are bf16 too, its optimizer reading fp32 gradients."""
    assert launcher(_bucket_dtypes, 4, "bf16", Mesh(dp=2, pp=2)) == [({torch.bfloat16}, {FP32})] * 4


# --- options and bad input ----------------------------------------------------------------------------------
def test_fp16_asks_for_bf16_and_a_loss_scaler() -> None:
    with pytest.raises(ValueError, match="precision='fp16' needs a loss scaler.*use precision='bf16'"):
        parallelize(models.gpt2(dtype=FP32), Mesh(dp=2), precision="fp16")
    with pytest.raises(ValueError, match="precision='fp8' must be one of"):
        parallelize(models.gpt2(dtype=FP32), Mesh(dp=2), precision="fp8")
    with pytest.raises(ValueError, match="reduce_dtype='bf16' applies to precision='bf16'"):
        parallelize(models.gpt2(dtype=FP32), Mesh(dp=2), reduce_dtype="bf16")
    assert policy("bf16", "bf16").reduce == torch.bfloat16 and policy("bf16").reduce == FP32
    assert policy("fp32") is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_bf16_needs_fp32_parameters_to_keep_as_masters(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match=f"keeps fp32 master parameters, but .* is {dtype}; call model.float"):
        parallelize(models.gpt2(dtype=dtype), Mesh(dp=2), precision="bf16")


def test_bf16_on_a_device_without_it_names_the_option_and_the_fix(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    with pytest.raises(ValueError, match=r"precision='bf16' needs bfloat16 support .* Tesla V100 \(compute "
                                         r"capability 7.0\) has none; use precision='fp32'"):
        check_model(models.gpt2(dtype=FP32), policy("bf16"), torch.device("cuda", 0))
    check_model(models.gpt2(dtype=FP32), policy("bf16"), torch.device("cpu"))  # CPUs compute bf16


def test_dtype_names() -> None:
    assert [dtype_name(d) for d in (FP32, torch.bfloat16, torch.float64, torch.int64)] == ["fp32", "bf16", "fp64",
                                                                                            "int64"]


# --- planner ------------------------------------------------------------------------------------------------
def test_the_planner_runs_bf16_plans_and_auto_takes_their_precision() -> None:
    """``PRECISIONS["bf16"]`` is what precision="bf16" runs: every candidate is runnable and hands
    ``parallelize`` precision="bf16"; so does the ZeRO paper's "mixed" layout (persistent bf16 weights and
    gradients, precision="mixed"); a float64 plan for a float32 model is not run, and says why."""
    from autopar.planner import plan

    model = models.gpt2(dtype=FP32)
    bf16 = plan(model, 2, cluster="cpu", global_batch=8, seq_len=8, precision="bf16", optimizer="adam",
                recompute=(False,), zero=(0, 3), schedules=("1f1b",))
    assert all(c.runnable for c in bf16.candidates)
    assert bf16.best.parallelize_options()["precision"] == "bf16"
    mixed = plan(model, 2, cluster="cpu", global_batch=8, seq_len=8, precision="mixed", optimizer="adam",
                 recompute=(False,), zero=(0,), schedules=("1f1b",), profile=bf16.profile)
    assert all(c.runnable for c in mixed.candidates)
    assert mixed.best.parallelize_options()["precision"] == "mixed"
    fp64 = plan(model, 2, cluster="cpu", global_batch=8, seq_len=8, precision="fp64", optimizer="adam",
                recompute=(False,), zero=(0,), schedules=("1f1b",), profile=bf16.profile)
    assert not any(c.runnable for c in fp64.candidates) and "precision='bf16' or 'mixed'" in \
        fp64.candidates[0].not_runnable
    fp32 = plan(model, 2, cluster="cpu", global_batch=8, seq_len=8, precision="fp32", optimizer="adam",
                recompute=(False,), zero=(0,), schedules=("1f1b",), profile=bf16.profile)
    assert fp32.best.parallelize_options()["precision"] == "fp32"


def _auto(precision: str) -> tuple[str, str, float]:
    ids = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(1))
    pm = parallelize(models.gpt2(dtype=FP32), "auto", example_inputs=(ids,), example_target=ids,
                     loss_fn=models.lm_loss, optimizer=models.adamw, precision=precision)
    return pm.options.precision, str(pm.plan.precision), pm.step(ids, target=ids)


@pytest.mark.slow
def test_parallelize_auto_runs_the_plans_precision(launcher) -> None:
    for precision, described, loss in launcher(_auto, 2, "bf16"):
        assert precision == "bf16" and described.startswith("bf16 compute") and loss > 0
    for precision, described, loss in launcher(_auto, 2, "mixed"):
        assert precision == "mixed" and described.startswith("bf16 trainable parameters") and loss > 0
