"""Step time of ranks that share a node's cores: a pipeline schedule simulated under processor sharing.

On CPU ranks (``Cluster.cores``) a node runs more ranks than it has cores.
Then a pipeline's bubble is not idle time: the ranks that have work get the
cores the waiting ones leave, and while more ranks compute than there are
cores each runs at ``cores / busy`` of its own speed. Messages behave
differently too: a receiver that is waiting wakes at once when a core is
free (tens of microseconds on loopback), but when every core is taken it
must first be scheduled (about a millisecond, the latency
``Cluster.measure_local`` measures under load).

``makespan`` runs every rank's program of ``Task`` s in order, as the runtime
does, and returns when the last rank ends. A task waits for the tasks it
needs on other ranks (plus the message's hop), then runs its phases: some
core-seconds of work, shared with the node's other busy ranks, then
communication whose duration depends on whether the node had a free core
for everyone active when it started. Replicas (the dp and tp ranks of one
pipeline rank) run the same program at the same time.
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.core.schedule import B, F, W, Schedule


@dataclass(frozen=True)
class Comm:
    """Seconds of communication when every core of the node is taken, and when a core is free for each rank."""

    loaded: float = 0.0
    free: float = 0.0

    def at(self, active: int, cores: float) -> float:
        return self.free if active <= cores else self.loaded


@dataclass(frozen=True)
class Phase:
    """Core-seconds of work (the rank alone on a core), then communication."""

    work: float = 0.0
    comm: Comm = Comm()


@dataclass(frozen=True)
class Task:
    """One action of one rank: waits for ``after`` (other ranks' task keys, each with its message hop)."""

    key: tuple
    phases: tuple[Phase, ...]
    after: tuple[tuple[tuple, Comm], ...] = ()


class _Rank:
    def __init__(self, program: list[Task]) -> None:
        self.program = program
        self.pc = 0  # the task running or next to run
        self.phase = -1  # -1: not started
        self.work = 0.0  # core-seconds left of the phase's work
        self.comm_end: float | None = None  # when the phase's communication ends

    @property
    def done(self) -> bool:
        return self.pc >= len(self.program)

    @property
    def active(self) -> bool:
        return not self.done and self.phase >= 0

    @property
    def task(self) -> Task:
        return self.program[self.pc]


def makespan(programs: list[list[Task]], *, replicas: int = 1, cores: float = float("inf")) -> float:
    """Seconds until every rank has run its program; ``replicas`` copies of each rank share ``cores``."""
    ranks = [_Rank(p) for p in programs]
    finished: dict[tuple, float] = {}  # task key -> when it ended
    arrives: dict[tuple, float] = {}  # task key -> when its message reaches the rank that waits for it
    now = 0.0
    while True:
        while (_start_ready(ranks, arrives, now) | _send_messages(ranks, finished, arrives, now, replicas, cores)
               | any([_advance(r, ranks, finished, now, replicas, cores) for r in ranks])):
            pass  # everything that happens at ``now`` without time passing
        if all(r.done for r in ranks):
            return now
        computing = [r for r in ranks if r.active and r.comm_end is None]
        speed = min(1.0, cores / (replicas * len(computing))) if computing else 1.0
        upcoming = [now + r.work / speed for r in computing]
        upcoming += [r.comm_end for r in ranks if r.active and r.comm_end is not None]
        upcoming += [arrives[k] for r in ranks if not r.done and not r.active
                     for k, _ in r.task.after if arrives.get(k, now) > now]
        if not upcoming:
            stuck = [f"rank {i} at {r.task.key}" for i, r in enumerate(ranks) if not r.done]
            raise ValueError(f"the schedule deadlocks: {', '.join(stuck)} wait for tasks that never run")
        step = min(upcoming)
        for r in computing:
            r.work = max(r.work - (step - now) * speed, 0.0)
        now = step


def _start_ready(ranks: list[_Rank], arrives: dict[tuple, float], now: float) -> bool:
    started = False
    for r in ranks:
        if not r.done and not r.active and all(arrives.get(k, now + 1) <= now for k, _ in r.task.after):
            r.phase, r.work, r.comm_end = 0, r.task.phases[0].work, None
            started = True
    return started


def _send_messages(ranks: list[_Rank], finished: dict[tuple, float], arrives: dict[tuple, float], now: float,
                   replicas: int, cores: float) -> bool:
    """Times the messages of finished tasks that a waiting rank needs, by how loaded the node is now."""
    arrived = False
    for r in ranks:
        if r.done or r.active:
            continue
        for key, hop in r.task.after:
            if key in finished and key not in arrives:
                active = replicas * (sum(1 for q in ranks if q.active) + 1)  # the receiver wakes
                arrives[key] = finished[key] + hop.at(active, cores)
                arrived |= arrives[key] <= now
    return arrived


def _advance(r: _Rank, ranks: list[_Rank], finished: dict[tuple, float], now: float, replicas: int,
             cores: float) -> bool:
    """Moves ``r`` past every phase boundary reached at ``now``; whether anything changed."""
    changed = False
    while r.active:
        if r.comm_end is None:
            if r.work > 1e-12:
                return changed
            active = replicas * sum(1 for q in ranks if q.active)
            r.comm_end = now + r.task.phases[r.phase].comm.at(active, cores)
        if r.comm_end > now:
            return changed
        changed = True
        r.phase += 1
        if r.phase < len(r.task.phases):
            r.work, r.comm_end = r.task.phases[r.phase].work, None
            continue
        finished[r.task.key] = now
        r.pc, r.phase, r.comm_end = r.pc + 1, -1, None
    return changed


def step_programs(schedule: Schedule | None, forward: list[Phase], backward: list[Phase], into_forward: list[Comm],
                  into_backward: list[Comm], tails: list[list[Phase]], microbatches: int,
                  weight: list[Phase] | None = None) -> list[list[Task]]:
    """Every pipeline rank's tasks for one training step.

    ``forward[s]`` and ``backward[s]``: one microbatch of stage ``s``;
    ``into_forward[s]``: the message that brings stage ``s`` its input from
    ``s - 1``, ``into_backward[s]`` its output's gradient from ``s + 1``;
    ``tails[r]``: what rank ``r`` runs after its last backward (gradient
    reduction, the optimizer step); ``weight[s]``: stage ``s``'s ``W`` when
    the schedule splits backwards (``backward[s]`` is then its ``B``). Without
    a schedule, one rank runs forward and backward of each microbatch in turn.
    """
    if schedule is None:
        programs = [[Task((0, kind, i), ((forward if kind == F else backward)[0],))
                     for i in range(microbatches) for kind in (F, B)]]
    else:
        last = schedule.n_stages - 1
        programs = []
        for actions in schedule.actions:
            program = []
            for a in actions:
                if a.kind == F:
                    after = (((a.stage - 1, F, a.microbatch), into_forward[a.stage]),) if a.stage > 0 else ()
                    program.append(Task((a.stage, F, a.microbatch), (forward[a.stage],), after))
                elif a.kind == W:
                    program.append(Task((a.stage, W, a.microbatch), (weight[a.stage],)))
                else:
                    after = (((a.stage + 1, B, a.microbatch), into_backward[a.stage]),) if a.stage < last else ()
                    program.append(Task((a.stage, B, a.microbatch), (backward[a.stage],), after))
            programs.append(program)
    return [p + [Task(("tail", r), tuple(tail))] if tail else p for r, (p, tail) in enumerate(zip(programs, tails))]
