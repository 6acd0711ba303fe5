"""Checkpoints across meshes: train on mesh A, save, load on mesh B (resharded at load), train on: the losses and
parameters equal one uninterrupted single-device run; a checkpoint of another model is refused on every rank."""
from __future__ import annotations

import functools
import re
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import models
from autopar import Mesh, parallelize
from autopar.core.layout import Interleave, to_storage
from autopar.runtime.reshard import Geometry
from harness.training import scheduled_reference, scheduled_steps

IDS = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(2))
RTOL, ATOL = 1e-11, 1e-13  # float64; the meshes sum in different orders
Leg = tuple[dict, int, int]  # (mesh sizes, zero stage, steps)


def _leg(make: Callable, sizes: dict, zero: int, steps: int, path: str, opt: Callable, *, load: bool,
         save: bool) -> dict:
    """``steps`` steps on ``Mesh(**sizes)``, after loading ``path`` (into a model of other weights) when asked."""
    options = {"microbatches": 2} if sizes.get("pp", 1) > 1 else {}
    pm = parallelize(make(seed=7 if load else 0), Mesh(**sizes), loss_fn=models.lm_loss, optimizer=opt, zero=zero,
                     example_inputs=(IDS,), example_target=TARGET, **options)
    losses = scheduled_steps(pm, (IDS,), TARGET, steps, path=path, load=load, save=save)
    state = pm.state_dict()
    return {"losses": losses, "state": state if dist.get_rank() == 0 else None}


def _assert_chain_equals_one_device(launcher: Callable, path: str, make: Callable, legs: list[Leg],
                                    opt: Callable = models.adamw) -> None:
    losses: list[float] = []
    for i, (sizes, zero, steps) in enumerate(legs):
        job = functools.partial(_leg, make, sizes, zero, steps, path, opt, load=i > 0, save=i < len(legs) - 1)
        runs = launcher(job, Mesh(**sizes).size)
        assert all(run["losses"] == runs[0]["losses"] for run in runs)
        losses += runs[0]["losses"]
    want_losses, want_state = scheduled_reference(make(seed=0), opt, models.lm_loss, (IDS,), TARGET, len(losses))
    assert losses == pytest.approx(want_losses, rel=RTOL, abs=ATOL)
    state = runs[0]["state"]
    assert state.keys() == want_state.keys()
    for key, value in want_state.items():
        torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{key}: {m}")


@pytest.mark.slow  # 8 ranks: test_zero_checkpoint.py moves ZeRO-3 to other dp sizes and stages in the default run
def test_3d_zero3_resumes_on_dp4_tp2_zero1(launcher, tmp_path) -> None:
    """GPT-2 (fused q|k|v under tp, tied embeddings across the pipeline): dp2 x pp2 x tp2 zero=3 -> dp4 x tp2."""
    _assert_chain_equals_one_device(launcher, str(tmp_path / "ckpt"), models.factory(models.gpt2),
                                    [(dict(dp=2, pp=2, tp=2), 3, 2), (dict(dp=4, tp=2), 1, 2)])


def test_a_mesh_moves_to_one_device_and_back(launcher, tmp_path) -> None:
    """LLaMA (GQA: 2 kv heads): dp2 x tp2 zero=2 -> one device (dp=1) -> dp2 x pp2 zero=3."""
    _assert_chain_equals_one_device(launcher, str(tmp_path / "ckpt"), models.factory(models.llama),
                                    [(dict(dp=2, tp=2), 2, 2), (dict(dp=1), 0, 1), (dict(dp=2, pp=2), 3, 1)])


def test_dp_zero2_then_pp_then_tp(launcher, tmp_path) -> None:
    _assert_chain_equals_one_device(launcher, str(tmp_path / "ckpt"), models.factory(models.gpt2),
                                    [(dict(dp=2), 2, 2), (dict(pp=2), 0, 1), (dict(tp=2), 0, 1)])


def test_hybrid_sharding_moves_to_plain_zero_and_one_device(launcher, tmp_path) -> None:
    """GPT-2: dp=(2, 2) zero=3 (2 replicas of 2 shards) -> dp=2 zero=1 -> one device."""
    _assert_chain_equals_one_device(launcher, str(tmp_path / "ckpt"), models.factory(models.gpt2),
                                    [(dict(dp=(2, 2)), 3, 2), (dict(dp=2), 1, 1), (dict(dp=1), 0, 1)])


@pytest.mark.slow
def test_one_device_moves_to_hybrid_sharding(launcher, tmp_path) -> None:
    """GPT-2: one device -> dp=(2, 2) zero=2 -> dp=(2, 2) zero=3 (a checkpoint of hybrid sharding read back)."""
    _assert_chain_equals_one_device(launcher, str(tmp_path / "ckpt"), models.factory(models.gpt2),
                                    [(dict(dp=1), 0, 1), (dict(dp=(2, 2)), 2, 2), (dict(dp=(2, 2)), 3, 1)])


def test_fused_projections_of_unequal_widths_move_between_meshes(launcher, tmp_path) -> None:
    """q|k|v cut by slices (GQA widths 32|16|16) stored interleaved per tp rank -> dp2 zero=1 -> tp2.

    SGD with momentum: the key bias's gradient is rounding noise (softmax ignores it), which AdamW
    would scale up to an update of its own, beyond an element-wise tolerance."""
    _assert_chain_equals_one_device(launcher, str(tmp_path / "ckpt"), models.factory(models.fused_slice),
                                    [(dict(tp=2), 0, 2), (dict(dp=2), 1, 1), (dict(dp=1, tp=2), 0, 1)], models.sgd)


@pytest.mark.slow
@pytest.mark.parametrize("name,legs", [
    ("llama", [(dict(dp=4, tp=2), 1, 2), (dict(dp=2, pp=2, tp=2), 3, 2)]),
    ("gpt2", [(dict(tp=2, dp=2), 3, 2), (dict(pp=2, dp=2), 1, 1), (dict(dp=4), 3, 1), (dict(dp=1), 0, 1)]),
    ("llama", [(dict(pp=2, tp=2), 0, 2), (dict(dp=2, tp=2), 3, 1), (dict(tp=2), 2, 1)]),
])
def test_more_chains_with_adamw_and_sgd(launcher, tmp_path, name: str, legs: list[Leg]) -> None:
    for opt in (models.adamw, models.sgd):
        _assert_chain_equals_one_device(launcher, str(tmp_path / opt.__name__), models.factory(getattr(models, name)),
                                        legs, opt)


def test_a_checkpoint_converts_to_the_single_device_state_with_dcp_tools(launcher, tmp_path) -> None:
    """The saved tensors are the model's own: DCP's ``dcp_to_torch_save`` gives a state the plain model loads."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from autopar.runtime import checkpoint

    path = str(tmp_path / "ckpt")
    make = models.factory(models.gpt2)
    state = launcher(functools.partial(_leg, make, dict(dp=2, tp=2), 3, 1, path, models.adamw, load=False,
                                       save=True), 4)[0]["state"]
    dcp_to_torch_save(checkpoint.latest(path), str(tmp_path / "full.pt"))
    saved = torch.load(tmp_path / "full.pt", weights_only=False)
    model = make(seed=3)
    model.load_state_dict({k.removeprefix("model/"): v for k, v in saved.items() if k.startswith("model/")},
                          strict=False)  # the tied lm_head is saved once, as transformer.wte.weight
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


# the boxes of one rank's copy ---------------------------------------------------------------------------------

@st.composite
def _copies(draw: st.DrawFn) -> tuple:
    """A logical shape, a tp size and dim, maybe a fused layout (on any dim), and a dp size."""
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    tp = draw(st.sampled_from([1, 2, 4]))
    dim = draw(st.integers(0, len(shape) - 1))
    shape[dim] = max(shape[dim], tp)
    fused = None
    if draw(st.booleans()):
        d = draw(st.integers(0, len(shape) - 1))
        sizes = tuple(tp * draw(st.integers(1, 2)) for _ in range(draw(st.sampled_from([2, 3]))))  # GQA: unequal
        shape[d] = sum(sizes)
        fused = (d, sizes, tp)
    return tuple(shape), tp, dim, fused, draw(st.integers(1, 4))


@given(_copies())
def test_the_boxes_of_every_rank_tile_the_logical_tensor_once(copy: tuple) -> None:
    """Cut as the runtime stores it (fused order, tp chunk, flat dp range), each element lands once, in place."""
    shape, tp, dim, fused, dp = copy
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
    stored = to_storage(full, Interleave(*fused)) if fused else full
    seen, count = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape)
    for i, local in enumerate(stored.chunk(tp, dim)):
        flat = local.reshape(-1)
        shard = -(-flat.numel() // dp)
        for j in range(dp):
            lo, hi = min(j * shard, flat.numel()), min((j + 1) * shard, flat.numel())
            geometry = Geometry(shape, tuple(local.shape), dim if tp > 1 else None, i * -(-shape[dim] // tp), fused,
                                (lo, hi))
            for offsets, view in geometry.pieces(flat[lo:hi]):
                box = tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))
                seen[box] = view
                count[box] += 1
    assert torch.equal(seen, full) and bool((count == 1).all())


# a checkpoint of another model ------------------------------------------------------------------------------

X = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
Y = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _mlp_job(widths: tuple[int, ...], sizes: dict, zero: int, path: str, *, save: bool,
             opt: Callable = models.adamw) -> Any:
    pm = parallelize(models.mlp(widths), Mesh(**sizes), loss_fn=models.mse, optimizer=opt, zero=zero,
                     example_inputs=(X,), example_target=Y)
    pm.step(X, target=Y)
    if save:
        pm.save(path)
        return None
    try:
        pm.load(path)
    except ValueError as e:
        pm.step(X, target=Y)  # every rank is still in step with the others
        return str(e)
    return "loaded"


@pytest.mark.parametrize("saved,widths,sizes,zero,message", [
    ((6, 7, 5, 3), (6, 8, 5, 3), dict(dp=2), 3,
     r"'0\.weight' has shape \(7, 6\) in the checkpoint and \(8, 6\) in this model \(2 more keys differ\)"),
    ((6, 7, 5, 3), (6, 7, 5, 3, 3), dict(dp=1), 0,
     r"'6\.weight' \(shape \(3, 3\)\) is not in the checkpoint \(1 more key differs\)"),
    ((6, 7, 5, 3, 3), (6, 7, 5, 3), dict(dp=4), 1,
     r"the checkpoint holds '6\.weight' \(shape \(3, 3\)\), which this model does not have"),
])
def test_a_checkpoint_of_another_model_is_refused_on_every_rank(launcher, tmp_path, saved, widths, sizes, zero,
                                                                message) -> None:
    path = str(tmp_path / "ckpt")
    launcher(functools.partial(_mlp_job, saved, dict(dp=2), 2, path, save=True), 2)
    errors = launcher(functools.partial(_mlp_job, widths, sizes, zero, path, save=False), Mesh(**sizes).size)
    assert len(set(errors)) == 1, errors  # every rank refused it, with the same words, and none hangs
    assert errors[0].startswith("the checkpoint ") and "does not match this model" in errors[0]
    assert re.search(message, errors[0]), errors[0]


def _kernel_job(path: str, compiled: bool, *, save: bool) -> list:
    pm = parallelize(models.mlp((6, 7, 5, 3)), Mesh(dp=2), loss_fn=models.mse, optimizer=models.adamw,
                     zero=1 if compiled else 2, compile=compiled, example_inputs=(X,), example_target=Y)
    pm.step(X, target=Y)
    if save:
        pm.save(path)
    else:
        pm.load(path)
    return [g.get("fused") for g in pm.optimizer.param_groups]


@pytest.mark.parametrize("saved_compiled", [False, True])
def test_a_loaded_optimizer_keeps_its_own_kernel(launcher, tmp_path, saved_compiled: bool) -> None:
    """compile=True steps AdamW fused, compile=False in its loop: a checkpoint of either loads into the other,
    and each keeps the way its optimizer steps (the settings that change the update are the saved ones)."""
    path = str(tmp_path / "ckpt")
    assert launcher(functools.partial(_kernel_job, path, saved_compiled, save=True), 2)[0] == [saved_compiled or None]
    loaded = launcher(functools.partial(_kernel_job, path, not saved_compiled, save=False), 2)
    assert loaded == [[(not saved_compiled) or None]] * 2, loaded


def test_an_optimizer_built_another_way_is_refused_on_every_rank(launcher, tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    launcher(functools.partial(_mlp_job, (6, 7, 5, 3), dict(dp=2), 2, path, save=True), 2)
    errors = launcher(functools.partial(_mlp_job, (6, 7, 5, 3), dict(dp=2), 1, path, save=False, opt=models.sgd), 2)
    assert len(set(errors)) == 1, errors
    assert re.search(r"optimizer settings for '.*' lack \['dampening', 'momentum', 'nesterov'\], which this SGD has",
                     errors[0]), errors[0]
