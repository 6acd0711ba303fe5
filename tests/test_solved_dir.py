"""Sharding solutions shared through ``AUTOPAR_SOLVED_DIR``: the ranks of a job that solve one program at the same
time solve it once, and every rank gets the same answer (passes/sharding_program.py)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from autopar.core.shared_dir import SOLVED_DIR, shared
from harness.shared_dir import shared_dir


def _solve_noting(log: Path, answer: list[float]) -> list[float]:
    with log.open("a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.5)  # long enough for every rank to ask while the first one solves
    return answer


def _rank_solves(folder: str, log: str) -> list[float]:
    with shared_dir(folder):
        return shared("program", lambda: _solve_noting(Path(log), [float(os.getpid())]))


def test_the_ranks_of_a_job_solve_one_program_once(launcher, tmp_path: Path) -> None:
    log = tmp_path / "solves.txt"
    answers = launcher(_rank_solves, 3, str(tmp_path), str(log))
    assert len(log.read_text().split()) == 1  # one rank solved; the others read its answer
    assert answers[0] == answers[1] == answers[2]


def test_each_program_is_solved_on_its_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(SOLVED_DIR, str(tmp_path))
    log = tmp_path / "solves.txt"
    first = shared("a", lambda: _solve_noting(log, [1.0]))
    assert shared("a", lambda: _solve_noting(log, [2.0])) == first == [1.0]
    assert shared("b", lambda: _solve_noting(log, [3.0])) == [3.0]
    assert len(log.read_text().split()) == 2


def test_without_a_directory_every_call_solves(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(SOLVED_DIR, raising=False)
    log = tmp_path / "solves.txt"
    assert [shared("a", lambda: _solve_noting(log, [float(i)])) for i in range(2)] == [[0.0], [1.0]]
