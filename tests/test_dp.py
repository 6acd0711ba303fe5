"""Data parallelism over real gloo ranks equals single-device training."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import models
from autopar import Mesh, parallelize
from autopar.options import Options
from autopar.runtime.grad_sync import BucketedAllReduce
from autopar.testing import Run, assert_equivalent, reference_run, relative_errors


@given(
    widths=st.lists(st.integers(1, 12), min_size=2, max_size=4).map(tuple),
    act=st.sampled_from(["tanh", "relu", "gelu"]),
    dp=st.sampled_from([1, 2, 4]),
    microbatches=st.sampled_from([1, 2]),
    per_part=st.integers(1, 3),
    opt=st.sampled_from([models.sgd, models.adamw]),
    bucket_mb=st.sampled_from([1e-4, 25.0]),
)
def test_mlp_float64(launcher, widths, act, dp, microbatches, per_part, opt, bucket_mb) -> None:
    batch = dp * microbatches * per_part
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, widths[0], dtype=torch.float64, generator=g)
    y = torch.randn(batch, widths[-1], dtype=torch.float64, generator=g)
    assert_equivalent(models.factory(models.mlp, widths=widths, act=act), Mesh(dp=dp), (x,), y, models.mse, opt,
                      steps=3, rtol=1e-9, atol=1e-11, launcher=launcher, microbatches=microbatches,
                      bucket_mb=bucket_mb)


@given(
    d_heads=st.sampled_from([(8, 2), (12, 3), (16, 4)]),
    layers=st.integers(1, 2),
    dp=st.sampled_from([2, 4]),
    seq=st.integers(2, 6),
)
def test_transformer_float64(launcher, d_heads, layers, dp, seq) -> None:
    d, heads = d_heads
    ids = torch.randint(0, 32, (dp * 2, seq), generator=torch.Generator().manual_seed(seq))
    make = models.factory(models.transformer, d=d, heads=heads, layers=layers)
    # the key bias's gradient is zero in exact arithmetic (softmax ignores it); AdamW divides that rounding noise
    # by its own scale, so this parameter carries reassociation error up to ~1e-11: hence atol 1e-9
    assert_equivalent(make, Mesh(dp=dp), (ids,), ids, models.lm_loss, models.adamw, steps=2, rtol=1e-8, atol=1e-9,
                      launcher=launcher)


def test_mlp_float32_realistic_tolerance(launcher) -> None:
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    assert_equivalent(models.factory(models.mlp, widths=(16, 32, 4), dtype=torch.float32), Mesh(dp=2), (x,), y,
                      models.mse, models.adamw, steps=3, rtol=1e-4, atol=1e-5, launcher=launcher)


def _other_weights_on_the_ranks() -> torch.nn.Module:
    """Seed 0 on the single-device side, seed 1 on every rank of the parallel side."""
    return models.mlp((6, 2), seed=1 if dist.is_initialized() else 0)


def test_equivalence_check_catches_a_wrong_run(launcher) -> None:
    """The harness fails when the parallel run differs (here: a model of other weights on the parallel side)."""
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    with pytest.raises(AssertionError, match="loss at step 0"):
        assert_equivalent(_other_weights_on_the_ranks, Mesh(dp=2), (x,), y, models.mse, models.sgd, steps=2,
                          rtol=1e-9, atol=1e-11, launcher=launcher)


def _new_batch_size_and_state_dict() -> list:
    torch.manual_seed(0)
    pm = parallelize(models.mlp((6, 8, 2)), Mesh(dp=2), loss_fn=models.mse, optimizer=models.sgd)
    ref = models.mlp((6, 8, 2))
    opt = models.sgd(list(ref.parameters()))
    losses = []
    for batch in (8, 4, 8):
        x, y = torch.randn(batch, 6, dtype=torch.float64), torch.randn(batch, 2, dtype=torch.float64)
        got = pm.step(x, target=y)
        loss = models.mse(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((got, float(loss)))
    fresh = models.mlp((6, 8, 2), seed=5)
    fresh.load_state_dict(pm.state_dict())  # strict: the original keys
    return [losses, all(torch.allclose(a, b) for a, b in zip(fresh.parameters(), ref.parameters()))]


def test_new_batch_size_recompiles_and_state_dict_loads_into_the_model(launcher) -> None:
    for losses, same in launcher(_new_batch_size_and_state_dict, 2):
        assert same
        for got, want in losses:
            assert got == pytest.approx(want, rel=1e-10)


def _buckets_launch_during_backward() -> list:
    group = dist.new_group([0, 1])
    torch.manual_seed(0)
    model = models.mlp((8, 8, 8, 8, 2))
    params = list(model.parameters())
    x = torch.randn(4, 8, dtype=torch.float64) * (dist.get_rank() + 1)
    local = torch.autograd.grad(model(x).sum(), params)  # this rank's gradients, before any sync
    sync = BucketedAllReduce(params, group, bucket_bytes=8 * 8 * 8)  # about one layer per bucket
    model(x).sum().backward()
    launched_in_backward = [b.launched for b in sync.buckets]
    sync.finish()
    for g in local:
        dist.all_reduce(g)
        g /= 2
    return [len(sync.buckets), launched_in_backward, sync.launch_order,
            all(torch.allclose(p.grad, g) for p, g in zip(params, local))]


def test_gradient_buckets_are_all_reduced_from_hooks_during_backward(launcher) -> None:
    for n, launched, order, equal in launcher(_buckets_launch_during_backward, 2):
        assert n >= 3, "the bucket size should split the model into several buckets"
        assert all(launched), "every bucket must be launched from a gradient hook before backward returns"
        assert order == list(range(n)), "buckets hold parameters in reverse order, so they complete in order"
        assert equal


def _overlap_with_default_buckets() -> dict:
    """A 6.3M-parameter MLP (one 25 MiB bucket would hold nearly all of it) under the default bucket size."""
    group = dist.new_group([0, 1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])
    params = list(model.parameters())
    sync = BucketedAllReduce(params, group, bucket_bytes=Options().bucket_bytes)
    first_layer_backward_started = []
    model[0].register_full_backward_pre_hook(lambda *_: first_layer_backward_started.append(sync.launch_order[:]))
    out = {}
    for step in range(2):
        model(torch.randn(2, 1024)).sum().backward()
        sync.finish()
        out[step] = {"launched_before_first_layer": first_layer_backward_started.pop(),
                     "bucket_bytes": [b.flat.nbytes for b in sync.buckets],
                     "grad_is_bucket_view": all(any(p.grad.data_ptr() == v.data_ptr() for b in sync.buckets
                                                     for v in b.views) for p in params)}
        for p in params:
            p.grad = None
    return out


def test_default_buckets_overlap_backward(launcher) -> None:
    """The first bucket is small (DDP's 1 MiB cap), so it is launched while earlier layers still run backward."""
    for out in launcher(_overlap_with_default_buckets, 2):
        for step in (0, 1):
            assert out[step]["launched_before_first_layer"], f"step {step}: no bucket launched during backward"
            sizes = out[step]["bucket_bytes"]
            assert len(sizes) >= 2 and sizes[0] <= 2**20 + 4 * 1024 * 1024, sizes
        assert out[0]["grad_is_bucket_view"] is False  # the first step's buffers were replaced by the rebuild
        assert out[1]["grad_is_bucket_view"], "gradients must be views of the reduced buckets (no copy back)"


def _arrival_order() -> list:
    """Parameters registered in an order unlike backward's: buckets are rebuilt as gradients arrived."""
    group = dist.new_group([0, 1])
    torch.manual_seed(0)
    a, b, c = (torch.nn.Linear(512, 512) for _ in range(3))  # 1 MiB weights: one layer per first bucket
    params = [*c.parameters(), *a.parameters(), *b.parameters()]  # forward runs a, b, c
    sync = BucketedAllReduce(params, group, bucket_bytes=2**20)
    index = {id(p): i for i, p in enumerate(params)}
    steps = []
    for _ in range(2):
        layout = [sorted(index[id(p)] for p in bucket.params) for bucket in sync.buckets]
        c(b(a(torch.randn(2, 512)))).sum().backward()
        sync.finish()
        steps.append((layout, sync.launch_order))
        for p in params:
            p.grad = None
    return steps


def test_buckets_follow_gradient_arrival_order(launcher) -> None:
    for (layout0, order0), (layout1, order1) in launcher(_arrival_order, 2):
        # the first step's buckets follow reverse registration order: b, a, c; c's completes first
        assert layout0 == [[4, 5], [2, 3], [0, 1]] and order0 == [2, 0, 1]
        # then they are rebuilt as the gradients arrived (c, b, a) and complete in order
        assert layout1 == [[0, 1], [4, 5], [2, 3]] and order1 == [0, 1, 2]


X = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
Y = torch.randn(4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))


def _from_device_mesh() -> Run:
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = parallelize(models.mlp((4, 3, 2)), device_mesh, loss_fn=models.mse, optimizer=models.adamw)
    losses = [pm.step(X, target=Y) for _ in range(3)]
    return Run(losses, pm(X), pm.state_dict())


def test_a_device_mesh_is_accepted(launcher) -> None:
    """A named DeviceMesh trains like Mesh(dp=2): equal to single-device training."""
    ref = reference_run(models.factory(models.mlp, widths=(4, 3, 2)), (X,), Y, models.mse, models.adamw, steps=3)
    for run in launcher(_from_device_mesh, 2):
        worst, what = relative_errors(ref, run)
        assert worst <= 1e-12, (worst, what)


def _bucket_traffic(bucket_mb: float) -> tuple[list[tuple[int, int]], dict[str, int], dict[str, int]]:
    """The plan's dp collectives (count, bytes) per step, and the calls and bytes of two steps."""
    pm = parallelize(models.mlp((8,) * 6), Mesh(dp=2), loss_fn=models.mse, optimizer=models.sgd,
                     bucket_mb=bucket_mb)
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    for _ in range(2):
        pm.step(x, target=y)
    planned = [(c.count, c.bytes) for c in pm.plan.collectives if c.axis == "dp"]
    return planned, pm.communication(calls=True), pm.communication()


@pytest.mark.parametrize("bucket_mb, buckets", [(25.0, 1), (1e-3, 3), (2e-4, 5)])
def test_the_plan_counts_the_buckets_a_step_all_reduces(launcher, bucket_mb: float, buckets: int) -> None:
    """Five 8x8 layers (2,880 bytes of gradients, no tensor over 512 bytes): one bucket, or 1,048-byte buckets
    (1,152 + 1,152 + 576 bytes as the tensors fall), or 209-byte buckets, which each 512-byte weight overfills
    (bias and weight of a layer per bucket: five). The plan's count and bytes per step are what each step
    all-reduces on dp: it lays the tensors out whole, as the runtime does (cut anywhere, 209-byte buckets
    would count 14)."""
    for planned, calls, sent in launcher(_bucket_traffic, 2, bucket_mb):
        assert planned == [(buckets, 5 * (8 * 8 + 8) * 8)], planned
        assert (calls["all_reduce@dp"], sent["all_reduce@dp"]) == (2 * buckets, 2 * planned[0][1])
