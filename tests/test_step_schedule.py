"""Whole steps as schedules: the lowering, the simulator's checks of step actions, and the executor's timeline."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import models
from autopar import Mesh, parallelize
from autopar.core.schedule import (
    B, BROADCAST_LOSS, BROADCAST_OUTPUTS, F, OPTIMIZER, RECV_B, RECV_F, REDUCE_GRAD, REDUCE_SHARED, RESHARD, SEND_B,
    SEND_F, UNSHARD, Action, Schedule, looped_placement, parse_program,
)
from autopar.core.schedules import make_schedule
from autopar.core.simulate import ScheduleError, simulate
from autopar.core.step_schedule import forward_step, last_backwards, local_schedule, training_step


def _kinds(program: tuple[Action, ...]) -> list[str]:
    return [a.kind for a in program]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]), st.integers(1, 4), st.integers(1, 3),
       st.booleans(), st.booleans(), st.sets(st.integers(0, 3)))
def test_training_steps_simulate_with_the_pipelines_bubble(name: str, p: int, k: int, reduce_grad: bool,
                                                          unshard: bool, shared: set[int]) -> None:
    v = 2 if name == "interleaved-1f1b" else 1
    pipeline = make_schedule(name, p, p * k, v)
    shared = {r for r in shared if r < p}
    if len(shared) == 1:
        shared = set()  # a parameter is shared by two ranks or more
    step = training_step(pipeline, reduce_grad=reduce_grad, unshard=unshard, shared_ranks=shared)
    assert simulate(step).bubble_fraction == pytest.approx(simulate(pipeline).bubble_fraction)
    for rank, program in enumerate(step.actions):
        tail = [REDUCE_GRAD] * reduce_grad + [REDUCE_SHARED] * (rank in shared) + [OPTIMIZER, BROADCAST_LOSS]
        assert _kinds(program)[-len(tail):] == tail
        for stage in step.stages_of(rank):
            if unshard:
                mine = [i for i, a in enumerate(program) if a.stage == stage]
                assert program[mine[0]] == Action(stage, UNSHARD) and program[mine[-1]] == Action(stage, RESHARD)
            else:
                assert UNSHARD not in _kinds(program)


def test_training_step_text() -> None:
    step = training_step(make_schedule("1f1b", 2, 2), reduce_grad=True, unshard=True, shared_ranks={0, 1})
    assert str(step).splitlines() == [
        "rank 0: 0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0RESHARD "
        "REDUCE_GRAD REDUCE_SHARED OPTIMIZER BROADCAST_LOSS",
        "rank 1: 1UNSHARD 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RESHARD "
        "REDUCE_GRAD REDUCE_SHARED OPTIMIZER BROADCAST_LOSS",
    ]


def test_a_model_without_pipeline_is_one_stage() -> None:
    step = training_step(local_schedule(3), reduce_grad=True, unshard=False)
    assert str(step) == "rank 0: 0F0 0B0 0F1 0B1 0F2 0B2 REDUCE_GRAD OPTIMIZER BROADCAST_LOSS"
    assert last_backwards(step.actions[0]) == {Action(0, B, 2)}
    simulate(step)


@pytest.mark.parametrize("p, v, m", [(1, 1, 3), (2, 1, 4), (2, 2, 2), (4, 2, 8)])
def test_forward_steps_simulate(p: int, v: int, m: int) -> None:
    step = forward_step(p, p * v, m, unshard=True)
    assert step.is_forward_only
    simulate(step)
    for program in step.actions:
        assert program[-1] == Action(None, BROADCAST_OUTPUTS) and B not in _kinds(program)


def test_last_backwards_per_stage_of_interleaved() -> None:
    step = training_step(make_schedule("interleaved-1f1b", 2, 2, 2), reduce_grad=True, unshard=False)
    assert last_backwards(step.actions[0]) == {Action(0, B, 1), Action(2, B, 1)}
    assert last_backwards(training_step(make_schedule("1f1b", 2, 2), reduce_grad=False, unshard=False).actions[0]) \
        == set()  # no reduction: nothing to arm


def _schedule(*programs: str, n_stages: int = 2, m: int = 1) -> Schedule:
    n = len(programs)
    return Schedule(n, n_stages, m, looped_placement(n, n_stages), [parse_program(p) for p in programs])


@pytest.mark.parametrize("programs, message", [
    (("0F0 OPTIMIZER 0B0",), "OPTIMIZER before 0B0: the step's collectives come after"),
    (("0F0 0B0 OPTIMIZER OPTIMIZER",), "runs OPTIMIZER twice"),
    (("0F0 0UNSHARD 0B0",), "0UNSHARD out of place: it belongs before its first action"),
    (("0UNSHARD 0F0 0RESHARD 0B0",), "0RESHARD out of place: it belongs after its last action"),
])
def test_misplaced_step_actions_are_named(programs: tuple[str, ...], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        simulate(_schedule(*programs, n_stages=1))


def test_collectives_in_different_orders_deadlock() -> None:
    ok = _schedule("0F0 0SEND_F0 0RECV_B0 0B0 REDUCE_SHARED OPTIMIZER",
                   "1RECV_F0 1F0 1B0 1SEND_B0 REDUCE_SHARED OPTIMIZER")
    simulate(ok)
    crossed = _schedule("0F0 0SEND_F0 0RECV_B0 0B0 OPTIMIZER REDUCE_SHARED",
                        "1RECV_F0 1F0 1B0 1SEND_B0 REDUCE_SHARED OPTIMIZER")
    with pytest.raises(ScheduleError, match="deadlock: rank 0 is stuck at OPTIMIZER waiting for rank 1 to reach it; "
                       "rank 1 is stuck at REDUCE_SHARED waiting for rank 0 to reach it"):
        simulate(crossed)


def test_a_collective_waits_for_the_last_rank() -> None:
    """The loss broadcast starts when the last stage's rank has finished its backwards."""
    step = training_step(make_schedule("1f1b", 2, 2), reduce_grad=False, unshard=False)
    events = [e for e in simulate(step).timeline if e.action.kind == BROADCAST_LOSS]
    last_compute = max(e.end for e in simulate(step).timeline if e.action.kind in (F, B))
    assert [e.start for e in events] == [last_compute, last_compute]


# --- the executor runs the program ---------------------------------------------------------------


def _step_timeline() -> tuple[list[str], list[str]]:
    torch.manual_seed(0)
    model = models.gpt2(layers=2)
    ids = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))
    pm = parallelize(model, Mesh(dp=2, pp=2), loss_fn=models.lm_loss, optimizer=models.adamw, zero=3,
                     microbatches=2)
    pm.step(ids, target=ids)
    train = [a for a, _, _ in pm.timeline()]
    pm(ids)
    return train, [a for a, _, _ in pm.timeline()]


def test_the_executor_runs_the_whole_step(launcher) -> None:
    runs = launcher(_step_timeline, 4)
    for rank, (train, forward) in enumerate(runs):
        pp = rank % 2
        assert train[0] == f"{pp}UNSHARD" and train[-5] == f"{pp}RESHARD"
        assert train[-4:] == ["REDUCE_GRAD", "REDUCE_SHARED", "OPTIMIZER", "BROADCAST_LOSS"]  # tied embeddings
        assert forward[0] == f"{pp}UNSHARD" and forward[-1] == "BROADCAST_OUTPUTS"
        assert not any(Action.parse(a).kind == B for a in forward)


class _Waited:
    """A send's work that notes the index of the action running when it is waited for."""

    def __init__(self, work, note) -> None:
        self.work, self.note = work, note

    def wait(self, *args) -> bool:
        self.note()
        return self.work.wait(*args)


def _refuse_blocking(program: list[str], running: int) -> None:
    """Fails the rank at once where a send would wait for its transfer within the pipeline's actions: that
    wait needs the peer's receive, which 1F1B posts only after the peer's own send (a deadlock that gloo ends
    only after its 300 s timeout)."""
    action = program[running] if running < len(program) else "the step's end"
    if action not in ("REDUCE_GRAD", "BROADCAST_LOSS", "BROADCAST_OUTPUTS", "the step's end"):
        raise AssertionError(f"a pipeline send waits for its transfer at action {running} ({action})")


def _message_posts() -> tuple[list[str], dict[int, set[int]], list[int]]:
    """The actions of a 1F1B step on pp=2; per action index the messages (tags) whose receives were posted
    while it ran; the action indices at which each send was waited for. From the first step on, a send waited
    for within the pipeline's actions fails the rank at once (``_refuse_blocking``)."""
    import torch.distributed as dist

    from autopar.runtime.step_executor import Executor

    torch.manual_seed(0)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pm = parallelize(models.mlp((6, 16, 16, 6)), Mesh(pp=2), loss_fn=models.mse, optimizer=models.sgd,
                     schedule="1f1b", microbatches=4)
    posts: dict[int, set[int]] = {}  # (of the last step run)
    waits: list[int] = []
    now: dict = {}  # the running executor and its program
    run, irecv, isend, send = Executor.run, dist.irecv, dist.isend, dist.send

    def running() -> int:
        return len(now["executor"].timeline)

    def traced(executor: Executor, program, *args, **kwargs):
        posts.clear(), waits.clear()
        now.update(executor=executor, program=[str(a) for a in program])
        return run(executor, program, *args, **kwargs)

    def posting(tensor: torch.Tensor, src: int, *args, tag: int = 0, **kwargs):
        posts.setdefault(running(), set()).add(tag // 64)  # (one tag per message; tensors add ``i < 64``)
        return irecv(tensor, src, *args, tag=tag, **kwargs)

    def waited() -> None:
        waits.append(running())
        _refuse_blocking(now["program"], waits[-1])

    def sending(*args, **kwargs):
        return _Waited(isend(*args, **kwargs), waited)

    def blocking(*args, **kwargs):
        _refuse_blocking(now["program"], running())
        return send(*args, **kwargs)

    Executor.run, dist.irecv, dist.isend, dist.send = traced, posting, sending, blocking
    try:
        pm.step(x, target=y)  # (compiles)
        pm.step(x, target=y)
    finally:
        Executor.run, dist.irecv, dist.isend, dist.send = run, irecv, isend, send
    return [a for a, _, _ in pm.timeline()], posts, waits


def test_receives_are_posted_one_ahead_and_sends_complete_at_the_steps_end(launcher) -> None:
    """Numbers cannot show either: a RECV action finds its message's receive already posted (by the RECV
    before it, which posts the program's next one before it waits), and a SEND does not wait for its transfer
    (``isend``, completed before the step's first collective; a send that waits within the pipeline's actions
    fails at once, where a deadlock would end only by gloo's 300 s timeout)."""
    for rank, (actions, posts, waits) in enumerate(launcher(_message_posts, 2)):
        receives = [i for i, a in enumerate(actions) if Action.parse(a).kind in (RECV_F, RECV_B)]
        sends = [i for i, a in enumerate(actions) if Action.parse(a).kind in (SEND_F, SEND_B)]
        assert len(receives) == len(sends) == 4, (rank, actions)
        assert set(posts) == set(receives[:-1]), (rank, actions, posts)  # the last RECV finds nothing to post
        assert [len(posts[i]) for i in receives[:-1]] == [2, 1, 1], (rank, posts)  # the first posts its own too
        collective = next(i for i, a in enumerate(actions) if a in ("REDUCE_GRAD", "BROADCAST_LOSS"))
        assert len(waits) == 4 and set(waits) == {collective}, (rank, actions, waits)
