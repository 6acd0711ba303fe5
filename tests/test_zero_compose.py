"""ZeRO stages 1-3 composed with pipeline and tensor parallelism equal single-device training; checkpoints there."""
from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import models
from autopar import Mesh, parallelize
from autopar.testing import assert_equivalent, reference_run
from harness.training import scheduled_steps

IDS = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(2))
WITH = {"pp": dict(pp=2), "tp": dict(tp=2)}
CASES = [(name, zero, dp, other) for name in ("gpt2", "llama") for zero in (1, 2, 3) for dp in (2, 4)
         for other in WITH]


def _slow_if(condition: bool) -> list:
    return [pytest.mark.slow] if condition else []


DEFAULT = {("gpt2", 1, 2, "pp"), ("llama", 2, 2, "pp"), ("gpt2", 2, 2, "tp"), ("gpt2", 3, 2, "pp"),
           ("llama", 3, 2, "tp")}  # each stage with pp and from ZeRO-2 with tp; the rest -m slow


@pytest.mark.parametrize("name,zero,dp,other", [pytest.param(*c, marks=_slow_if(c not in DEFAULT)) for c in CASES])
def test_hf_models_equal_single_device(launcher, name: str, zero: int, dp: int, other: str) -> None:
    """AdamW, and SGD with momentum, over 3 steps: each stage with pp and with tp on one of the models by
    default, on the other under -m slow (dp=4 runs 8 ranks on 2 cores: under -m slow)."""
    make = models.factory(getattr(models, name))
    mesh = Mesh(dp=dp, **WITH[other])
    extra = {"microbatches": 2} if other == "pp" else {}
    for opt in (models.adamw, models.sgd):
        assert_equivalent(make, mesh, (IDS,), TARGET, models.lm_loss, opt, steps=3, rtol=1e-9, atol=1e-10,
                          launcher=launcher, zero=zero, bucket_mb=0.02, **extra)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_dp4_with_pp_and_with_tp_on_gpt2(launcher, zero: int) -> None:
    """The dp=4 cases of the matrix above, on 8 ranks (test_zero.py keeps dp=4 alone in the default run)."""
    make = models.factory(models.gpt2)
    for mesh in (Mesh(dp=4, pp=2), Mesh(dp=4, tp=2)):
        assert_equivalent(make, mesh, (IDS,), TARGET, models.lm_loss, models.adamw, steps=3, rtol=1e-9, atol=1e-10,
                          launcher=launcher, zero=zero, bucket_mb=0.02)


@pytest.mark.slow
@given(
    sizes=st.sampled_from([dict(dp=2, pp=2), dict(dp=2, tp=2), dict(pp=2, dp=2), dict(tp=2, dp=2),
                           dict(dp=2, pp=2, tp=2), dict(tp=2, pp=2, dp=2)]),
    zero=st.sampled_from([1, 2, 3]),
    schedule=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]),
    config=st.sampled_from([("gpt2", {}), ("llama", {"tied": True}), ("llama", {"kv_heads": 4}), ("bert", {})]),
    layers=st.sampled_from([2, 4]),
    opt=st.sampled_from([models.sgd, models.adamw]),
    prefetch=st.integers(0, 2),
)
def test_drawn_transformers_equal_single_device(launcher, sizes, zero, schedule, config, layers, opt,
                                                prefetch) -> None:
    name, kw = config
    mesh = Mesh(**sizes)
    if schedule == "interleaved-1f1b" and layers < 2 * mesh.pp:
        schedule = "1f1b"
    microbatches = 2 if mesh.pp > 1 else 1
    ids = torch.randint(0, 96, (mesh.dp * microbatches, 6), generator=torch.Generator().manual_seed(layers))
    assert_equivalent(models.factory(getattr(models, name), layers=layers, **kw), mesh, (ids,), ids, models.lm_loss,
                      opt, steps=3, rtol=1e-9, atol=1e-10, launcher=launcher, zero=zero, bucket_mb=1e-3,
                      zero_prefetch=prefetch, schedule=schedule if mesh.pp > 1 else "1f1b", microbatches=microbatches)


def _partly_frozen_gpt2() -> torch.nn.Module:
    model = models.gpt2(layers=4)
    model.transformer.wpe.weight.requires_grad_(False)  # frozen: kept whole, outside the flat groups
    model.transformer.h[1].ln_1.weight.requires_grad_(False)
    return model


@pytest.mark.parametrize("sizes,zero", [(dict(dp=2, tp=2), 3),
                                        pytest.param(dict(dp=2, pp=2, tp=2), 1, marks=pytest.mark.slow),
                                        pytest.param(dict(dp=2, pp=2, tp=2), 3, marks=pytest.mark.slow)])
def test_frozen_parameters_stay_whole_on_a_3d_mesh(launcher, sizes: dict, zero: int) -> None:
    """Frozen parameters stay whole under ZeRO with tp (default run) and on the 3-D mesh (-m slow)."""
    assert_equivalent(_partly_frozen_gpt2, Mesh(**sizes), (IDS,), TARGET, models.lm_loss, models.adamw,
                      steps=3, rtol=1e-9, atol=1e-10, launcher=launcher, zero=zero, bucket_mb=1e-3, microbatches=2)


def test_each_rank_gathers_its_own_stage_layers_over_its_dp_group() -> None:
    mesh = Mesh(dp=2, pp=2, tp=2)
    pm = parallelize(models.gpt2(layers=4), mesh, loss_fn=models.lm_loss, optimizer=models.adamw, zero=3,
                     example_inputs=(IDS,), example_target=TARGET)
    for rank in range(mesh.size):
        code = pm.graph(rank).code
        dp_ranks = mesh.group_of(rank, "dp")
        assert f"zero_all_gather.default(zero_shard_transformer_h_{2 * mesh.coords(rank).pp}" in code
        assert str(dp_ranks) in code and "autopar.all_reduce" in code  # ZeRO over dp, Megatron's all-reduce on tp
    text = str(pm.plan)
    assert "zero=3: stored sharded over dp" in text and "dp: Shard(flat)" in text and "tp: S(1)" in text and "largest on rank" in text
    # tied embeddings live on both pp ranks: a flat group of their own, so the shards line up
    assert "'transformer.wte.weight'" in text


# checkpoints on composed meshes -------------------------------------------------------------------------------

def _train(path: str, sizes: dict, zero: int, steps: int, *, load: bool, save: bool, seed: int = 0) -> dict:
    pm = parallelize(models.gpt2(seed=seed), Mesh(**sizes), loss_fn=models.lm_loss, optimizer=models.adamw,
                     zero=zero, example_inputs=(IDS,), example_target=TARGET)
    losses = scheduled_steps(pm, (IDS,), TARGET, steps, path=path, load=load, save=save)
    return {"losses": losses, "state": pm.state_dict()}


@pytest.mark.parametrize("sizes,zero", [(dict(dp=2, pp=2), 3), (dict(dp=2, tp=2), 1),
                                        pytest.param(dict(dp=2, pp=2), 0, marks=pytest.mark.slow),
                                        pytest.param(dict(dp=2, pp=2, tp=2), 2, marks=pytest.mark.slow),
                                        pytest.param(dict(dp=2, tp=2), 3, marks=pytest.mark.slow)])
def test_resuming_on_a_composed_mesh_gives_the_losses_of_an_uninterrupted_run(launcher, tmp_path, sizes,
                                                                             zero) -> None:
    path = str(tmp_path / "ckpt")
    n = Mesh(**sizes).size
    job = functools.partial(_train, path, sizes, zero)
    straight = launcher(functools.partial(job, load=False, save=False), n, 4)[0]
    first = launcher(functools.partial(job, load=False, save=True), n, 2)[0]
    resumed = launcher(functools.partial(job, load=True, save=False, seed=7), n, 2)  # fresh processes and weights
    for run in resumed:
        assert first["losses"] + run["losses"] == straight["losses"]  # bitwise, step for step
        for k, v in straight["state"].items():
            assert torch.equal(run["state"][k], v), k


def _continue(state: dict, sizes: dict, zero: int) -> dict:
    pm = parallelize(models.gpt2(seed=5), Mesh(**sizes), loss_fn=models.lm_loss, optimizer=models.sgd, zero=zero,
                     example_inputs=(IDS,), example_target=TARGET)
    pm.load_state_dict(state)
    return {"losses": [pm.step(IDS, target=TARGET) for _ in range(2)], "state": pm.state_dict()}


def test_a_full_state_moves_between_composed_meshes_and_the_single_device_model(launcher) -> None:
    trained = launcher(functools.partial(_train, "", dict(dp=2, pp=2), 3, 2, load=False, save=False), 4)[0]["state"]
    def loaded() -> torch.nn.Module:
        model = models.gpt2(seed=9)
        model.load_state_dict(trained)  # strict: the original keys and shapes
        return model

    want = reference_run(loaded, (IDS,), TARGET, models.lm_loss, models.sgd, 2)
    for sizes, zero in [(dict(dp=2, tp=2), 2), (dict(pp=2, tp=2), 0), (dict(dp=4), 1)]:
        for run in launcher(_continue, Mesh(**sizes).size, trained, sizes, zero):
            assert run["losses"] == pytest.approx(want.losses, rel=1e-10)
            for k, v in want.state.items():
                torch.testing.assert_close(run["state"][k], v, rtol=1e-10, atol=1e-12)


def _forward_then_state(zero: int, sizes: dict) -> list:
    pm = parallelize(models.gpt2(layers=4), Mesh(**sizes), loss_fn=models.lm_loss, optimizer=models.adamw,
                     zero=zero, microbatches=2)
    return [pm(IDS).logits, pm.state_dict()]


@pytest.mark.parametrize("sizes,zero", [(dict(dp=2, pp=2), 3),
                                        pytest.param(dict(dp=2, pp=2, tp=2), 0, marks=pytest.mark.slow),
                                        pytest.param(dict(dp=2, pp=2, tp=2), 3, marks=pytest.mark.slow)])
def test_forward_and_state_dict_before_any_step_on_a_3d_mesh(launcher, sizes: dict, zero: int) -> None:
    """On dp=2 x pp=2 (default run) and the 3-D mesh (-m slow)."""
    model = models.gpt2(layers=4)
    want = model(IDS).logits.detach()
    for logits, state in launcher(_forward_then_state, Mesh(**sizes).size, zero, sizes):
        torch.testing.assert_close(logits, want, rtol=1e-10, atol=1e-12)
        for key, value in model.state_dict().items():
            assert torch.equal(state[key], value), key
