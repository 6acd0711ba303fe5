"""ZeRO stages 1-3 over dp equal single-device training; the layout, the stage-3 graph and the errors."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

import models
from autopar import Mesh, parallelize
from autopar.core.buckets import bucket_sizes
from autopar.core.collectives import bind
from autopar.core.optimizers import state_elements
from autopar.core.zero_layout import layer_of, zero_layout
from autopar.options import Options
from autopar.runtime.batch import split_batch
from autopar.runtime.zero import check_optimizer
from autopar.testing import assert_equivalent
from harness.training import scheduled_reference, scheduled_steps

IDS = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(2))
CASES = [(name, zero, dp) for name in ("gpt2", "llama") for zero in (1, 2, 3) for dp in (2, 4)]
DEFAULT = {("gpt2", 1, 2), ("llama", 1, 4), ("llama", 2, 2), ("gpt2", 2, 4), ("gpt2", 3, 2), ("llama", 3, 4)}


@pytest.mark.parametrize("name,zero,dp", [pytest.param(*c, marks=[] if c in DEFAULT else [pytest.mark.slow])
                                          for c in CASES])
def test_hf_models_equal_single_device(launcher, name: str, zero: int, dp: int) -> None:
    """AdamW on every case, SGD with momentum on half of them (all of them under -m slow); each stage and dp
    size with one of the models by default, with the other under -m slow."""
    make = models.factory(getattr(models, name))
    opts = [models.adamw] + ([models.sgd] if (zero + dp // 2) % 2 else [])
    for opt in opts:
        assert_equivalent(make, Mesh(dp=dp), (IDS,), TARGET, models.lm_loss, opt, steps=3, rtol=1e-9, atol=1e-10,
                          launcher=launcher, zero=zero, bucket_mb=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("name,zero,dp", CASES)
def test_hf_models_with_sgd_momentum(launcher, name: str, zero: int, dp: int) -> None:
    make = models.factory(getattr(models, name))
    assert_equivalent(make, Mesh(dp=dp), (IDS,), TARGET, models.lm_loss, models.sgd, steps=3, rtol=1e-9, atol=1e-10,
                      launcher=launcher, zero=zero, bucket_mb=0.02)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_microbatches_accumulate_into_the_shards(launcher, zero: int) -> None:
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randn(12, 4, dtype=torch.float64)
    assert_equivalent(models.factory(models.mlp, widths=(5, 9, 7, 4)), Mesh(dp=2), (x,), y, models.mse, models.adamw,
                      steps=3, rtol=1e-9, atol=1e-11, launcher=launcher, zero=zero, microbatches=3, bucket_mb=1e-4)


@given(
    widths=st.lists(st.integers(1, 12), min_size=2, max_size=5).map(tuple),
    act=st.sampled_from(["tanh", "relu", "gelu"]),
    zero=st.sampled_from([1, 2, 3]),
    dp=st.sampled_from([1, 2, 4]),
    microbatches=st.sampled_from([1, 2]),
    opt=st.sampled_from([models.sgd, models.adamw]),
    bucket_mb=st.sampled_from([1e-4, 25.0]),
    prefetch=st.integers(0, 2),
)
def test_drawn_mlps_equal_single_device(launcher, widths, act, zero, dp, microbatches, opt, bucket_mb,
                                        prefetch) -> None:
    batch = dp * microbatches * 2
    g = torch.Generator().manual_seed(batch + len(widths))
    x = torch.randn(batch, widths[0], dtype=torch.float64, generator=g)
    y = torch.randn(batch, widths[-1], dtype=torch.float64, generator=g)
    assert_equivalent(models.factory(models.mlp, widths=widths, act=act), Mesh(dp=dp), (x,), y, models.mse, opt,
                      steps=3, rtol=1e-9, atol=1e-11, launcher=launcher, zero=zero, microbatches=microbatches,
                      bucket_mb=bucket_mb, zero_prefetch=prefetch)


@given(
    d_heads=st.sampled_from([(8, 2), (12, 3)]),
    layers=st.integers(1, 3),
    zero=st.sampled_from([1, 2, 3]),
    dp=st.sampled_from([2, 4]),
    opt=st.sampled_from([models.sgd, models.adamw]),
)
def test_drawn_transformers_equal_single_device(launcher, d_heads, layers, zero, dp, opt) -> None:
    d, heads = d_heads
    ids = torch.randint(0, 32, (dp, 5), generator=torch.Generator().manual_seed(layers))
    make = models.factory(models.transformer, d=d, heads=heads, layers=layers)
    assert_equivalent(make, Mesh(dp=dp), (ids,), ids, models.lm_loss, opt, steps=3, rtol=1e-9, atol=1e-10,
                      launcher=launcher, zero=zero, bucket_mb=1e-3)


# optimizers ---------------------------------------------------------------------------------------
def _scheduled(zero: int, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    pm = parallelize(models.mlp((6, 8, 3)), Mesh(dp=2), loss_fn=models.mse, optimizer=models.adamw, zero=zero,
                     example_inputs=(x,), example_target=y)
    return scheduled_steps(pm, (x,), y, 4, gamma=0.5)


@pytest.mark.parametrize("zero", [1, 3])
def test_lr_scheduler_drives_the_shard_optimizer(launcher, zero: int) -> None:
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    want, _ = scheduled_reference(models.mlp((6, 8, 3)), models.adamw, models.mse, (x,), y, 4, gamma=0.5)
    for got in launcher(_scheduled, 2, zero, x, y):
        assert got == pytest.approx(want, rel=1e-10)


@pytest.mark.parametrize("factory,name", [
    (lambda ps: torch.optim.LBFGS(ps), "LBFGS"),
    (lambda ps: torch.optim.Adafactor(ps), "Adafactor"),
])
def test_a_non_elementwise_optimizer_is_refused_by_name(factory, name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} is not known to be elementwise"):
        parallelize(models.mlp((4, 2)), Mesh(dp=2), loss_fn=models.mse, optimizer=factory, zero=2)


def test_an_optimizer_that_declares_itself_elementwise_is_accepted() -> None:
    class Lion(torch.optim.SGD):
        elementwise = True

    check_optimizer(lambda ps: Lion(ps, lr=0.1), [torch.nn.Parameter(torch.zeros(2))], 1)


def test_per_parameter_groups_are_refused() -> None:
    params = [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))]

    def grouped(ps: list) -> torch.optim.Optimizer:
        return torch.optim.AdamW([{"params": [p for p in ps if p.dim() > 1]},
                                  {"params": [p for p in ps if p.dim() <= 1], "weight_decay": 0.0}])

    with pytest.raises(ValueError, match="made 2 groups of \\[1, 1\\] parameters from 2"):
        check_optimizer(grouped, params, 3)


# layout and graph ---------------------------------------------------------------------------------
@given(shapes=st.lists(st.lists(st.integers(1, 5), max_size=3).map(tuple), min_size=1, max_size=8),
       n=st.integers(1, 8), stage=st.sampled_from([1, 2, 3]), bucket=st.integers(1, 200))
def test_layout_partitions_every_element_once_in_balanced_shards(shapes, n, stage, bucket) -> None:
    params = [(f"layers.{i // 2}.p{i}", s, torch.float32) for i, s in enumerate(shapes)]
    layout = zero_layout(params, stage=stage, n=n, bucket_bytes=bucket)
    seen = [name for g in layout.groups for name in g.params]
    assert sorted(seen) == sorted(p for p, _, _ in params)
    for g in layout.groups:
        assert g.padded % n == 0 and 0 <= g.padded - g.numel < n and g.shard * n == g.padded
        assert list(g.offsets) == [sum(g.numels[:i]) for i in range(len(g.numels))]
        assert sum(g.split_sizes()) == g.padded
        flat = torch.arange(g.padded)
        assert torch.equal(torch.cat(list(flat.chunk(n))), flat)  # shard i is [i * shard, (i + 1) * shard)
    if stage == 3:
        assert [g.name for g in layout.groups] == list(dict.fromkeys(layer_of(p) for p, _, _ in params))



@pytest.mark.parametrize("stage", [1, 2])
def test_default_buckets_start_small_so_the_first_reduce_scatter_overlaps_backward(stage: int) -> None:
    """A model that fits one 25 MiB bucket still gets a first group of one layer (DDP's 1 MiB first cap),
    and the planner counts the buckets the layout makes."""
    layer = (("weight", (1024, 1024)), ("bias", (1024,)))  # 4 MiB + 4 KiB, float32
    params = [(f"{i}.{k}", s, torch.float32) for i in range(6) for k, s in layer]
    layout = zero_layout(params, stage=stage, n=2, bucket_bytes=Options().bucket_bytes)
    assert [g.params for g in layout.groups] == [("5.bias", "5.weight"), tuple(p for p, _, _ in reversed(params[:10]))]
    assert len(bucket_sizes(sum(g.nbytes for g in layout.groups), Options().bucket_bytes)) == len(layout.groups)


def test_layers_are_found_by_list_index() -> None:
    assert layer_of("transformer.h.3.attn.c_attn.weight") == "transformer.h.3"
    assert layer_of("model.layers.0.mlp.up_proj.weight") == "model.layers.0"
    assert layer_of("transformer.wte.weight") == "transformer.wte"
    assert layer_of("0.weight") == "0"
    assert layer_of("bias") == "bias"


def _compiled(zero: int, prefetch: int = 1) -> object:
    return parallelize(models.gpt2(), Mesh(dp=2), loss_fn=models.lm_loss, optimizer=models.adamw, zero=zero,
                       zero_prefetch=prefetch, example_inputs=(IDS,), example_target=TARGET)


def test_stage3_graph_gathers_each_layer_before_its_first_use_and_frees_it_after_its_last() -> None:
    pm = _compiled(3)
    gm = pm.graph(1)
    gm.graph.lint()
    nodes = list(gm.graph.nodes)
    gathers = [n for n in nodes if n.target is torch.ops.autopar.zero_all_gather.default]
    frees = {n.args[0]: n for n in nodes if n.target is torch.ops.autopar.zero_free.default}
    assert [n.args[0].name for n in gathers][:3] == ["zero_shard_transformer_wte", "zero_shard_transformer_wpe",
                                                    "zero_shard_transformer_h_0"]
    assert len(gathers) == 5  # wte (tied with lm_head), wpe, h.0, h.1, ln_f
    assert all(g.args[1:] == ("dp", [0, 1]) for g in gathers)
    index = {n: i for i, n in enumerate(nodes)}
    for g in gathers:
        users = _alias_closure(g)
        compute = [u for u in users if u.target is not torch.ops.autopar.zero_free.default]
        assert index[frees[g]] > max(index[u] for u in compute)  # freed after the last forward use
    wte = gathers[0]
    assert max(index[u] for u in _alias_closure(wte)) > index[gathers[-1]]  # the tied head reuses wte at the end
    code = gm.code
    assert code.count("torch.ops.autopar.zero_prefetch.default") == len(gathers) - 1
    assert code.index("zero_begin") < code.index("zero_all_gather")
    assert code.rindex("zero_end") > code.rindex("zero_free")
    assert "zero_prefetch" not in _compiled(3, prefetch=0).graph(0).code


def _alias_closure(node: torch.fx.Node) -> set:
    out, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user not in out:
                out.add(user)
                if user.target in (torch.ops.aten.split_with_sizes.default, torch.ops.aten.view.default) or \
                        "getitem" in str(user.target):
                    stack.append(user)
    return out


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_plan_prints_the_zero_estimate_and_collectives(zero: int) -> None:
    text = str(_compiled(zero).plan)
    psi = sum(p.numel() for p in models.gpt2().parameters())
    assert f"zero={zero}:" in text and "reduce_scatter on dp" in text and "all_gather     on dp" in text
    memory = _compiled(zero).plan.memory
    assert memory["optimizer"] == pytest.approx(2 * 8 * psi / 2, rel=0.01)  # float64 AdamW over 2 ranks
    assert ("gathered" in memory) == (zero == 3)


def _overlap(zero: int) -> list:
    torch.manual_seed(0)
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    pm = parallelize(models.mlp((16,) * 6), Mesh(dp=2), loss_fn=models.mse, optimizer=models.sgd, zero=zero,
                     bucket_mb=16 * 17 * 8 / 2**20, example_inputs=(x,), example_target=y)
    pm.step(x, target=y)
    rt, program = pm.runtime, pm.compile((x,), {}, y)
    part = split_batch(((x,), {}, y), 2, dp=2, microbatches=1)[rt.groups.coords.dp]  # this rank's microbatch
    before = rt.zero.queue.launched
    with bind(rt.binding):  # the graph's ops run on the rank's groups, as in pm.step
        program.captured.run(rt.state, pytree.tree_leaves(part), program.graph(rt.groups.rank)).backward()
    launched = rt.zero.queue.launched - before
    full_grads = [p.grad for p in rt.zero.owned_parameters() if p.grad is not None]
    rt.zero.finish()
    return [launched, len(rt.zero.shards), len(full_grads)]


@pytest.mark.parametrize("zero", [2, 3])
def test_gradients_are_reduce_scattered_during_backward_and_not_kept_full(launcher, zero: int) -> None:
    for launched, groups, full_grads in launcher(_overlap, 2, zero):
        assert groups == 5 and launched == groups  # one reduce-scatter per layer, all from backward itself
        assert full_grads == 0


def _forward_only(zero: int, x: torch.Tensor) -> list:
    torch.manual_seed(0)
    pm = parallelize(models.mlp((6, 8, 3)), Mesh(dp=2), loss_fn=models.mse, optimizer=models.sgd, zero=zero)
    out = pm(x)
    sd = pm.state_dict()
    return [out, sd, pm.memory()["parameters"]]


def test_forward_and_state_dict_before_any_step(launcher) -> None:
    x = torch.randn(4, 6, dtype=torch.float64)
    model = models.mlp((6, 8, 3))
    for out, sd, param_bytes in launcher(_forward_only, 2, 3, x):
        torch.testing.assert_close(out, model(x).detach(), rtol=1e-12, atol=1e-12)
        model.load_state_dict(sd)  # strict: the original keys
        assert param_bytes == 8 * (56 // 2 + 28 // 2)  # float64 shards: layers of 56 and 27 (+1 pad) elements


def test_an_optimizer_of_unknown_state_is_refused_with_the_fix() -> None:
    """The optimizer's state comes from a registry by class (autopar/core/optimizers.py), not from its name."""
    class Adam(torch.optim.Optimizer):  # named like a known one, but not one
        def __init__(self, params: list) -> None:
            super().__init__(params, {})

    with pytest.raises(ValueError, match="does not know the state of optimizer Adam.*state_elements = 2"):
        parallelize(models.mlp((4, 2)), Mesh(dp=2), loss_fn=models.mse, optimizer=Adam,
                    example_inputs=(torch.zeros(4, 4),), example_target=torch.zeros(4, 2))

    class Declared(Adam):
        state_elements = 3

    assert state_elements(Declared([torch.nn.Parameter(torch.zeros(1))])) == 3
    assert state_elements(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)) == 1
    assert state_elements(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], amsgrad=True)) == 3


def _zero_calls(stages: tuple[int, ...], microbatches: int) -> dict[int, tuple[dict, dict]]:
    """Per stage: the plan's ZeRO collective counts per step on dp, and the calls of two steps."""
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    out = {}
    for stage in stages:
        pm = parallelize(models.mlp((8,) * 4), Mesh(dp=2), loss_fn=models.mse, optimizer=models.sgd, zero=stage,
                         microbatches=microbatches)
        for _ in range(2):
            pm.step(x, target=y)
        planned = {f"zero_{c.op}@{c.axis}": c.count for c in pm.plan.collectives}
        out[stage] = planned, {k: v for k, v in pm.communication(calls=True).items() if k.startswith("zero_")}
    return out


def test_the_plan_counts_each_microbatchs_reduce_scatters(launcher) -> None:
    """Two microbatches: stage 2 reduce-scatters each flat group in every microbatch's backward, stage 1 once
    after the last; the plan's counts per step are the calls each of two steps runs."""
    for rank, out in enumerate(launcher(_zero_calls, 2, (1, 2), 2)):
        for stage, (planned, calls) in out.items():
            assert {k: v / 2 for k, v in calls.items()} == planned, (rank, stage, planned, calls)
        assert out[2][0]["zero_reduce_scatter@dp"] == 2 * out[1][0]["zero_reduce_scatter@dp"], out
