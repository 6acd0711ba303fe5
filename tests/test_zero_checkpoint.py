"""Checkpoints: resume on the same mesh step for step, survive a killed save, resume on another dp size and\nZeRO stage, move full states across meshes."""
from __future__ import annotations

import functools
import os
import signal

import pytest
import torch
import torch.distributed as dist

import models
from autopar import Mesh, RankError, parallelize
from autopar.runtime import checkpoint
from autopar.testing import reference_run
from harness.training import scheduled_steps

X = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
Y = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
WIDTHS = (6, 7, 5, 3)


def _train(zero: int, path: str, steps: int, *, load: bool, save: bool, seed: int = 0, kill_in_save: str = "",
           dp: int = 2) -> dict:
    """``steps`` steps (after loading ``path`` when asked), then a save; a scheduler's state rides in ``extra``."""
    pm = parallelize(models.mlp(WIDTHS, seed=seed), Mesh(dp=dp), loss_fn=models.mse, optimizer=models.adamw, zero=zero,
                     example_inputs=(X,), example_target=Y)
    if kill_in_save and dist.get_rank() == 0:  # only the save writes: the load and the steps run as usual
        {"data": _die_after_writing_data, "commit": _die_when_replacing_latest}[kill_in_save]()
    losses = scheduled_steps(pm, (X,), Y, steps, path=path, load=load, save=save)
    return {"losses": losses, "state": pm.state_dict()}


def _job(**options: object) -> functools.partial:
    return functools.partial(_train, **options)


def _die_after_writing_data() -> None:
    """The next checkpoint write kills this process once its shard files are on disk, before the commit."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    write = FileSystemWriter.write_data

    def write_then_die(self: FileSystemWriter, plan: object, planner: object) -> object:
        write(self, plan, planner).wait()
        os.kill(os.getpid(), signal.SIGKILL)

    FileSystemWriter.write_data = write_then_die


@pytest.mark.parametrize("zero", [pytest.param(0, marks=pytest.mark.slow), pytest.param(1, marks=pytest.mark.slow), 2, 3])
def test_resuming_gives_the_losses_of_an_uninterrupted_run(launcher, tmp_path, zero: int) -> None:
    path = str(tmp_path / "ckpt")
    straight = launcher(_job(load=False, save=False), 2, zero, path, 4)[0]
    first = launcher(_job(load=False, save=True), 2, zero, path, 2)[0]
    resumed = launcher(_job(load=True, save=False, seed=7), 2, zero, path, 2)  # fresh processes and weights
    for run in resumed:
        assert first["losses"] + run["losses"] == straight["losses"]  # bitwise, step for step
        for k, v in straight["state"].items():
            assert torch.equal(run["state"][k], v), k


def _die_when_replacing_latest() -> None:
    """The commit kills this process as it is about to replace LATEST (every rank's data and LATEST.tmp written)."""
    replace = os.replace

    def die_at_latest(src: str, dst: str, *args: object, **kwargs: object) -> None:
        if os.path.basename(str(dst)) == checkpoint.LATEST:
            os.kill(os.getpid(), signal.SIGKILL)
        replace(src, dst, *args, **kwargs)

    os.replace = die_at_latest


@pytest.mark.parametrize("zero, where", [(2, "data"), pytest.param(3, "data", marks=pytest.mark.slow), (2, "commit")])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(launcher, tmp_path, zero: int,
                                                                     where: str) -> None:
    """Killed once its shards are written, or in the commit just before LATEST is replaced (older versions are
    deleted only after that)."""
    path = str(tmp_path / "ckpt")
    straight = launcher(_job(load=False, save=False), 2, zero, path, 4)[0]
    launcher(_job(load=False, save=True), 2, zero, path, 2)
    committed = open(os.path.join(path, checkpoint.LATEST)).read()
    with pytest.raises(RankError):
        launcher(_job(load=True, save=True, kill_in_save=where), 2, zero, path, 1)
    versions = sorted(os.listdir(path))
    assert open(os.path.join(path, checkpoint.LATEST)).read() == committed
    assert len([v for v in versions if v.startswith(checkpoint.PREFIX)]) == 2  # the torn one is there, unnamed
    resumed = launcher(_job(load=True, save=True), 2, zero, path, 2)[0]
    assert resumed["losses"] == straight["losses"][2:]
    assert len([v for v in os.listdir(path) if v.startswith(checkpoint.PREFIX)]) == 1  # the next save cleans up


def _continue_from_full_state(state: dict, zero: int, dp: int) -> dict:
    pm = parallelize(models.mlp(WIDTHS, seed=5), Mesh(dp=dp), loss_fn=models.mse, optimizer=models.sgd, zero=zero,
                     example_inputs=(X,), example_target=Y)
    pm.load_state_dict(state)
    return {"losses": [pm.step(X, target=Y) for _ in range(2)], "state": pm.state_dict()}


def test_a_full_state_loads_into_the_single_device_model_and_into_another_mesh(launcher, tmp_path) -> None:
    trained = launcher(_job(load=False, save=False), 2, 3, str(tmp_path), 2)[0]["state"]
    def loaded() -> torch.nn.Module:
        model = models.mlp(WIDTHS, seed=9)
        model.load_state_dict(trained)  # strict: the original keys and shapes
        return model

    want = reference_run(loaded, (X,), Y, models.mse, models.sgd, 2)
    for zero, dp in [(1, 4), (2, 1), (0, 4)]:
        for run in launcher(_continue_from_full_state, dp, trained, zero, dp):
            assert run["losses"] == pytest.approx(want.losses, rel=1e-10)
            for k, v in want.state.items():
                torch.testing.assert_close(run["state"][k], v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("zero,dp,zero_after,dp_after", [(3, 2, 3, 4), (0, 2, 2, 1), (1, 4, 0, 2)])
def test_a_checkpoint_resumes_on_another_dp_size_and_zero_stage(launcher, tmp_path, zero: int, dp: int,
                                                                zero_after: int, dp_after: int) -> None:
    path = str(tmp_path / "ckpt")
    straight = launcher(_job(load=False, save=False, dp=1), 1, 0, path, 4)[0]
    first = launcher(_job(load=False, save=True, dp=dp), dp, zero, path, 2)[0]
    for run in launcher(_job(load=True, save=False, seed=7, dp=dp_after), dp_after, zero_after, path, 2):
        assert first["losses"] + run["losses"] == pytest.approx(straight["losses"], rel=1e-12)
        for k, v in straight["state"].items():
            torch.testing.assert_close(run["state"][k], v, rtol=1e-12, atol=1e-14)


def test_a_folder_without_a_committed_checkpoint_is_named(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="LATEST is missing"):
        checkpoint.latest(str(tmp_path))
