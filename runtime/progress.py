"""Which ``ParallelModel`` call each rank is in, kept in the job's store: ranks that fall out of step stop
with an error naming both, instead of waiting in a collective until the timeout.

Every rank runs the same calls in the same order (``step``, the forward ``pm(...)``, ``save``, ``load``): each
one's collectives pair with the other ranks' same call. A plain ``for`` loop over loaders of different lengths
breaks that: one rank leaves the loop and returns (or saves, or exits) while the others wait in their next
step for it. On entering and leaving each call a rank writes ``calls kind in|out|exit steps`` under
``progress/<index>/<rank>`` of the job's store (one store write, no collective; ``index`` counts the
``ParallelModel`` runtimes a rank started in the job, the same on every rank). A rank that has waited inside a call for
``AUTOPAR_DESYNC_CHECK_S`` seconds (default 5) reads the others' records; ``desync`` finds the ones that can
never arrive:

- a rank that ended (its job returned, or its process exited) after fewer calls than the waiting one made;
- a rank inside another kind of call at the same count (one saves while another steps).

The waiting rank then writes the reason under ``failure``, prints it and exits (its collective cannot
be interrupted); the others see their peer's connection close, and ``Progress.call`` turns that error into the
same reason. ``autopar.launch`` reads the reason for the rank it names, and also checks the ranks whose jobs
returned against those still inside a call.

A rank that is slow to come back (data loading) is not called out by those checks. One that stays away is:
where a waiting rank has seen a peer's record unchanged, outside the call it waits in, for ``AUTOPAR_STALL_S``
seconds (default nine tenths of the collectives' timeout, ``AUTOPAR_TIMEOUT_S``), it stops the job naming that
peer and where it was last seen (``stalled``), before the collective's timeout would have stopped it without.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

from autopar.runtime.groups import TIMEOUT

KEY = "progress/{index}/{rank}"  # (index: the how-manieth runtime of the job on every rank, from 1)
RUNTIMES = "runtimes/{rank}"
FAILURE = "failure"
CHECK_S = float(os.environ.get("AUTOPAR_DESYNC_CHECK_S", "5"))


def stall_s() -> float:
    """Seconds a peer may stay away from the call another rank waits in before the job stops naming it."""
    return float(os.environ.get("AUTOPAR_STALL_S", str(0.9 * TIMEOUT.total_seconds())))


@dataclass(frozen=True)
class State:
    """One rank's record: ``calls`` made (the current one included), the last call's ``kind``, where the rank
    is (``in`` the call, ``out`` of it, or ``exit``: its process ended) and the steps it completed."""

    calls: int
    kind: str
    where: str
    steps: int

    def encode(self) -> str:
        return f"{self.calls} {self.kind} {self.where} {self.steps}"

    @classmethod
    def decode(cls, text: str) -> "State":
        calls, kind, where, steps = text.split()
        return cls(int(calls), kind, where, int(steps))


def _call(kind: str) -> str:
    return "pm(...)" if kind == "forward" else f"pm.{kind}"


def desync(rank: int, mine: State, others: dict[int, State | None], ended: set[int] = frozenset()) -> str | None:
    """Why ``rank`` (inside call ``mine``) can never be joined, or None. ``ended``: ranks whose job returned."""
    if mine.where != "in":
        return None
    for peer, theirs in sorted(others.items()):
        if peer == rank:
            continue
        done = peer in ended or (theirs is not None and theirs.where == "exit")
        made = theirs.calls if theirs is not None else 0
        if done and made < mine.calls:
            return (f"rank {rank} waits in its call {mine.calls} ({_call(mine.kind)}, after {mine.steps} steps) for "
                    f"rank {peer}, which ended after {made} calls ({theirs.steps if theirs else 0} steps): the ranks "
                    f"ran different numbers of steps. Loaders of different lengths do this in a plain for loop; "
                    f"iterate with `for batch in pm.batches(loader)`, which stops every rank at the shortest "
                    f"loader's end, or give every rank the same number of batches")
        if theirs is not None and theirs.where == "in" and theirs.calls == mine.calls and theirs.kind != mine.kind:
            return (f"rank {rank} is in {_call(mine.kind)} (its call {mine.calls}, after {mine.steps} steps) while rank "
                    f"{peer} is in {_call(theirs.kind)} (its call {theirs.calls}, after {theirs.steps} steps): every "
                    f"rank must make the same calls in the same order. A rank that left its loop early (loaders of "
                    f"different lengths) does this; iterate with `for batch in pm.batches(loader)`")
    return None


def stalled(rank: int, mine: State, others: dict[int, State | None], unchanged_s: dict[int, float],
            waited_s: float, limit_s: float) -> str | None:
    """The first peer that ``rank``, inside call ``mine`` for ``waited_s`` seconds, has seen outside that call with
    the same record for ``unchanged_s[peer]`` >= ``limit_s`` seconds, as a reason; or None."""
    if mine.where != "in" or waited_s < limit_s:
        return None
    by_calls = sorted(others.items(), key=lambda kv: (kv[1].calls if kv[1] is not None else 0, kv[0]))
    for peer, theirs in by_calls:  # the peer furthest behind first: those ahead may wait on it too
        if peer == rank or unchanged_s.get(peer, 0.0) < limit_s:
            continue
        if theirs is not None and theirs.calls == mine.calls and theirs.where == "in":
            continue  # waiting with us: another peer holds both up
        last = ("made no call yet" if theirs is None else
                f"was last seen {'inside' if theirs.where == 'in' else 'after'} its call {theirs.calls} "
                f"({_call(theirs.kind)}, after {theirs.steps} steps)")
        return (f"rank {rank} has waited {waited_s:.0f} s in its call {mine.calls} ({_call(mine.kind)}, after "
                f"{mine.steps} steps) for rank {peer}, which {last} and has not moved for {unchanged_s[peer]:.0f} s: "
                f"a rank that stops calling (stuck loading data, in its own code or in a deadlock) does this. "
                f"AUTOPAR_STALL_S={limit_s:g} sets how long a rank may stay away (AUTOPAR_TIMEOUT_S, the "
                f"collectives' timeout, must be longer)")
    return None


def read(store: Any, index: int, rank: int) -> State | None:
    key = KEY.format(index=index, rank=rank)
    try:
        return State.decode(store.get(key).decode()) if store.check([key]) else None
    except Exception:  # noqa: BLE001 - a store that is gone knows nothing
        return None


class Progress:
    """This rank's record in ``store`` and the watchdog that reads the others' while it waits (module doc)."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.index = store.add(RUNTIMES.format(rank=rank), 1)
        self.state = State(0, "none", "out", 0)
        self.entered = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        watch = threading.Thread(target=_watch, args=(weakref.ref(self), self._stop), daemon=True,
                                 name=f"autopar-progress-{rank}")
        watch.start()
        weakref.finalize(self, self._stop.set)
        atexit.register(_exited, weakref.ref(self))

    def _write(self, state: State) -> None:
        with self._lock:
            self.state = state
        with contextlib.suppress(Exception):  # a store that is gone: nothing to tell
            self.store.set(KEY.format(index=self.index, rank=self.rank), state.encode())

    @contextlib.contextmanager
    def call(self, kind: str) -> Iterator[None]:
        """Records the call ``kind`` around its body; a peer's closed connection becomes the reason, if known."""
        s = self.state
        self.entered = time.monotonic()
        self._write(State(s.calls + 1, kind, "in", s.steps))
        try:
            yield
        except RuntimeError as e:
            reason = self.reason()
            if reason is not None:
                raise RuntimeError(reason) from e
            raise
        s = self.state
        self._write(State(s.calls, s.kind, "out", s.steps + (kind == "step")))

    def others(self) -> dict[int, State | None]:
        """The other ranks' records of this runtime."""
        return {r: read(self.store, self.index, r) for r in range(self.world) if r != self.rank}

    def reason(self, patience_s: float = 3.0) -> str | None:
        """Why this rank cannot be joined: one another rank wrote, or one found within ``patience_s`` (a peer
        whose connection closed may still be writing its record on the way out)."""
        end = time.monotonic() + patience_s
        while True:
            with contextlib.suppress(Exception):
                if self.store.check([FAILURE]):
                    return self.store.get(FAILURE).decode()
            found = desync(self.rank, self.state, self.others())
            if found is not None or time.monotonic() > end:
                return found
            time.sleep(0.2)


def _watch(ref: "weakref.ref[Progress]", stop: threading.Event) -> None:
    """Every second: a rank inside one call for ``CHECK_S`` seconds reads the others' records (then less often,
    but at least four times within the stall limit), and stops the job on a desync or a stalled peer."""
    wait, limit = CHECK_S, stall_s()
    seen: dict[int, tuple[State | None, float]] = {}  # peer -> (its record, when this rank first saw it)
    while not stop.wait(1.0):
        progress = ref()
        if progress is None:
            return
        now = time.monotonic()
        if progress.state.where != "in" or now - progress.entered < wait:
            wait = CHECK_S
            del progress
            continue
        others = progress.others()
        seen = {r: (st, seen[r][1] if r in seen and seen[r][0] == st else now) for r, st in others.items()}
        reason = desync(progress.rank, progress.state, others) or stalled(
            progress.rank, progress.state, others, {r: now - t for r, (_, t) in seen.items()},
            now - progress.entered, limit)
        if reason is not None:
            with contextlib.suppress(Exception):
                progress.store.set(FAILURE, reason)
            print(f"autopar: {reason}", file=sys.stderr, flush=True)
            os._exit(1)  # the collective it waits in cannot be interrupted; the others see the connection close
        wait = min(2 * wait, 300.0, max(limit / 4, CHECK_S))  # (a long wait is read less often: many ranks
        del progress  # share one store)


def _exited(ref: "weakref.ref[Progress]") -> None:
    progress = ref()
    if progress is not None:
        s = progress.state
        progress._write(State(s.calls, s.kind, "exit", s.steps))
