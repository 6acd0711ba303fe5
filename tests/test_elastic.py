"""Elastic training under torchrun: a killed rank or node brings the job back from the last committed checkpoint,
on the same world size or a smaller one, and the losses equal an uninterrupted single-device run step for step.

Each job is two torchrun "nodes" of one or two ranks on loopback, running examples/train_lm.py (float64, a tiny model)
through tests/elastic_job.py, which injects the failure on the first attempt. The nodes meet through torchrun's
c10d rendezvous (the one ``--max-restarts`` and ``--nnodes=MIN:MAX`` need) on a store this test serves, as an
etcd or a dedicated store host would in a cluster: no node hosts it, so either can die, and the two agents on
one host do not race to host it. Every process is killed at the end, whatever happened."""
from __future__ import annotations

import csv
import importlib.util
import os
import signal
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist

from harness.nodes import run_nodes

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--layers", "1", "--width", "16", "--heads", "2", "--kv-heads", "1", "--seq", "16", "--batch", "8",
         "--corpus-mb", "0.02", "--dtype", "float64", "--log-every", "100", "--peak-tflops", "1"]


def _script():
    spec = importlib.util.spec_from_file_location("train_lm_script", ROOT / "examples" / "train_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_nodes(tmp_path: Path, nnodes: str, job: list[str], failure: dict[str, str],
               timeout_s: float, per_node: int = 2) -> tuple[list[int | None], str]:
    """Two torchrun nodes of ``per_node`` ranks on the job (``--nnodes=nnodes``); their exit codes and logs."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the rendezvous' store
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AUTOPAR_TIMEOUT_S": "60", "AUTOPAR_DEVICE": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **failure}  # (docs/user_guide.md, "Elastic training")
    node = [f"--nnodes={nnodes}", f"--nproc-per-node={per_node}", "--max-restarts=2", "--monitor-interval=0.5",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{store.port}", "--rdzv-id=elastic",
            "--rdzv-conf=is_host=0,join_timeout=300,last_call_timeout=5", "--local-addr=127.0.0.1",
            str(ROOT / "tests" / "elastic_job.py"), *job]
    try:
        return run_nodes([node, node], [tmp_path / f"node{i}.log" for i in range(2)], env, timeout_s)
    finally:
        del store


def _one_device(tmp_path: Path, steps: int) -> list[float]:
    """The losses of the same training in plain PyTorch on one device, uninterrupted."""
    script = _script()
    return script.train(script.arguments([*SMALL, "--steps", str(steps), "--mesh", "none",
                                          "--out", str(tmp_path / "one")]))


def _check_losses(out: Path, steps: int, one: list[float]) -> None:
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == list(range(1, steps + 1))
    worst = max(abs(float(r["loss"]) - b) / abs(b) for r, b in zip(rows, one))
    assert worst <= 1e-10, worst


def _attempts(out: Path) -> list[tuple[int, int, int]]:
    """(attempt, world size, first step) of each attempt, as rank 0 recorded them."""
    return [tuple(int(v) for v in line.split()) for line in (out / "attempts.txt").read_text().splitlines()]


@pytest.mark.slow  # two torchrun nodes through a kill and a restart: 100-230 s, a sixth of the default run's time
@pytest.mark.parametrize("failure,per_node,mesh", [
    ({"AUTOPAR_TEST_KILL_AT_STEP": "4", "AUTOPAR_TEST_KILL_RANK": "0", "AUTOPAR_TEST_KILL_IN_SAVE": "1"}, 1, "dp=2"),
    pytest.param({"AUTOPAR_TEST_KILL_AT_STEP": "4", "AUTOPAR_TEST_KILL_RANK": "0", "AUTOPAR_TEST_KILL_IN_SAVE": "1"},
                 2, "dp=2,tp=2", marks=pytest.mark.slow),
    pytest.param({"AUTOPAR_TEST_KILL_AT_STEP": "3", "AUTOPAR_TEST_KILL_RANK": "3"}, 2, "dp=2,tp=2",
                 marks=pytest.mark.slow),
], ids=["rank0-in-save-4-dp2", "rank0-in-save-4-dp2-tp2", "rank3-after-step-3"])
def test_a_killed_rank_resumes_from_the_last_committed_checkpoint(tmp_path: Path, failure: dict, per_node: int,
                                                                 mesh: str) -> None:
    """Rank 0 dies inside the save after step 4 (every rank's shards written, the save not committed), or
    rank 3 after step 3: both nodes start again, the job resumes from step 2's checkpoint (not the half-written
    one) on the same mesh, and its losses are one device's: one rank per node (dp=2), and two per node
    (dp=2 x tp=2). All under ``-m slow``."""
    steps, out = 6, tmp_path / "run"
    job = [*SMALL, "--steps", str(steps), "--ckpt-every", "2", "--mesh", mesh, "--resume", "--out", str(out)]
    codes, logs = _run_nodes(tmp_path, "2", job, failure, timeout_s=480, per_node=per_node)
    assert codes == [0, 0], logs
    world = 2 * per_node
    assert [(w, first) for _, w, first in _attempts(out)] == [(world, 1), (world, 3)], logs
    _check_losses(out, steps, _one_device(tmp_path, steps))


@pytest.mark.slow
def test_a_lost_node_resumes_on_the_remaining_ranks_with_a_smaller_mesh(tmp_path: Path) -> None:
    """Node 1 (its agent and both its ranks) dies after step 5 of a job started on 4 ranks as dp=2 x tp=2
    (``--nnodes=1:2``): node 0 comes back alone, re-planned as dp=1 x tp=2 from the world size, from step 4's
    checkpoint, and the losses equal one device's."""
    steps, out = 7, tmp_path / "run"
    job = [*SMALL, "--steps", str(steps), "--ckpt-every", "2", "--mesh", "dp=*,tp=2", "--resume", "--out", str(out)]
    codes, logs = _run_nodes(tmp_path, "1:2", job, {"AUTOPAR_TEST_KILL_AT_STEP": "5", "AUTOPAR_TEST_KILL_NODE": "1"},
                             timeout_s=600)
    assert sorted(codes) == [-signal.SIGKILL, 0], logs  # (either node may have been group rank 1)
    attempts = _attempts(out)  # (a node that starts late joins in a membership restart: an attempt more)
    assert any(world == 4 for _, world, _ in attempts) and attempts[-1][1:] == (2, 5), (attempts, logs)
    _check_losses(out, steps, _one_device(tmp_path, steps))


def test_restarts_on_the_rendezvous_store_shared_with_the_ranks_are_warned_about(monkeypatch) -> None:
    """torchrun's default shares its store with the ranks, where a restart can read the previous attempt's
    addresses (this test's jobs set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; without it they fail to restart)."""
    from autopar.runtime.groups import _warn_restarts_on_a_shared_store

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    with pytest.warns(UserWarning, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        _warn_restarts_on_a_shared_store()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_restarts_on_a_shared_store()


def test_a_mesh_axis_given_as_a_star_takes_the_rest_of_the_world_size() -> None:
    mesh_axes = _script().mesh_axes
    assert mesh_axes("dp=*,tp=2", 4) == {"dp": 2, "tp": 2} and mesh_axes("dp=*,tp=2", 2) == {"dp": 1, "tp": 2}
    assert mesh_axes("dp=2,pp=2", None) == {"dp": 2, "pp": 2}
    with pytest.raises(ValueError, match="the world size 3 does not divide by the other axes' product 2"):
        mesh_axes("dp=*,tp=2", 3)
    with pytest.raises(ValueError, match="local ranks have none; give every size"):
        mesh_axes("dp=*,tp=2", None)
