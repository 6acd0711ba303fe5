"""compile=True: each rank's graphs through inductor, equal to one device's eager training.

Float64 models that compute in float64 throughout compare within 1e-12 (inductor reorders float64 sums only);
Hugging Face's LLaMA casts its norms and rotary angles to float32, where inductor's fused kernels round otherwise
than eager's: it is compared at the bound derived in docs/decisions.md ("Compiled rank graphs"), and
``models.llama_exact`` (the same model in float64 throughout) within 1e-12.
"""
from __future__ import annotations

import operator
from collections import Counter

import pytest
import torch

import models
from autopar import Mesh, parallelize
from autopar.core.errors import UnsupportedError
from autopar.core.inductor import Inductor
from autopar.testing import Report, assert_equivalent
from harness.exactness import IDS, TARGET
from harness.mixed import assert_mixed

FLOAT32_INSIDE = 1e-4  # relative update error where the model computes in float32 (docs/decisions.md)


def _equivalent(make, mesh: Mesh, launcher, bound: float = 1e-12, close: float = 1e-9, **options: object) -> Report:
    """``bound``: on the relative error of updates, losses and outputs; ``close``: on each element."""
    report: list[Report] = []
    assert_equivalent(make, mesh, (IDS,), TARGET, models.lm_loss, models.adamw, steps=2, rtol=close, atol=close,
                      update_rtol=bound, report=report, launcher=launcher, compile=True, **options)
    assert all(r.update_error <= bound for r in report), report
    return report[0]


def _outside(gm: torch.fx.GraphModule) -> list[str]:
    """The ops of ``gm`` that are not pure ATen computation (collectives, ZeRO's, local replacements), in order."""
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"
            and not str(n.target).startswith("aten.") and n.target is not operator.getitem]


def _compiled(make, mesh: Mesh, **options: object):
    return parallelize(make(), mesh, example_inputs=(IDS,), example_target=TARGET, loss_fn=models.lm_loss,
                       optimizer=models.adamw, compile=True, **options)


def test_regions_hold_each_layer_with_its_collectives_and_leave_the_rest_in_order() -> None:
    eager = parallelize(models.llama(), Mesh(tp=2), example_inputs=(IDS,), example_target=TARGET,
                        loss_fn=models.lm_loss, optimizer=models.adamw)
    pm = _compiled(models.llama, Mesh(tp=2))
    gm = pm.graph(0)
    regions = [m for m in gm.modules() if isinstance(m, Inductor)]
    assert len(regions) >= 4
    inside = Counter(op for r in regions for op in _outside(r.region))
    # the layers' 4 and 4 + the final norm's (the vocab-parallel embedding's sum of a value computed outside stays)
    assert inside == {"autopar.all_reduce.default": 4, "autopar.grad_all_reduce.default": 5}
    left = _outside(eager.graph(0))
    for op in inside.elements():
        left.remove(op)
    assert _outside(gm) == left  # every other collective outside, in the eager graph's order
    layers = [r for r in regions if any("layers." in s for s in r.sources)]
    assert len(layers) == 2 and layers[0].key == layers[1].key  # one region a layer, the layers' alike
    assert layers[0].axes == ("tp",) and len(layers[0].tally.forward) == len(layers[0].tally.backward) == 2
    inside = next(line for line in str(pm.plan).splitlines() if "functional collectives" in line)
    assert "grad_all_reduce.default x5" in inside and " all_reduce.default x4" in inside
    assert pm.plan.compiled.distinct < pm.plan.compiled.regions  # identical layers: one structure


def test_zero3_frees_a_layer_after_its_region_so_its_last_ops_join_it() -> None:
    """Under ZeRO-3 a layer's free waits for the next side effect: no ATen op runs eagerly between a layer's free
    and the next gather, and the graph still frees every gathered layer once, before the next layer's gather."""
    pm = _compiled(models.llama, Mesh(dp=2), zero=3)
    gm = pm.graph(0)
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_module")
             and n.target is not operator.getitem and "_assert_tensor_metadata" not in str(n.target)]
    names = [str(n.target) for n in calls]
    frees = [i for i, name in enumerate(names) if name == "autopar.zero_free.default"]
    assert len(frees) == names.count("autopar.zero_all_gather.default") >= 3
    for i in frees:
        assert names[i + 1].startswith("autopar.zero_"), names[i: i + 3]  # (a gather, a free, the run's end)
    gathers = [i for i, name in enumerate(names) if name == "autopar.zero_all_gather.default"]
    assert all(g < f < (gathers + [len(names)])[k + 1] for k, (g, f) in enumerate(zip(gathers, frees)))


def _tp_traffic(compile: bool, options: dict) -> tuple[dict, dict, int]:
    """Two LLaMA steps at tp=2: collectives counted (calls, bytes) and how many ran as autopar's eager ops."""
    from autopar.core import collectives

    ran = [0]
    eager = {name: getattr(collectives, name) for name in ("_all_reduce", "_all_gather", "_reduce_scatter")}

    def counted(fn):
        def run(*args: object) -> torch.Tensor:
            ran[0] += 1
            return fn(*args)
        return run

    for name, fn in eager.items():
        setattr(collectives, name, counted(fn))
    try:
        pm = parallelize(models.llama_exact(), Mesh(tp=2), loss_fn=models.lm_loss, optimizer=models.adamw,
                         compile=compile, **options)
        pm.step(IDS, target=TARGET)
        pm.step(IDS, target=TARGET)
    finally:
        for name, fn in eager.items():
            setattr(collectives, name, fn)
    return pm.communication(calls=True), pm.communication(), ran[0]


@pytest.mark.parametrize("options, inside", [
    # 2 layers x (2 forward + 2 backward all-reduces), the final norm's backward one, the embedding's all-gather
    ({}, 2 * 4 + 1 + 1),
    # each layer's 2 reduce-scatters (their backward all-gathers too) and the norms' 5 backward all-reduces
    pytest.param({"sequence_parallel": True}, 2 * 2 * 2 + 5, marks=pytest.mark.slow),
], ids=["tp2", "tp2-sp"])
def test_compiled_regions_run_tps_collectives_as_functional_collectives_and_count_them(launcher, options: dict,
                                                                                       inside: int) -> None:
    """Two steps with ``inside`` collectives a step inside the regions: run by the compiled code (not autopar's
    eager ops), and counted in ``pm.communication()`` as the eager run counts them."""
    eager = launcher(_tp_traffic, 2, False, options)
    compiled = launcher(_tp_traffic, 2, True, options)
    for (calls, sent, ran), (calls_c, sent_c, ran_c) in zip(eager, compiled):
        assert (calls_c, sent_c) == (calls, sent)
        assert ran - ran_c == 2 * inside


def test_recomputed_layers_are_outlined_inside() -> None:
    from autopar.core.recompute_modes import Recompute

    pm = _compiled(models.llama_exact, Mesh(dp=2), recompute="full")
    recomputed = [m for m in pm.graph(0).modules() if isinstance(m, Recompute)]
    assert len(recomputed) == 2  # (both layers)
    assert all(any(isinstance(m, Inductor) for m in r.region.modules()) for r in recomputed)


@pytest.mark.parametrize("make, mesh, options", [
    (models.llama_exact, Mesh(tp=2), {}),
    (models.llama_exact, Mesh(dp=2), {"zero": 3}),
    (models.gpt2, Mesh(pp=2), {"schedule": "zb-h1", "microbatches": 2}),
    pytest.param(models.gpt2, Mesh(dp=2), {}, marks=pytest.mark.slow),
    pytest.param(models.llama_exact, Mesh(cp=2), {}, marks=pytest.mark.slow),
    pytest.param(models.factory(models.mixtral_exact, aux=False), Mesh(dp=2, ep=2), {}, marks=pytest.mark.slow),
    pytest.param(models.llama_exact, Mesh(tp=2), {"sequence_parallel": True}, marks=pytest.mark.slow),
    pytest.param(models.llama_exact, Mesh(dp=2), {"recompute": "selective"}, marks=pytest.mark.slow),
    pytest.param(models.llama_exact, Mesh(dp=2), {"recompute": "full", "zero": 3}, marks=pytest.mark.slow),
], ids=["llama-tp2", "llama-zero3", "gpt2-pp2-zbh1", "gpt2-dp2", "llama-cp2", "mixtral-ep2", "llama-tp2-sp",
        "llama-selective", "llama-full-zero3"])
def test_compiled_training_is_exact(launcher, make, mesh: Mesh, options: dict) -> None:
    _equivalent(models.factory(make), mesh, launcher, **options)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, options", [
    (Mesh(dp=2), {"zero": 1}), (Mesh(dp=2), {"zero": 2}), (Mesh(dp=(2, 2)), {"zero": 3}),
    (Mesh(pp=2), {"schedule": "interleaved-1f1b", "microbatches": 2}),
    (Mesh(pp=2), {"schedule": "zbv", "microbatches": 4}), (Mesh(pp=2), {"schedule": "dualpipev", "microbatches": 4}),
    (Mesh(dp=2, pp=2, tp=2), {"zero": 1, "microbatches": 2}),
], ids=["zero1", "zero2", "hybrid-zero3", "interleaved", "zbv", "dualpipev", "3d-zero1"])
def test_compiled_training_composes(launcher, mesh: Mesh, options: dict) -> None:
    _equivalent(models.factory(models.llama_exact, layers=4), mesh, launcher, **options)


@pytest.mark.parametrize("precision", ["bf16", pytest.param("mixed", marks=pytest.mark.slow)])
def test_compiled_mixed_precision(launcher, precision: str) -> None:
    """bf16 compute with float32 masters, compiled: each parameter's update within the bounds of the eager
    mixed-precision reference (``harness.mixed``: SGD, so that a gradient off by a factor shows)."""
    ids = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(2))
    assert_mixed(models.factory(models.gpt2, dtype=torch.float32), Mesh(dp=2), (ids,), target, models.lm_loss,
                 models.sgd, 3, launcher, precision, compile=True)


def test_llama_with_float32_norms_is_within_the_derived_bound(launcher) -> None:
    report = _equivalent(models.factory(models.llama), Mesh(dp=2), launcher, bound=FLOAT32_INSIDE, close=1e-3)
    assert report.update_error > 1e-12  # (the float32 inside rounds otherwise: the bound is not vacuous)


def test_a_region_inductor_cannot_compile_names_its_source_and_the_fix(monkeypatch) -> None:
    import torch._inductor.compile_fx as compile_fx_module

    def refuse(gm, example_inputs, **kw):
        raise NotImplementedError("no lowering for aten.rsqrt.default")

    monkeypatch.setattr(compile_fx_module, "compile_fx", refuse)
    pm = _compiled(models.llama_exact, Mesh(dp=2))  # (a layer's region without collectives: it runs unbound)
    region = next(m for m in pm.graph(0).modules() if isinstance(m, Inductor) and any("layers.0" in s for s in m.sources))
    args = [torch.zeros(n.meta["val"].shape, dtype=n.meta["val"].dtype)
            for n in region.region.graph.nodes if n.op == "placeholder"]
    with pytest.raises(UnsupportedError, match=r"rsqrt.*layers\.0.*compile=False"):
        region(*args)


def test_compile_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="compile='yes' must be True"):
        parallelize(models.llama(), Mesh(dp=2), compile="yes")


def test_the_compiled_step_runs_torchs_fused_optimizer_kernel_where_the_user_left_it_unset() -> None:
    from autopar.runtime.master import fused_steps

    class Mine(torch.optim.AdamW):
        pass

    def made(factory) -> list:
        return [g.get("fused") for g in fused_steps(factory)([torch.nn.Parameter(torch.ones(3))]).param_groups]

    assert made(models.adamw) == [True] and made(models.sgd) == [True]
    assert made(lambda ps: torch.optim.AdamW(ps, foreach=False)) == [None]  # the user's choice stays
    assert made(lambda ps: torch.optim.AdamW(ps, fused=False)) == [False]
    assert made(lambda ps: Mine(ps)) == [None] and made(lambda ps: torch.optim.RMSprop(ps)) == [None]
    torch.manual_seed(0)
    start = [torch.randn(5, 4, dtype=torch.float64) for _ in range(3)]
    stepped = []
    for factory in (models.adamw, fused_steps(models.adamw)):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = factory(params)
        for i in range(3):
            for j, p in enumerate(params):
                p.grad = torch.sin(p.detach() * (i + j + 1))
            opt.step()
        stepped.append(params)
    assert max(float((a - b).detach().abs().max()) for a, b in zip(*stepped)) < 1e-15


def _compiled_in(cache: str, mesh: Mesh, options: dict) -> dict[str, int]:
    """One step compiled into inductor's cache folder ``cache``, this process's own compiled regions set aside
    (a worker may have compiled them for another test): how often inductor's FX graph cache missed and hit."""
    import os

    from torch._dynamo.utils import counters

    from autopar.core.inductor import COMPILED

    kept, COMPILED.functions = COMPILED.functions, {}
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    counters.clear()
    try:
        pm = _compiled(models.llama, mesh, **options)
        pm.step(IDS, target=TARGET)
        return {k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("miss", "hit", "bypass")}
    finally:
        COMPILED.functions = kept
        if before is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


@pytest.mark.parametrize("mesh, options", [(Mesh(dp=2), {}), pytest.param(Mesh(tp=2), {}, marks=pytest.mark.slow)],
                         ids=["dp2", "tp2"])
def test_the_ranks_of_a_machine_compile_an_equal_region_once_and_load_it_from_inductors_cache(
        launcher, tmp_path, mesh: Mesh, options: dict) -> None:
    """Inductor's FX graph cache serves compiled regions (no bypass: they compile under a tracing context with a
    shape environment), and the ranks compiling an equal region take turns: on an empty cache one rank compiles
    each region (a miss) and the other loads it (a hit). A later job loads every region."""
    first = launcher(_compiled_in, 2, str(tmp_path), mesh, options)
    assert all(r["bypass"] == 0 for r in first), first
    compiled = first[0]["miss"] + first[0]["hit"]
    assert compiled > 0 and all(r["miss"] + r["hit"] == compiled for r in first)
    assert sum(r["miss"] for r in first) == sum(r["hit"] for r in first) == compiled, first
    again = launcher(_compiled_in, 2, str(tmp_path), mesh, options)
    assert again == [{"miss": 0, "hit": compiled, "bypass": 0}] * 2
