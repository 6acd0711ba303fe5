"""The step simulation of ranks that share a node's cores (``autopar.planner.core_sharing``).

- With a core per rank it agrees with the schedule dry run (``autopar.core.simulate``)
  on every schedule, size and message time hypothesis draws.
- Processor sharing: n busy ranks on c < n cores each run at c / n of their speed;
  a pipeline that keeps at most c ranks busy runs as on cores of its own.
- A message takes its loaded time only when every core is taken.
- A program that waits for a task that never runs raises, naming the rank.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.core.schedules import make_schedule
from autopar.core.simulate import simulate
from autopar.planner.core_sharing import Comm, Phase, Task, makespan, step_programs


def _pipeline(schedule_name: str, pp: int, m: int, v: int, f: float, b: float, hop: Comm,
              tail: list[Phase] | None = None) -> list[list[Task]]:
    schedule = make_schedule(schedule_name, pp, m, v)
    n = schedule.n_stages
    return step_programs(schedule, [Phase(f)] * n, [Phase(b)] * n, [hop] * n, [hop] * n,
                         [tail or [] for _ in range(pp)], m)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]), pp=st.integers(1, 4), k=st.integers(1, 3),
       f=st.floats(0.1, 3.0), b=st.floats(0.1, 5.0), hop=st.floats(0.0, 1.0))
def test_with_a_core_per_rank_it_agrees_with_the_schedule_dry_run(name: str, pp: int, k: int, f: float, b: float,
                                                                   hop: float) -> None:
    v = 2 if name == "interleaved-1f1b" and pp > 1 else 1
    m = pp * k if v > 1 else k + pp - 1  # interleaving needs a multiple of pp microbatches
    programs = _pipeline(name, pp, m, v, f, b, Comm(hop, hop))
    want = simulate(make_schedule(name, pp, m, v), f, b, hop).makespan
    assert makespan(programs) == pytest.approx(want)
    assert makespan(programs, cores=pp) == pytest.approx(want)  # never more busy ranks than cores


def test_busy_ranks_beyond_the_cores_share_them() -> None:
    one = [[Task(("work",), (Phase(1.0),))]]
    assert makespan(one, replicas=4, cores=2) == pytest.approx(2.0)
    assert makespan(one, replicas=2, cores=2) == pytest.approx(1.0)
    # two ranks, one with twice the work: both at half speed while both run, then the longer alone
    two = [[Task(("a",), (Phase(1.0),))], [Task(("b",), (Phase(2.0),))]]
    assert makespan(two, cores=1) == pytest.approx(3.0)
    assert makespan(two, replicas=2, cores=2) == pytest.approx(3.0)


def test_a_pipeline_keeping_at_most_cores_ranks_busy_runs_as_on_its_own_cores() -> None:
    # 1F1B with 2 microbatches on 4 stages: at most 2 microbatches, so at most 2 ranks, compute at once
    programs = _pipeline("1f1b", 4, 2, 1, 1.0, 2.0, Comm())
    assert makespan(programs, cores=2) == pytest.approx(makespan(programs)) == pytest.approx((2 + 4 - 1) * 3.0)
    # with 2 replicas of each rank the same pipeline runs at half speed whenever 2 stages compute at once
    assert makespan(programs, replicas=2, cores=2) > 1.2 * makespan(programs)


def test_a_message_waits_longer_only_when_every_core_is_taken() -> None:
    hop = Comm(loaded=1.0, free=0.1)
    producer = [Task(("x",), (Phase(1.0),))]
    consumer = [Task(("y",), (Phase(1.0),), ((("x",), hop),))]
    assert makespan([producer, consumer], cores=2) == pytest.approx(2.1)
    # two replicas of each: when x ends, the 2 receivers are all that is active on the 2 cores
    assert makespan([producer, consumer], replicas=2, cores=2) == pytest.approx(2.1)
    # a third rank in a collective at that moment (active, but using no core) leaves no core free on 1 core
    waiter = [Task(("w",), (Phase(0.0, Comm(1.5, 1.5)),))]
    assert makespan([producer, consumer, waiter], cores=2) == pytest.approx(2.1)
    assert makespan([producer, consumer, waiter], cores=1) == pytest.approx(3.0)


def test_phases_run_work_then_communication() -> None:
    task = Task(("t",), (Phase(1.0, Comm(0.5, 0.2)), Phase(2.0)))
    assert makespan([[task]]) == pytest.approx(1.0 + 0.2 + 2.0)
    assert makespan([[task]], replicas=4, cores=2) == pytest.approx(2.0 + 0.5 + 4.0)


def test_waiting_for_a_task_that_never_runs_raises() -> None:
    programs = [[Task(("a",), (Phase(1.0),), ((("missing",), Comm()),))]]
    with pytest.raises(ValueError, match=r"deadlocks: rank 0 at \('a',\)"):
        makespan(programs)
