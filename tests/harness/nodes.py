"""torchrun "nodes" on one host for the tests: started, waited for within a limit, and always stopped."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

MARK = "AUTOPAR_TEST_NODES"  # in the environment of every process of one run_nodes call


def run_nodes(args: list[list[str]], logs: list[Path], env: dict[str, str],
              timeout_s: float) -> tuple[list[int | None], str]:
    """Runs ``python -m torch.distributed.run *args[i]`` for each node i, each in a session of its own and
    logging to ``logs[i]`` (a file: no node blocks on a full pipe); returns the exit codes and the logs' tails.

    After ``timeout_s``, or once every node has exited, every process left is killed: the nodes' sessions, and
    any process whose environment holds this call's mark (torchrun starts each rank in a session of its own, so
    a rank whose agent was killed is found only this way)."""
    mark = uuid.uuid4().hex
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *a], stdout=log.open("w"),
                              stderr=subprocess.STDOUT, env={**env, MARK: mark}, start_new_session=True)
             for a, log in zip(args, logs)]
    deadline = time.monotonic() + timeout_s
    try:
        for p in nodes:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        _kill_marked(mark)
    text = "\n".join(f"--- node {i} (exit {p.returncode}) ---\n{log.read_text()[-3000:]}"
                     for i, (p, log) in enumerate(zip(nodes, logs)))
    return [p.returncode for p in nodes], text


def _kill_marked(mark: str) -> None:
    needle = f"{MARK}={mark}".encode()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:
            pass
