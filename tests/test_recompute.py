"""Activation recomputation changes no number: float64 exactness with every mode on every kind of mesh, dropout
replayed; it happens in ``pm.step`` (layers run again in backward, fewer bytes kept); the pass's regions (what
is kept, what is recomputed) and the option's errors."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

import models
from autopar import Mesh, parallelize
from autopar.core.graph import PREFIX
from autopar.core.recompute_modes import Recompute, keeps
from autopar.options import Options
from autopar.passes.recompute import assign_layers, recompute
from autopar.testing import assert_equivalent, parallel_run, relative_errors
from harness.exactness import IDS, TARGET
from harness.probe import StepProbe, probed

MESHES = {
    "dp2": (Mesh(dp=2), {}),
    "tp2": (Mesh(tp=2), {}),
    "pp2": (Mesh(pp=2), {"microbatches": 2}),
    "pp2-interleaved": (Mesh(pp=2), {"microbatches": 2, "schedule": "interleaved-1f1b"}),
    "dp2-zero3": (Mesh(dp=2), {"zero": 3}),
}
CASES = [("gpt2", "dp2", "selective"), ("gpt2", "tp2", "full"), ("bert", "pp2", "selective"),
         ("llama", "pp2-interleaved", "full"), ("llama", "dp2-zero3", "selective")]
NORMS = {"gpt2": "native_layer_norm", "bert": "native_layer_norm", "llama": "rsqrt"}  # run again in backward
OTHER_MODE = [("llama", "dp2", "full"), ("llama", "tp2", "selective"), ("gpt2", "pp2", "full"),
              ("gpt2", "pp2-interleaved", "selective"), ("gpt2", "dp2-zero3", "full")]  # -m slow


def _compiled(mesh: Mesh = Mesh(dp=1), layers: int = 2, **options: object) -> object:
    return parallelize(models.gpt2(layers=layers), mesh, example_inputs=(IDS,), example_target=TARGET,
                       loss_fn=models.lm_loss, optimizer=models.adamw, **options)


# -- equivalence -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, mesh_name, mode",
                         CASES + [pytest.param(*c, marks=pytest.mark.slow) for c in OTHER_MODE])
def test_recomputation_is_exact(launcher, name: str, mesh_name: str, mode: str) -> None:
    """Each mode on dp, tp, pp (1F1B and interleaved) and dp ZeRO-3 (the other mode of each mesh under -m slow):
    float64 updates within 1e-12 of one device, and every rank ran its layers' norms again in backward."""
    mesh, options = MESHES[mesh_name]
    layers = 4 if mesh_name == "pp2-interleaved" else 2
    runs = assert_equivalent(models.factory(getattr(models, name), layers=layers), mesh, (IDS,), TARGET,
                             models.lm_loss, models.adamw, steps=2, rtol=1e-9, atol=1e-10, launcher=probed(launcher),
                             recompute=mode, **options)
    for rank, run in enumerate(runs):
        assert run.probe.recomputed[NORMS[name]] > 0, (rank, run.probe.recomputed)


def _through_step(mesh: Mesh, options: dict) -> dict[str, tuple[dict[str, int], int]]:
    """Per mode, the operators a step ran again in backward and the bytes alive when its backward began."""
    ids = torch.randint(3, 96, (4, 32), generator=torch.Generator().manual_seed(1))
    out = {}
    for mode in ("none", "selective", "full"):
        pm = parallelize(models.gpt2(layers=4, d=64), mesh, loss_fn=models.lm_loss, optimizer=models.sgd,
                         recompute=mode, **options)
        pm.step(ids, target=ids)  # compile; gradients and momentum exist from now on
        with StepProbe(memory=True) as probe:
            pm.step(ids, target=ids)
        out[mode] = (dict(probe.recomputed), probe.at_backward)
    return out


@pytest.mark.parametrize("mesh", [Mesh(pp=2), pytest.param(Mesh(dp=1), marks=pytest.mark.slow)], ids=["pp2", "dp1"])
def test_a_step_recomputes_each_layer_and_keeps_fewer_bytes(launcher, mesh: Mesh) -> None:
    """Through ``pm.step`` (GPT-2, 4 layers, width 64, two microbatches): each layer of the rank runs again in
    backward once per microbatch, its two layer norms and GELU's tanh, and under "full" its attention too;
    the bytes alive when backward begins fall (measured: selective 41-44% of none's, full 11-16% of
    selective's)."""
    for rank, got in enumerate(launcher(_through_step, mesh.size, mesh, {"microbatches": 2})):
        (none, kept_none), (selective, kept_selective), (full, kept_full) = got["none"], got["selective"], got["full"]
        runs = 2 * 4 // mesh.pp  # microbatches x the rank's layers
        assert none == {} and selective == {"native_layer_norm": 2 * runs, "tanh": runs}, (rank, got)
        assert full == {**selective, "_scaled_dot_product_flash_attention_for_cpu": runs}, (rank, got)
        assert kept_selective < 0.6 * kept_none and kept_full < 0.3 * kept_selective, (rank, got)


def test_dropout_masks_are_replayed_exactly(launcher) -> None:
    """With dropout on (embeddings, attention, residuals), recomputation equals one device bit for bit."""
    make = models.factory(models.gpt2, dropout=0.1)
    report: list = []
    for mode in ("full", "selective"):
        runs = assert_equivalent(make, Mesh(dp=1), (IDS,), TARGET, models.lm_loss, models.adamw, steps=2,
                                 rtol=0.0, atol=0.0, launcher=launcher, recompute=mode, report=report)
    assert all(r.update_error == 0.0 for r in report), report
    assert runs[0].losses[0] != pytest.approx(models.loss_without_dropout(make, IDS, TARGET), rel=1e-6)  # it drops


def test_dropout_on_a_pipeline_equals_the_run_without_recomputation(launcher) -> None:
    """Two stages per rank, two microbatches, dropout everywhere: the same numbers as without recomputation, and
    not those of the model without dropout."""
    make = models.factory(models.gpt2, layers=4, dropout=0.1)
    kw = dict(microbatches=2, schedule="interleaved-1f1b")
    base = parallel_run(make, Mesh(pp=2), (IDS,), TARGET, models.lm_loss, models.adamw, 2, launcher=launcher, **kw)
    mixed = {"transformer.h.[02]": "full", "*": "selective"}  # both modes, on both pp ranks
    runs = parallel_run(make, Mesh(pp=2), (IDS,), TARGET, models.lm_loss, models.adamw, 2, launcher=launcher,
                        recompute=mixed, **kw)
    assert relative_errors(base[0], runs[0])[0] == 0.0  # every loss and the output
    assert all(torch.equal(base[0].state[k], runs[0].state[k]) for k in base[0].state)  # every parameter
    assert base[0].losses[0] != pytest.approx(models.loss_without_dropout(make, IDS, TARGET), rel=1e-6)  # it drops


def _communication(mode: str) -> tuple[dict[str, int], dict[str, int]]:
    pm = parallelize(models.llama(), Mesh(tp=2), loss_fn=models.lm_loss, optimizer=models.adamw, recompute=mode)
    with StepProbe() as probe:
        pm.step(IDS, target=TARGET)
    return pm.communication(calls=True), dict(probe.recomputed)


def test_tensor_parallel_collectives_are_not_repeated_in_backward(launcher) -> None:
    """The same tp collectives with each mode, while a layer's RMSNorm did run again in backward."""
    got = {mode: launcher(_communication, 2, mode)[0] for mode in ("none", "selective", "full")}
    calls = {mode: c for mode, (c, _) in got.items()}
    assert calls["none"] == calls["selective"] == calls["full"] and calls["none"], calls
    assert not got["none"][1] and got["selective"][1]["rsqrt"] and got["full"][1]["rsqrt"], got


def _gathers(mode: str, prefetch: int) -> int:
    from autopar.runtime.zero_group import FlatShard

    counted = [0]
    start = FlatShard._start_gather

    def counting(self: FlatShard, *args: object, **kwargs: object) -> object:
        counted[0] += 1
        return start(self, *args, **kwargs)

    FlatShard._start_gather = counting  # every all-gather started, prefetched or not
    try:
        pm = parallelize(models.gpt2(), Mesh(dp=2), loss_fn=models.lm_loss, optimizer=models.adamw, zero=3,
                         zero_prefetch=prefetch, recompute=mode)
        with StepProbe() as probe:
            pm.step(IDS, target=TARGET)
    finally:
        FlatShard._start_gather = start
    return counted[0], probe.recomputed["native_layer_norm"]


@pytest.mark.parametrize("prefetch", [0, 1])
def test_zero3_gathers_each_layer_again_in_backward_once(launcher, prefetch: int) -> None:
    """A recomputed layer's all-gather runs again in backward, where ZeRO-3 would re-gather it anyway: the same
    gathers with each mode (prefetched ones included: none is wasted), while the layers did run again in
    backward."""
    got = {mode: launcher(_gathers, 2, mode, prefetch)[0] for mode in ("none", "full", "selective")}
    assert got["none"][0] == got["full"][0] == got["selective"][0], got
    assert got["none"][1] == 0 < got["full"][1] and got["selective"][1] > 0, got


# -- the pass --------------------------------------------------------------------------------------
def test_layers_become_regions_and_the_rest_stays() -> None:
    gm = _compiled().graph(0)
    layers = sorted(set(assign_layers(gm).values()))
    assert layers == ["transformer.h.0", "transformer.h.1"]
    out = recompute(gm, lambda layer: "full" if layer.endswith("0") else "none")
    assert out.modes == {"transformer.h.0": "full", "transformer.h.1": "none"} and not out.skipped
    calls = [n for n in out.gm.graph.nodes if n.op == "call_module"]
    assert [n.target for n in calls] == ["recompute_transformer_h_0"]
    region = out.gm.get_submodule(calls[0].target)
    assert isinstance(region, Recompute) and region.mode == "full" and not region.policy
    left = {lay for lay in assign_layers(out.gm).values()}
    assert left == {"transformer.h.1"}  # layer 1 runs as before; the embeddings and the loss are no layer
    inputs = [n for n in region.region.graph.nodes if n.op == "placeholder"]
    assert inputs[0].meta["val"].shape == (8, 8, 32)  # the hidden state, then the layer's parameters
    assert all(i.name.startswith("p_model_transformer_h_0") for i in inputs[1:])


class _Kept(TorchDispatchMode):
    """The ops a region dispatches, each with whether ``mode`` keeps its output."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode, self.ops = mode, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops.append((func.__name__, keeps(self.mode, func, args, kwargs or {})))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode, kept", [
    ("full", []),
    ("selective", ["_scaled_dot_product_flash_attention_for_cpu.default", "addmm.default", "addmm.default",
                   "addmm.default", "addmm.default"]),
])
def test_what_each_mode_keeps_and_recomputes(mode: str, kept: list[str]) -> None:
    """Selective keeps the four projections and attention; the norms, GELU and residual adds are recomputed."""
    gm = recompute(_compiled().graph(0), lambda layer: mode).gm
    region = gm.get_submodule("recompute_transformer_h_0").region
    args = [n.meta["val"] for n in region.graph.nodes if n.op == "placeholder"]
    with _Kept(mode) as seen:
        region(*[torch.randn(a.shape, dtype=a.dtype) for a in args])
    assert sorted(op for op, k in seen.ops if k) == kept
    recomputed = {op for op, k in seen.ops if not k}
    assert {"native_layer_norm.default", "tanh.default", "add.Tensor"} <= recomputed


def test_collectives_are_kept_and_local_ops_recomputed() -> None:
    all_reduce, grad_all_reduce = torch.ops.autopar.all_reduce.default, torch.ops.autopar.grad_all_reduce.default
    x = torch.zeros(2)
    for mode in ("full", "selective"):
        assert keeps(mode, all_reduce, (x, "tp"), {}) and not keeps(mode, grad_all_reduce, (x, "tp"), {})
    sdpa = torch.ops.aten._scaled_dot_product_efficient_attention.default
    assert not keeps("selective", sdpa, (x, x, x, None, True, 0.1), {})  # draws random numbers: recomputed
    assert keeps("selective", sdpa, (x, x, x, None, True, 0.0), {})


def test_a_region_with_an_explicit_generator_is_refused() -> None:
    graph, root = fx.Graph(), torch.nn.Module()
    root.gen = torch.Generator()
    x = graph.placeholder("x")
    noise = graph.call_function(torch.ops.aten.bernoulli.p, (x, 0.5), {"generator": graph.get_attr("gen")})
    out = graph.call_function(torch.ops.aten.mul.Tensor, (x, noise))
    for node in (noise, out):
        node.meta["nn_module_stack"] = {"k": (PREFIX + "layers.0", torch.nn.Module)}
    graph.output((out,))
    with pytest.raises(ValueError, match=r"recompute='full' cannot recompute layer 'layers.0'"
                                         r".*\(in layers\.0 \(Module\)\) draws.*explicit torch.Generator"
                                         r".*recompute=\{'layers.0': 'none', '\*': 'full'\}"):
        recompute(fx.GraphModule(root, graph), lambda layer: "full")


def test_the_last_layer_keeps_its_activations_where_its_backward_follows_its_forward() -> None:
    """One rank, one microbatch: the last layer's backward runs right after its forward, and keeping its
    activations leaves the step's simulated peak as it is, so it is not recomputed; the plan says why."""
    pm = _compiled(recompute="full")
    text = pm.plan.summary()
    assert "full on transformer.h.0; none on transformer.h.1" in text
    assert "transformer.h.1 is not recomputed: its backward runs right after its forward" in text
    assert [n.target for n in pm.graph(0).graph.nodes if n.op == "call_module"] == ["recompute_transformer_h_0"]


def test_a_kept_last_layer_is_exact_with_tensor_parallelism(launcher) -> None:
    """tp=2 and one microbatch: the last layer keeps its activations (its tp collectives simulated at their
    shapes) and float64 updates stay within 1e-12 of one device."""
    assert "transformer.h.1 is not recomputed" in _compiled(Mesh(tp=2), recompute="selective").plan.summary()
    assert_equivalent(models.factory(models.gpt2), Mesh(tp=2), (IDS,), TARGET, models.lm_loss, models.adamw,
                      steps=2, rtol=1e-9, atol=1e-10, launcher=launcher, recompute="selective")


@pytest.mark.parametrize("mesh, options", [(Mesh(dp=1), {"microbatches": 2}), (Mesh(dp=2), {}),
                                           (Mesh(dp=2), {"zero": 1}), (Mesh(pp=2), {"microbatches": 1})])
def test_every_layer_recomputes_where_forward_and_backward_are_apart(mesh: Mesh, options: dict) -> None:
    """A second microbatch, dp buckets that hold gradients between steps, or a pipeline: the last layer
    recomputes as asked."""
    text = _compiled(mesh, 4 if mesh.pp > 1 else 2, recompute="full", **options).plan.summary()
    assert "activation recomputation" in text and "none on" not in text and "is not recomputed" not in text, text


# -- the option ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, message", [
    ("fulll", r"recompute='fulll' is not a recompute mode; the modes are 'none', 'selective', 'full'"),
    ({"transformer.h.0": "partial"}, r"recompute\['transformer.h.0'\]='partial' is not a recompute mode"),
    ({0: "full"}, r"recompute has the key 0; keys are layer names"),
    (3, r"recompute=3 \(int\) is not a recompute choice"),
])
def test_bad_choices_name_the_value_and_the_fix(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Options(recompute=value)


def test_a_key_that_names_no_layer_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'transformer.h.9', which matches no layer.*transformer.h.0, "
                                         r"transformer.h.1.*'transformer.h.\*'"):
        _compiled(recompute={"transformer.h.9": "full"})


def test_a_function_must_return_a_mode() -> None:
    with pytest.raises(ValueError, match=r"returned 'yes' for layer 'transformer.h.0'"):
        _compiled(recompute=lambda layer: "yes")


def test_the_plan_says_what_each_stage_recomputes() -> None:
    pm = _compiled(Mesh(pp=2), 4, microbatches=2, schedule="interleaved-1f1b",
                   recompute={"transformer.h.0": "full", "transformer.h.[12]": "selective"})
    text = pm.plan.summary()
    assert "activation recomputation: stage 0: full on transformer.h.0" in text
    assert "stage 1: selective on transformer.h.1" in text and "stage 2: selective on transformer.h.2" in text
    assert "stage 3: none on transformer.h.3" in text
    assert "recompute_transformer_h_0" in pm.graph(0).code
    assert "activation recomputation" not in _compiled().plan.summary()
