"""Local ranks: spawn processes, join them into a job, collect results, never hang.

``WorkerPool`` keeps worker processes alive across jobs (a test session runs
many small jobs); each job gets a fresh rendezvous store on 127.0.0.1 (served by the parent,
so no other process can take its port) and a fresh default process group of
the job's size. ``launch`` is a one-job pool. ``backend`` and ``device`` choose
the process group's backend and where the ranks compute (``runtime/groups.py``
decides the defaults: NCCL with a GPU per rank where CUDA is available, else
gloo on the CPU; ``backend="gloo", device="cuda"`` lets ranks share GPUs). If any
rank raises or its process dies, every worker of the job is stopped and a
``RankError`` naming the rank and carrying its traceback is raised.
"""
from __future__ import annotations

import copyreg
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable

import cloudpickle
import torch
import torch.distributed as dist

from autopar.core.errors import RankError
from autopar.runtime.groups import (
    DEVICE_ENV, TIMEOUT, default_backend, rank_device, requested_device, start_job,
)


def _reduce_ops(obj: object) -> tuple:
    return (getattr, (torch, "ops"))


def _reduce_namespace(obj: object) -> tuple:
    return (getattr, (torch.ops, obj.name.split(".")[-1]))


# functions defined in a script reference torch.ops (e.g. torch.ops.autopar.*): pickle it by name
copyreg.pickle(type(torch.ops), _reduce_ops)
copyreg.pickle(torch._ops._OpNamespace, _reduce_namespace)

GRACE_S = 2.0
PEER_FAILURE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Read error")


def _is_consequence(detail: str) -> bool:
    """A failure that only reports another rank's failure (a collective whose peer went away)."""
    return any(text in detail for text in PEER_FAILURE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(index: int, tasks: Any, results: Any, sys_path: list[str]) -> None:
    sys.path[:] = sys_path
    while True:
        task = tasks.get()
        if task is None:
            return
        job, rank, world, port, backend, device, payload = task
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        )
        if "OMP_NUM_THREADS" not in os.environ:  # ranks share the machine's cores, as torchrun assumes
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        try:
            device = rank_device(backend, rank, device)
            os.environ[DEVICE_ENV] = device.type  # what join() reads: the ranks compute where the job was started
            fn, args = cloudpickle.loads(payload)
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)  # the parent holds the port
            start_job(backend, device, store=dist.PrefixStore(f"job{job}", store), rank=rank, world_size=world)
            out = fn(*args)
            dist.destroy_process_group()  # not on failure: peers would see a closed connection, not the cause
            results.put((job, rank, True, cloudpickle.dumps(out)))
        except BaseException:  # noqa: BLE001 - reported to the parent, which stops the job
            results.put((job, rank, False, traceback.format_exc()))


class WorkerPool:
    """Up to ``size`` persistent worker processes that run jobs of up to ``size`` ranks on ``backend``, computing
    on ``device`` ("cpu" or "cuda"; by default ``AUTOPAR_DEVICE``, else NCCL on CUDA where it is available and
    gloo on the CPU otherwise). Workers start when a job first needs them: a session whose jobs use two ranks
    starts two processes, not ``size``; after a failed job (whose ranks may be stuck in a collective) every
    worker is stopped and the next job starts what it needs."""

    def __init__(self, size: int, *, backend: str | None = None, device: str | None = None) -> None:
        self.size = size
        self.device = device or requested_device()
        self.backend = backend or default_backend(self.device)
        rank_device(self.backend, 0, self.device)  # a choice no rank can run is refused here, named
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._jobs = 0

    def _grow(self, n: int) -> None:
        """Starts workers until ``n`` are running (after a stop, with a fresh results queue)."""
        if not self._procs:
            self._results = self._ctx.Queue()
            self._tasks = []
        for i in range(len(self._procs), n):
            self._tasks.append(self._ctx.Queue())
            p = self._ctx.Process(target=_worker, args=(i, self._tasks[i], self._results, list(sys.path)),
                                  daemon=True)
            self._procs.append(p)
            p.start()

    @property
    def running(self) -> int:
        """How many worker processes are alive."""
        return sum(p.is_alive() for p in self._procs)

    def launch(self, fn: Callable[..., Any], nprocs: int, *args: Any) -> list[Any]:
        """Runs ``fn(*args)`` on ranks 0..nprocs-1 of a fresh job; returns the results by rank."""
        if not 1 <= nprocs <= self.size:
            raise ValueError(f"nprocs={nprocs} must be between 1 and the pool size {self.size}")
        rank_device(self.backend, nprocs - 1, self.device)  # (NCCL: a GPU for every rank)
        if not all(p.is_alive() for p in self._procs):
            self.close()
        self._grow(nprocs)
        self._jobs += 1
        # the parent serves the rendezvous store, so its port stays taken for the whole job (no race for it)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        job, port, payload = self._jobs, store.port, cloudpickle.dumps((fn, args))
        for rank in range(nprocs):
            self._tasks[rank].put((job, rank, nprocs, port, self.backend, self.device, payload))
        try:
            return self._collect(job, nprocs)
        except BaseException:
            self.close()  # ranks may be blocked in a collective with the failed one
            raise
        finally:
            del store

    def _collect(self, job: int, nprocs: int) -> list[Any]:
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = None  # once a rank fails, wait briefly for the others to report, then pick the cause
        while len(results) + len(failures) < nprocs and (deadline is None or time.monotonic() < deadline):
            for rank, p in enumerate(self._procs[:nprocs]):
                if not p.is_alive() and rank not in results and rank not in failures:
                    failures[rank] = f"the process died with exit code {p.exitcode}"
            if failures and deadline is None:
                deadline = time.monotonic() + GRACE_S
            try:
                got_job, rank, ok, data = self._results.get(timeout=0.2)
            except queue.Empty:
                continue
            if got_job != job:
                continue
            if ok:
                results[rank] = cloudpickle.loads(data)
            else:
                failures[rank] = data
        if failures:
            rank = min(failures, key=lambda r: (_is_consequence(failures[r]), r))
            raise RankError(rank, failures[rank])
        return [results[r] for r in range(nprocs)]

    def close(self) -> None:
        started = [p for p in self._procs if p.pid is not None]  # a failed start leaves some never started
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join(timeout=5)
        self._procs = []

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, backend: str | None = None,
           device: str | None = None) -> list[Any]:
    """Runs ``fn(*args)`` on ``nprocs`` local ranks; results by rank. By default NCCL with one GPU per rank
    where CUDA is available, else gloo on the CPU; ``device="cpu"`` keeps CUDA machines' ranks on the CPU,
    ``backend="gloo", device="cuda"`` lets ranks share GPUs."""
    with WorkerPool(nprocs, backend=backend, device=device) as pool:
        return pool.launch(fn, nprocs, *args)


