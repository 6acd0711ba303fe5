"""Ranks that fall out of step in a plain ``for`` loop (loaders of different lengths; one rank saving while
another steps) stop the job with an error naming both ranks and their calls, not a wait until the collective
timeout (runtime/progress.py). The jobs run with a 300 s timeout: a job that waited for it fails the test on the
message, as would a job that hung."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import models
from autopar import Mesh, RankError, parallelize
from autopar.runtime.launch import WorkerPool
from autopar.runtime.progress import State, desync
from harness.nodes import run_nodes

TESTS = Path(__file__).parent
X = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
Y = torch.randn(4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def own_pool() -> WorkerPool:
    """Jobs that fail on purpose stop their workers: their own pool keeps the session's warm."""
    with WorkerPool(2) as p:
        yield p


def _uneven_loop(counts: list[int], then: str | None, folder: str) -> int:
    """A plain for loop over this rank's ``counts[rank]`` batches, then ``then`` ("save", or nothing)."""
    pm = parallelize(models.mlp((4, 2)), Mesh(dp=2), loss_fn=models.mse, optimizer=models.sgd)
    for _ in range(counts[dist.get_rank()]):
        pm.step(X, target=Y)
    if then == "save":
        pm.save(folder)
    return counts[dist.get_rank()]


def test_a_rank_whose_loop_ended_early_is_named(own_pool) -> None:
    with pytest.raises(RankError, match=r"rank 0 waits in its call 3 \(pm.step, after 2 steps\) for rank 1, which "
                                        r"ended after 2 calls \(2 steps\).*pm.batches\(loader\)"):
        own_pool.launch(_uneven_loop, 2, [3, 2], None, "")


def test_a_rank_that_saves_while_another_steps_is_named(own_pool, tmp_path: Path) -> None:
    """Both ranks wait; the first to look names both and stops (the reason alone: not a collective's timeout
    turned into it afterwards, which would carry the rank's traceback)."""
    with pytest.raises(RankError, match=r"rank \d is in pm.(step|save) \(its call 3, after 2 steps\) while rank \d is "
                                        r"in pm.(save|step) \(its call 3, after 2 steps\)") as failed:
        own_pool.launch(_uneven_loop, 2, [3, 2], "save", str(tmp_path / "ckpt"))
    assert "Traceback" not in str(failed.value), failed.value


def test_only_a_definite_desync_is_reported() -> None:
    waiting = State(3, "step", "in", 2)
    assert desync(0, waiting, {1: State(2, "step", "out", 2)}) is None  # slow to come back: not definite
    assert desync(0, waiting, {1: State(2, "step", "in", 1)}) is None  # still finishing its step 2
    assert desync(0, waiting, {1: State(3, "step", "in", 2)}) is None  # with us
    assert desync(0, waiting, {1: None}) is None  # not started yet
    assert "ended after 2 calls" in desync(0, waiting, {1: State(2, "step", "exit", 2)})
    assert "ended after 2 calls" in desync(0, waiting, {1: State(2, "step", "out", 2)}, ended={1})
    assert "rank 1 is in pm.save" in desync(0, waiting, {1: State(3, "save", "in", 2)})
    assert desync(0, State(3, "step", "out", 3), {1: State(2, "step", "exit", 2)}) is None  # not waiting


TORCHRUN_SCRIPT = """
import os, sys, torch
sys.path.insert(0, {tests!r})
import models
from autopar import Mesh, parallelize
x = torch.randn(4, 4, dtype=torch.float64)
y = torch.randn(4, 2, dtype=torch.float64)
pm = parallelize(models.mlp((4, 2)), Mesh(dp=2), loss_fn=models.mse, optimizer=models.sgd)
for _ in range(3 if os.environ["RANK"] == "0" else 2):  # rank 1's loader is shorter; it exits after its loop
    pm.step(x, target=y)
"""


@pytest.mark.slow  # two torchrun agents starting ranks (about 25 s idle); the launch pool's cases cover the naming
def test_under_torchrun_a_rank_that_exited_early_is_named(tmp_path: Path) -> None:
    """Rank 1 exits after its loop: rank 0's step fails at once (the connection closed) and says why."""
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT.format(tests=str(TESTS)))
    codes, text = run_nodes([["--standalone", "--nproc-per-node=2", str(script)]], [tmp_path / "node.log"],
                            {**os.environ, "OMP_NUM_THREADS": "1"}, timeout_s=240)
    assert codes[0] != 0, text
    assert "rank 0 waits in its call 3 (pm.step, after 2 steps) for rank 1, which ended after 2 calls" in text, text


def _stalling_rank(stall_s: float, away_s: float) -> None:
    """Rank 1 stays away (sleeps) before its second step while rank 0 waits in it."""
    import time

    os.environ["AUTOPAR_STALL_S"] = str(stall_s)
    try:
        pm = parallelize(models.mlp((4, 2)), Mesh(dp=2), loss_fn=models.mse, optimizer=models.sgd)
        pm.step(X, target=Y)
        if dist.get_rank() == 1:
            time.sleep(away_s)
        pm.step(X, target=Y)
    finally:
        del os.environ["AUTOPAR_STALL_S"]


def test_a_rank_that_stays_away_is_named(own_pool) -> None:
    """A rank alive but not calling is named after AUTOPAR_STALL_S, not left to the collective's timeout."""
    with pytest.raises(RankError, match=r"rank 0 has waited \d+ s in its call 2 \(pm.step, after 1 steps\) for rank "
                                        r"1, which was last seen after its call 1 \(pm.step, after 1 steps\) and has "
                                        r"not moved for \d+ s.*AUTOPAR_STALL_S=2"):
        own_pool.launch(_stalling_rank, 2, 2.0, 8.0)


def test_a_stall_is_only_a_peer_away_for_the_limit() -> None:
    from autopar.runtime.progress import stalled

    waiting, away = State(3, "step", "in", 2), {1: State(2, "step", "out", 2)}
    assert stalled(0, waiting, away, {1: 9.0}, waited_s=9.0, limit_s=10.0) is None  # not yet
    assert stalled(0, waiting, away, {1: 10.0}, waited_s=10.0, limit_s=10.0) is not None
    assert stalled(0, waiting, away, {1: 5.0}, waited_s=30.0, limit_s=10.0) is None  # it moved 5 s ago
    assert stalled(0, waiting, {1: State(3, "step", "in", 2)}, {1: 60.0}, 60.0, 10.0) is None  # waits with us
    assert stalled(0, State(3, "step", "out", 3), away, {1: 60.0}, 60.0, 10.0) is None  # not waiting
    both = {1: State(3, "step", "out", 3), 2: State(2, "step", "out", 2)}
    assert "for rank 2" in stalled(0, waiting, both, {1: 60.0, 2: 60.0}, 60.0, 10.0)  # the one furthest behind
