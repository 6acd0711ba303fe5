"""What the processes of one machine compute alike, computed once: ``shared(key, compute)``.

When ``AUTOPAR_SOLVED_DIR`` names a directory the processes share (the ranks of a job, the workers of a test
run), the first process to take the lock of ``key`` computes the value and writes it there, and the others wait
on the lock and read it, instead of each computing it again. The sharding program's solution
(passes/sharding_program.py) and the model's export (autopar/compiler/export_files.py) are shared so: the ranks of a job
solve the same program and export the same model at the same time. A lock whose holder died is free again (the
system drops it with the process). Without the directory every call computes.
"""
from __future__ import annotations

import contextlib
import os
import pickle
from typing import Any, Callable, Iterator

SOLVED_DIR = "AUTOPAR_SOLVED_DIR"  # a directory shared by this machine's processes (optional)


def shared(key: str, compute: Callable[[], Any]) -> Any:
    """``compute()``, or the value another process of this machine computed under ``key`` (a file name: a
    digest of everything the value depends on), when ``AUTOPAR_SOLVED_DIR`` names a directory; the value
    must pickle."""
    folder = os.environ.get(SOLVED_DIR)
    if not folder:
        return compute()
    path = os.path.join(folder, key)
    with locked(path + ".lock"):
        if os.path.exists(path):
            with open(path, "rb") as f:
                return pickle.load(f)
        result = compute()
        with open(path + ".part", "wb") as f:
            pickle.dump(result, f)
        os.replace(path + ".part", path)
        return result


@contextlib.contextmanager
def locked(path: str) -> Iterator[None]:
    """Holds the lock file ``path`` (made where missing) against the machine's other processes; a holder that
    died leaves it free. Where the platform has no file locks (no ``fcntl``), it holds nothing."""
    try:
        import fcntl  # (a POSIX module)
    except ImportError:
        yield
        return
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
