"""Local ranks: start processes, join them into a job, collect results, never hang.

``WorkerPool`` keeps worker processes alive across jobs (a test session runs
many small jobs) and forks them from a server that imported torch once (``_context``); each job gets a fresh rendezvous store on 127.0.0.1 (served by the parent,
so no other process can take its port) and a fresh default process group of
the job's size. ``launch`` is a one-job pool. ``backend`` and ``device`` choose
the process group's backend and where the ranks compute (``runtime/groups.py``
decides the defaults: NCCL with a GPU per rank where CUDA is available, else
gloo on the CPU; ``backend="gloo", device="cuda"`` lets ranks share GPUs). If any
rank raises or its process dies, every worker of the job is stopped and a
``RankError`` naming the rank and carrying its traceback is raised. A job whose
ranks failed to connect to each other (gloo's full-mesh connect, now and then on
a loaded machine) before any ran the job's function is started again on fresh
workers, up to ``JOIN_ATTEMPTS`` times, with a warning.
"""
from __future__ import annotations

import copyreg
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterable

import cloudpickle
import torch
import torch.distributed as dist

from autopar.core.errors import RankError
from autopar.runtime import progress
from autopar.runtime.progress import desync
from autopar.runtime.groups import (
    DEVICE_ENV, TIMEOUT, attempt_store, default_backend, rank_device, requested_device, start_job,
)


def _reduce_ops(obj: object) -> tuple:
    return (getattr, (torch, "ops"))


def _reduce_namespace(obj: object) -> tuple:
    return (getattr, (torch.ops, obj.name.split(".")[-1]))


# functions defined in a script reference torch.ops (e.g. torch.ops.autopar.*): pickle it by name
copyreg.pickle(type(torch.ops), _reduce_ops)
copyreg.pickle(torch._ops._OpNamespace, _reduce_namespace)

GRACE_S = 2.0
JOIN_ATTEMPTS = 3  # gloo's full-mesh connect fails now and then on a loaded machine (pytorch/pytorch#53270)
PEER_FAILURE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Read error")


def _is_consequence(detail: str) -> bool:
    """A failure that only reports another rank's failure (a collective whose peer went away)."""
    return any(text in detail for text in PEER_FAILURE)


def _is_transient(detail: str) -> bool:
    """A failure to connect that starting the job again may not meet (not, say, a missing network interface)."""
    return "connectFullMesh" in detail or "Connect timeout" in detail or _is_consequence(detail)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(index: int, tasks: Any, results: Connection, sys_path: list[str], environ: dict[str, str]) -> None:
    sys.path[:] = sys_path
    os.environ.clear()  # the parent's environment when it started the worker (not the fork server's)
    os.environ.update(environ)
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
        phase = "prepare"  # a rank that fails to "connect" to the others says so: the parent may start the job again
        try:
            device = rank_device(backend, rank, device)
            os.environ[DEVICE_ENV] = device.type  # what join() reads: the ranks compute where the job was started
            fn, args = cloudpickle.loads(payload)
            phase = "connect"
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)  # the parent holds the port
            start_job(backend, device, store=dist.PrefixStore(f"job{job}", store), rank=rank, world_size=world)
            phase = "run"
            out = fn(*args)
            dist.destroy_process_group()  # not on failure: peers would see a closed connection, not the cause
            results.send((job, rank, True, cloudpickle.dumps(out), phase))
        except BaseException:  # noqa: BLE001 - reported to the parent, which stops the job
            results.send((job, rank, False, traceback.format_exc(), phase))


PRELOAD = ("torch", "torch.distributed", "autopar.parallel", "autopar.compiler.driver", "autopar.runtime.launch")


def _context() -> Any:
    """Workers fork from a server process that imported torch and autopar once (the ``forkserver`` start
    method, where the platform has it), instead of each importing them anew (``spawn``); the server starts
    with the first worker and also preloads transformers where the caller had imported it. Each worker still
    imports the caller's ``__main__`` as ``spawn`` does (a script keeps its ``if __name__ == "__main__"``)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *(["transformers"] if "transformers" in sys.modules else [])])
    return ctx


@dataclass
class _Worker:
    """A worker process, the queue it takes tasks from and the pipe its results come back on (its own: stopping
    one worker leaves the others' channels whole)."""

    process: Any
    tasks: Any
    results: Connection


class WorkerPool:
    """Up to ``size`` persistent worker processes that run jobs of up to ``size`` ranks on ``backend``, computing
    on ``device`` ("cpu" or "cuda"; by default ``AUTOPAR_DEVICE``, else NCCL on CUDA where it is available and
    gloo on the CPU otherwise). Rank ``i`` of every job runs on worker ``i``, started when a job first needs
    it: a session whose jobs use two ranks starts two processes, not ``size``. A failed job's workers (whose
    ranks may be stuck in a collective) are stopped and started again by the next job that needs them; the
    others keep running, warm (torch, the model code and ``torch.export`` already loaded)."""

    def __init__(self, size: int, *, backend: str | None = None, device: str | None = None) -> None:
        self.size = size
        self.device = device or requested_device()
        self.backend = backend or default_backend(self.device)
        rank_device(self.backend, 0, self.device)  # a choice no rank can run is refused here, named
        self._ctx = _context()
        self._workers: list[_Worker | None] = []
        self._jobs = 0

    def _start(self, i: int) -> _Worker:
        tasks = self._ctx.Queue()
        reader, writer = self._ctx.Pipe(duplex=False)
        process = self._ctx.Process(target=_worker, args=(i, tasks, writer, list(sys.path), dict(os.environ)),
                                    daemon=True)
        worker = _Worker(process, tasks, reader)
        self._workers[i] = worker  # (before start: a failed start is still stopped by close)
        process.start()
        writer.close()  # the worker holds its end: the pipe reports the worker's death as end of file
        return worker

    def _ready(self, n: int) -> list[_Worker]:
        """Workers 0..n-1, each started (again) where it is not running."""
        self._workers += [None] * (n - len(self._workers))
        return [w if w is not None and w.process.is_alive() else self._start(i)
                for i, w in enumerate(self._workers[:n])]

    @property
    def running(self) -> int:
        """How many worker processes are alive."""
        return sum(w is not None and w.process.is_alive() for w in self._workers)

    def launch(self, fn: Callable[..., Any], nprocs: int, *args: Any) -> list[Any]:
        """Runs ``fn(*args)`` on ranks 0..nprocs-1 of a fresh job; returns the results by rank."""
        if not 1 <= nprocs <= self.size:
            raise ValueError(f"nprocs={nprocs} must be between 1 and the pool size {self.size}")
        rank_device(self.backend, nprocs - 1, self.device)  # (NCCL: a GPU for every rank)
        for attempt in range(1, JOIN_ATTEMPTS + 1):
            try:
                return self._run(fn, nprocs, args)
            except _NotJoined as e:
                if attempt == JOIN_ATTEMPTS:
                    raise RankError(e.rank, f"{e.detail}\n(the ranks failed to connect {attempt} times)") from None
                warnings.warn(f"rank {e.rank} failed to connect to the others; starting the job's "
                              f"{nprocs} processes again:\n{e.detail.strip().splitlines()[-1]}", stacklevel=2)
        raise AssertionError("unreachable")

    def _run(self, fn: Callable[..., Any], nprocs: int, args: tuple) -> list[Any]:
        workers = self._ready(nprocs)
        self._jobs += 1
        # the parent serves the rendezvous store, so its port stays taken for the whole job (no race for it)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        job, port, payload = self._jobs, store.port, cloudpickle.dumps((fn, args))
        for rank, worker in enumerate(workers):
            worker.tasks.put((job, rank, nprocs, port, self.backend, self.device, payload))
        try:
            return self._collect(job, workers, attempt_store(store))
        except BaseException:
            self._stop(range(nprocs))  # ranks may be blocked in a collective with the failed one
            raise
        finally:
            del store

    def _collect(self, job: int, workers: list[_Worker], store: Any) -> list[Any]:
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        unjoined: set[int] = set()  # ranks that failed to join the job's process group (before running fn)
        deadline = None  # once a rank fails, wait briefly for the others to report, then pick the cause
        pending = {w.results: rank for rank, w in enumerate(workers)}
        while pending and (deadline is None or time.monotonic() < deadline):
            for conn in wait(list(pending), timeout=0.2):
                rank = pending[conn]
                try:
                    got_job, _, ok, data, phase = conn.recv()
                except (EOFError, OSError):  # the process is gone
                    del pending[conn]
                    workers[rank].process.join(timeout=GRACE_S)
                    failures[rank] = _reason(store) or f"the process died with exit code {workers[rank].process.exitcode}"
                    continue
                if got_job != job:
                    continue
                del pending[conn]
                if ok:
                    results[rank] = cloudpickle.loads(data)
                else:
                    failures[rank] = data
                    if phase == "connect":
                        unjoined.add(rank)
            if results and pending and not failures:  # a rank still inside a call that one whose job returned skipped
                failures.update(_stranded(store, set(pending.values()), set(results)))
                for rank in failures:
                    pending = {c: r for c, r in pending.items() if r != rank}
            if failures and deadline is None:
                deadline = time.monotonic() + GRACE_S
        if failures:
            rank = min(failures, key=lambda r: (_is_consequence(failures[r]), r))
            if not results and set(failures) <= unjoined and _is_transient(failures[rank]):  # no rank ran fn
                raise _NotJoined(rank, failures[rank])
            raise RankError(rank, failures[rank])
        return [results[r] for r in range(len(workers))]

    def _stop(self, indices: Iterable[int]) -> None:
        stopped = [w for i in indices if i < len(self._workers) and (w := self._workers[i]) is not None]
        for w in stopped:
            if w.process.pid is not None and w.process.is_alive():  # a failed start leaves one never started
                w.process.kill()
        for w in stopped:
            if w.process.pid is not None:
                w.process.join(timeout=5)
            w.results.close()
        for i in indices:
            if i < len(self._workers):
                self._workers[i] = None

    def close(self) -> None:
        self._stop(range(len(self._workers)))
        self._workers = []

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _NotJoined(Exception):
    """The job's ranks failed to connect to each other before any ran the job's function."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(rank, detail)
        self.rank, self.detail = rank, detail


def _reason(store: Any) -> str | None:
    """What a rank that stopped the job for being out of step wrote (runtime/progress.py)."""
    try:
        return store.get(progress.FAILURE).decode() if store.check([progress.FAILURE]) else None
    except Exception:  # noqa: BLE001 - the job's store is gone
        return None


def _stranded(store: Any, pending: set[int], ended: set[int]) -> dict[int, str]:
    """Ranks waiting inside a call for a rank whose job returned before making it: rank -> why."""
    ranks = pending | ended
    try:
        runtimes = max(store.add(progress.RUNTIMES.format(rank=r), 0) for r in ranks)
    except Exception:  # noqa: BLE001 - the job's store is gone
        return {}
    found = {}
    for index in range(1, runtimes + 1):
        states = {r: progress.read(store, index, r) for r in ranks}
        for rank in sorted(pending - set(found)):
            mine = states[rank]
            reason = desync(rank, mine, states, ended) if mine is not None else None
            if reason is not None:
                found[rank] = reason
    return found


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, backend: str | None = None,
           device: str | None = None) -> list[Any]:
    """Runs ``fn(*args)`` on ``nprocs`` local ranks; results by rank. By default NCCL with one GPU per rank
    where CUDA is available, else gloo on the CPU; ``device="cpu"`` keeps CUDA machines' ranks on the CPU,
    ``backend="gloo", device="cuda"`` lets ranks share GPUs."""
    with WorkerPool(nprocs, backend=backend, device=device) as pool:
        return pool.launch(fn, nprocs, *args)


