"""A torchrun job for tests/test_elastic.py: examples/train_lm.py, with a failure injected on its first attempt.

The failure (only where torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0), from the environment:

- ``AUTOPAR_TEST_KILL_AT_STEP=k`` and ``AUTOPAR_TEST_KILL_RANK=r``: rank r kills itself (SIGKILL) once its
  step k is done;
- the same and ``AUTOPAR_TEST_KILL_IN_SAVE=1``: rank 0 kills itself inside the checkpoint save after step k,
  when every rank's shards are written and before the save is committed;
- ``AUTOPAR_TEST_KILL_AT_STEP=k`` and ``AUTOPAR_TEST_KILL_NODE=g``: once step k is done, the first rank of
  torchrun's node ``g`` (``GROUP_RANK``) kills that node: its torchrun agent and every rank the agent started.

Rank 0 of every attempt appends ``attempt world first-step`` to ``OUT/attempts.txt`` at its first step (the
first step it runs: 1, or the step after the checkpoint it resumed from). The library reads none of this.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path
from typing import Any

import autopar
from autopar.runtime import checkpoint

ROOT = Path(__file__).resolve().parents[1]
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ["RANK"])


def _env(name: str) -> int | None:
    value = os.environ.get(f"AUTOPAR_TEST_{name}")
    return int(value) if value else None


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_node() -> None:
    """This node's agent first (so that it restarts nothing), then every process it started, this one last."""
    agent = os.getppid()
    started = [int(stat.split()[0]) for stat in _stats() if int(stat.rsplit(")", 1)[1].split()[1]) == agent]
    os.kill(agent, signal.SIGKILL)
    for pid in started:
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    _kill_self()


def _stats() -> list[str]:
    """``/proc/<pid>/stat`` of every process still readable."""
    stats = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stats.append((entry / "stat").read_text())
            except OSError:
                pass
    return stats


def inject(out: Path) -> None:
    """Wraps ``ParallelModel.load``, ``step`` and ``save`` with the records and the failure described above."""
    at, rank, node = _env("KILL_AT_STEP"), _env("KILL_RANK"), _env("KILL_NODE")
    in_save = bool(_env("KILL_IN_SAVE"))
    load, step, save = autopar.ParallelModel.load, autopar.ParallelModel.step, autopar.ParallelModel.save
    done = {"step": 0, "first": True}

    def loading(self: Any, path: str) -> Any:
        position = load(self, path)
        done["step"] = position["step"]
        return position

    def stepping(self: Any, *args: Any, **kwargs: Any) -> float:
        if done["first"] and RANK == 0:
            with open(out / "attempts.txt", "a") as f:
                f.write(f"{ATTEMPT} {os.environ['WORLD_SIZE']} {done['step'] + 1}\n")
        done["first"] = False
        loss = step(self, *args, **kwargs)
        done["step"] += 1
        if ATTEMPT == 0 and done["step"] == at and not in_save:
            if RANK == rank:
                _kill_self()
            if node is not None and int(os.environ["GROUP_RANK"]) == node and int(os.environ["LOCAL_RANK"]) == 0:
                _kill_node()
        return loss

    def saving(self: Any, path: str, extra: Any = None) -> None:
        if ATTEMPT == 0 and in_save and extra["step"] == at and RANK == 0:
            checkpoint._commit = lambda root, name: _kill_self()  # (rank 0 commits, after every rank wrote)
        save(self, path, extra)

    autopar.ParallelModel.load, autopar.ParallelModel.step, autopar.ParallelModel.save = loading, stepping, saving


def main(argv: list[str]) -> None:
    spec = importlib.util.spec_from_file_location("train_lm", ROOT / "examples" / "train_lm.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    inject(Path(script.arguments(argv).out))
    script.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
