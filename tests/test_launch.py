"""Launching local ranks: results by rank; a raising or dying rank stops the job with its name, never a hang."""
from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import models
from autopar import Mesh, RankError, launch, parallelize
import autopar.runtime.launch as launch_module
from autopar.runtime.launch import WorkerPool, free_port
from harness.nodes import run_nodes


def _rank_and_sum() -> tuple[int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), float(t)


def test_launch_returns_results_by_rank_and_accepts_closures() -> None:
    k = 7
    assert launch(lambda: (*_rank_and_sum(), dist.get_world_size() * k), 3) == [(0, 6.0, 21), (1, 6.0, 21),
                                                                                 (2, 6.0, 21)]


@pytest.fixture(scope="module")
def own_pool() -> WorkerPool:
    """A pool for the jobs that fail on purpose: a failed job stops every worker of its pool, and the session's
    pool keeps its warm workers."""
    with WorkerPool(2) as p:
        yield p


def _raises() -> None:
    raise ValueError("on purpose")


def test_a_pool_starts_only_the_workers_its_jobs_need() -> None:
    """Workers start as jobs need them; a failed job stops its own workers only."""
    with WorkerPool(8) as pool:
        assert pool.running == 0
        assert pool.launch(_rank_and_sum, 1) == [(0, 1.0)] and pool.running == 1
        assert pool.launch(_rank_and_sum, 2) == [(0, 3.0), (1, 3.0)] and pool.running == 2
        assert pool.launch(_rank_and_sum, 1) == [(0, 1.0)] and pool.running == 2  # the second one stays
        with pytest.raises(RankError, match="ValueError: on purpose"):
            pool.launch(_raises, 1)
        assert pool.running == 1  # worker 1 was not in the failed job
        assert pool.launch(_rank_and_sum, 2) == [(0, 3.0), (1, 3.0)] and pool.running == 2


def _environment(name: str) -> str | None:
    return os.environ.get(name)


def test_a_worker_has_the_environment_of_its_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers fork from a server started with the first worker; each still gets the parent's environment as it
    is when the worker starts, as a spawned process would, not the server's."""
    with WorkerPool(1) as pool:
        assert pool.launch(_environment, 1, "AUTOPAR_TEST_MARK") == [None]  # (the server runs from here on)
    monkeypatch.setenv("AUTOPAR_TEST_MARK", "set later")
    with WorkerPool(1) as pool:
        assert pool.launch(_environment, 1, "AUTOPAR_TEST_MARK") == ["set later"]


def _rank1_raises_while_rank0_waits() -> None:
    if dist.get_rank() == 1:
        raise ValueError("bad thing on rank one")
    dist.all_reduce(torch.ones(1))  # would wait for rank 1 forever


def test_a_raising_rank_stops_the_job_and_is_named(own_pool) -> None:
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 failed") as info:
        own_pool.launch(_rank1_raises_while_rank0_waits, 2)
    assert "ValueError: bad thing on rank one" in info.value.detail
    assert time.monotonic() - start < 60
    assert own_pool.running == 0  # every worker of the failed job was stopped
    assert own_pool.launch(_rank_and_sum, 2) == [(0, 3.0), (1, 3.0)]  # the pool recovers


def _rank0_dies() -> None:
    if dist.get_rank() == 0:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def test_a_dying_rank_stops_the_job_and_is_named(own_pool) -> None:
    with pytest.raises(RankError, match="rank 0 failed:\nthe process died with exit code 3"):
        own_pool.launch(_rank0_dies, 2)


def _counts_and_raises(path: str) -> None:
    with open(path, "a") as f:
        f.write(f"{dist.get_rank()}\n")
    raise RuntimeError("Connection closed by peer")  # (a connect failure's words, but raised by the job's code)


def test_a_job_whose_ranks_fail_to_connect_is_started_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """gloo's full-mesh connect fails now and then on a loaded machine: a job none of whose ranks ran is started
    again on fresh processes, with a warning; a failure to connect that comes again (a missing network
    interface) is not retried, nor is a failure inside the job's function, whatever its words."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "autopar-missing0")  # every rank fails inside init_process_group
    with WorkerPool(2, device="cpu") as pool:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (no retry)
            with pytest.raises(RankError, match="Unable to find address for: autopar-missing0"):
                pool.launch(_rank_and_sum, 2)
        calls = []

        def transient_once(detail: str) -> bool:  # the parent's judgement, made once transient; the retry is real
            calls.append(detail)
            monkeypatch.delenv("GLOO_SOCKET_IFNAME")  # the restarted workers start with the parent's environment
            return True

        monkeypatch.setattr(launch_module, "_is_transient", transient_once)
        with pytest.warns(UserWarning, match="failed to connect to the others; starting the job's 2 processes again"):
            assert pool.launch(_rank_and_sum, 2) == [(0, 3.0), (1, 3.0)]
        assert len(calls) == 1 and "Unable to find address" in calls[0]
        log = tmp_path / "calls"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(RankError, match="Connection closed by peer"):
                pool.launch(_counts_and_raises, 2, str(log))
        assert sorted(log.read_text().split()) == ["0", "1"] and len(calls) == 1  # ran once, not judged


def _wrong_world() -> None:
    pm = parallelize(models.mlp((4, 2)), Mesh(dp=4), loss_fn=models.mse, optimizer=models.sgd)
    pm.step(torch.ones(4, 4, dtype=torch.float64), target=torch.ones(4, 2, dtype=torch.float64))


def test_world_size_must_equal_the_mesh_size(own_pool) -> None:
    with pytest.raises(RankError, match=r"world size 2 does not equal the mesh size 4 \(dp=4\)"):
        own_pool.launch(_wrong_world, 2)


def test_running_without_a_job_says_how_to_launch() -> None:
    pm = parallelize(models.mlp((4, 2)), Mesh(dp=2), loss_fn=models.mse, optimizer=models.sgd)
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node=N or call it through autopar.launch"):
        pm.step(torch.ones(4, 4, dtype=torch.float64), target=torch.ones(4, 2, dtype=torch.float64))


TORCHRUN_SCRIPT = """
import sys, json, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
import models
from autopar import Mesh, parallelize
x, y = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).split([4, 2], dim=1)
pm = parallelize(models.mlp((4, 8, 2)), Mesh(dp=2), loss_fn=models.mse, optimizer=models.adamw)
losses = [pm.step(x, target=y) for _ in range(2)]
if dist.get_rank() == 0:
    json.dump(losses, open({out!r}, "w"))
dist.barrier()
dist.destroy_process_group()
"""


def test_two_node_torchrun_job_over_loopback(tmp_path: Path) -> None:
    """Two torchrun 'nodes' of one process each join one job through env:// (node 1's rank is 1, its local rank 0).

    The nodes meet the way a cluster's launcher starts them: node 0 hosts the store at the master address and
    each node names its rank. (Two c10d rendezvous agents on one host race to host the store; tests/test_elastic.py
    serves the c10d store from the test instead.) A job that outlives the limit is killed with its logs."""
    script = tmp_path / "job.py"
    out = tmp_path / "losses.json"
    script.write_text(TORCHRUN_SCRIPT.format(tests=str(Path(__file__).parent), out=str(out)))
    for _ in range(3):  # a port found free may be taken by another process before node 0 listens on it
        port = free_port()
        codes, text = run_nodes([["--nnodes=2", "--nproc-per-node=1", f"--node-rank={i}", "--master-addr=127.0.0.1",
                                  f"--master-port={port}", str(script)] for i in range(2)],
                                [tmp_path / f"node{i}.log" for i in range(2)], {**os.environ, "OMP_NUM_THREADS": "1"},
                                timeout_s=240)
        if codes == [0, 0] or "EADDRINUSE" not in text:
            break
    assert codes == [0, 0], text
    import json

    got = json.loads(out.read_text())
    model = models.mlp((4, 8, 2))
    opt = models.adamw(list(model.parameters()))
    x, y = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).split([4, 2], dim=1)
    for step_loss in got:
        loss = models.mse(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert step_loss == pytest.approx(float(loss.detach()), rel=1e-9)
