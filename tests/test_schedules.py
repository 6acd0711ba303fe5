"""Pipeline schedules: generators, the communication lowering and the dry-run simulator."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.core.schedule import (
    B,
    COMM_KINDS,
    COMPUTE_KINDS,
    F,
    KINDS,
    OPTIMIZER,
    RANK_KINDS,
    UNSHARD,
    Action,
    Schedule,
    add_communication,
    gpipe,
    interleaved_1f1b,
    looped_placement,
    one_f_one_b,
    parse_program,
)
from autopar.core.schedules import make_schedule
from autopar.core.simulate import ScheduleError, Timing, check_channel_order, render, simulate


def schedule_from_text(n_ranks: int, n_stages: int, n_microbatches: int, *programs: str) -> Schedule:
    """A hand-written schedule, one string of actions per rank, stages placed looped."""
    placement = looped_placement(n_ranks, n_stages)
    return Schedule(n_ranks, n_stages, n_microbatches, placement, [parse_program(p) for p in programs])


@st.composite
def schedule_args(draw: st.DrawFn) -> tuple[str, int, int, int]:
    """(name, ranks 1..8, stages per rank 1..4, microbatches 1..16) that the generator accepts."""
    name = draw(st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]))
    p = draw(st.integers(1, 8))
    v = draw(st.integers(1, 4)) if name == "interleaved-1f1b" else 1
    if v > 1:  # interleaving needs a multiple of p microbatches
        m = p * draw(st.integers(1, 16 // p))
    else:
        m = draw(st.integers(1, 16))
    return name, p, v, m


def compute_actions(schedule: Schedule) -> list[list[Action]]:
    return [[a for a in program if a.is_compute] for program in schedule.actions]


# --- every generated schedule is valid --------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(schedule_args())
def test_generated_schedules_simulate_with_and_without_communication(args: tuple[str, int, int, int]) -> None:
    name, p, v, m = args
    schedule = make_schedule(name, p, m, n_stages_per_rank=v)
    assert schedule.is_compute_only
    assert (schedule.n_ranks, schedule.n_stages, schedule.n_microbatches) == (p, p * v, m)
    assert schedule.stage_to_rank == tuple(s % p for s in range(p * v))

    counts = Counter((a.stage, a.kind, a.microbatch) for program in schedule.actions for a in program)
    assert counts == Counter({(s, kind, mb): 1 for s in range(p * v) for kind in (F, B) for mb in range(m)})

    lowered = add_communication(schedule)
    assert compute_actions(lowered) == compute_actions(schedule)
    check_channel_order(lowered)
    for comm_time in (0.0, 0.5):
        plain = simulate(schedule, 1.0, 2.0, comm_time)
        with_comm = simulate(lowered, 1.0, 2.0, comm_time)
        assert with_comm.makespan == pytest.approx(plain.makespan)
        assert with_comm.peak_in_flight == plain.peak_in_flight
    n_comm = sum(len(program) for program in lowered.actions) - 2 * p * v * m
    assert n_comm == (0 if p == 1 else 4 * (p * v - 1) * m)  # a SEND and a RECV per edge, forward and backward


@settings(max_examples=50, deadline=None)
@given(schedule_args())
def test_timeline_is_sequential_per_rank(args: tuple[str, int, int, int]) -> None:
    name, p, v, m = args
    lowered = add_communication(make_schedule(name, p, m, v))
    result = simulate(lowered, 1.0, 2.0, 0.25)
    for rank in range(p):
        events = [e for e in result.timeline if e.rank == rank]
        assert [e.action for e in events] == list(lowered.actions[rank])
        assert all(a.end <= b.start for a, b in zip(events, events[1:]))
        assert result.busy_time[rank] == pytest.approx(v * m * 3.0)
    assert max(e.end for e in result.timeline) == result.makespan


@settings(max_examples=60, deadline=None)
@given(schedule_args(), st.sampled_from([None, "zb-h1", "zbv"]), st.floats(0.5, 2.0), st.floats(1.0, 4.0),
       st.floats(0.1, 0.9), st.sampled_from([0.0, 0.3]))
def test_timing_is_the_simulators_makespan(args: tuple[str, int, int, int], split: str | None, f: float, b: float,
                                           w: float, comm: float) -> None:
    """``Timing`` (the planner's many-durations form) measures what ``simulate`` measures."""
    name, p, v, m = args
    schedule = make_schedule(split or name, p, m, None if split else v)
    want = simulate(schedule, f, b, comm, weight_time=w * b).makespan
    assert Timing.of(schedule).makespan(f, b, comm, weight_time=w * b) == pytest.approx(want)


def test_timing_refuses_a_deadlock_as_the_simulator_does() -> None:
    broken = schedule_from_text(2, 2, 2, "0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0")
    with pytest.raises(ScheduleError, match="deadlock: rank 0 is stuck at 0B0 waiting for 1B0 on rank 1"):
        Timing.of(broken)


# --- bubble and memory against theory ----------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_fraction_equals_theory(name: str) -> None:
    # With F = 1, B = 2 and free communication, both schedules take (m + p - 1) * 3 steps while each
    # rank computes for m * 3: idle / total = (p - 1) / (m + p - 1) exactly.
    for p in range(1, 9):
        for m in range(1, 17):
            result = simulate(make_schedule(name, p, m), forward_time=1.0, backward_time=2.0)
            assert result.makespan == pytest.approx(3 * (m + p - 1))
            assert abs(result.bubble_fraction - (p - 1) / (m + p - 1)) < 1e-9, (name, p, m)


def test_interleaved_bubble_is_smaller_than_1f1b() -> None:
    # Each of the v chunks holds 1/v of the layers; scaling all durations does not change the
    # fraction, so unit times compare fairly. Interleaving divides the bubble time by v:
    # (p - 1) / (v * m + p - 1) against 1F1B's (p - 1) / (m + p - 1).
    for p in range(2, 9):
        for v in range(2, 5):
            for m in range(p, 17, p):
                interleaved = simulate(interleaved_1f1b(p, v, m), 1.0 / v, 2.0 / v).bubble_fraction
                plain = simulate(one_f_one_b(p, m), 1.0, 2.0).bubble_fraction
                assert interleaved < plain, (p, v, m)
                assert abs(interleaved - (p - 1) / (v * m + p - 1)) < 1e-9, (p, v, m)


def test_peak_in_flight() -> None:
    for p in range(1, 9):
        for m in range(1, 17):
            peak_1f1b = simulate(one_f_one_b(p, m)).peak_in_flight
            assert all(peak <= p for peak in peak_1f1b)
            assert peak_1f1b[0] == min(p, m)
            assert peak_1f1b == tuple(min(p - stage, m) for stage in range(p))
            assert simulate(gpipe(p, m)).peak_in_flight == (m,) * p


def test_interleaved_with_one_chunk_is_1f1b() -> None:
    assert interleaved_1f1b(4, 1, 6) == one_f_one_b(4, 6)


# --- the IR -------------------------------------------------------------------------------------


@st.composite
def actions(draw: st.DrawFn) -> Action:
    """Any valid action: stage and microbatch where its kind has them."""
    kind = draw(st.sampled_from(KINDS))
    stage = None if kind in RANK_KINDS else draw(st.integers(0, 10**6))
    microbatch = draw(st.integers(0, 10**6)) if kind in COMPUTE_KINDS + COMM_KINDS else None
    return Action(stage, kind, microbatch)


@given(actions())
def test_action_str_parses_back(action: Action) -> None:
    assert Action.parse(str(action)) == action


def test_step_action_text() -> None:
    assert str(Action(1, UNSHARD)) == "1UNSHARD" and Action.parse("1UNSHARD") == Action(1, UNSHARD)
    assert str(Action(None, OPTIMIZER)) == "OPTIMIZER" and Action.parse("OPTIMIZER") == Action(None, OPTIMIZER)
    for bad in ["OPTIMIZER0", "1OPTIMIZER", "1UNSHARD0", "UNSHARD"]:
        with pytest.raises(ValueError, match="cannot parse action"):
            Action.parse(bad)


def test_action_text() -> None:
    assert str(Action(2, F, 0)) == "2F0"
    assert Action.parse("1SEND_F3") == Action(1, "SEND_F", 3)
    assert Action.parse("0RECV_B2") == Action(0, "RECV_B", 2)
    assert Action.parse("12B34") == Action(12, B, 34)
    for bad in ["", "F0", "2F", "2X0", "-1F0", "2 F 0", "2SEND0", "2f0", "\u0663F0"]:
        with pytest.raises(ValueError, match="cannot parse action"):
            Action.parse(bad)
    with pytest.raises(ValueError, match="unknown action kind 'X'"):
        Action(0, "X", 0)
    with pytest.raises(ValueError, match="microbatch must be an integer >= 0"):
        Action(0, F, -1)


def test_schedule_checks_its_structure() -> None:
    with pytest.raises(ValueError, match="1F0 is in rank 0's program, but stage 1 lives on rank 1"):
        schedule_from_text(2, 2, 1, "1F0", "")
    with pytest.raises(ValueError, match="names microbatch 3, but there are 2"):
        schedule_from_text(1, 1, 2, "0F3")
    with pytest.raises(ValueError, match="talks to stage 2, which does not exist"):
        schedule_from_text(2, 2, 1, "", "1SEND_F0")
    with pytest.raises(ValueError, match="stage_to_rank has 1 entries for 2 stages"):
        Schedule(2, 2, 1, (0,), ((), ()))
    with pytest.raises(ValueError, match=r"ranks \[1\] hold no stage"):
        Schedule(2, 2, 1, (0, 0), ((), ()))
    with pytest.raises(ValueError, match="actions has 1 programs for 2 ranks"):
        Schedule(2, 2, 1, (0, 1), ((),))


def test_generator_errors_name_the_numbers_and_the_fix() -> None:
    with pytest.raises(ValueError, match="1f1b: n_microbatches must be an integer >= 1, got 0"):
        one_f_one_b(4, 0)
    with pytest.raises(ValueError, match="gpipe: n_ranks must be an integer >= 1, got 0"):
        gpipe(0, 4)
    with pytest.raises(ValueError, match=r"multiple of 4; 6 is not\. Use microbatches=4 or 8"):
        interleaved_1f1b(4, 2, 6)
    with pytest.raises(ValueError, match=r"multiple of 4; 3 is not\. Use microbatches=4,"):
        interleaved_1f1b(4, 2, 3)
    with pytest.raises(ValueError, match="known schedules are 'gpipe', '1f1b', 'interleaved-1f1b'"):
        make_schedule("zero-bubble", 4, 8)
    with pytest.raises(ValueError, match="use schedule='interleaved-1f1b'"):
        make_schedule("1f1b", 4, 8, n_stages_per_rank=2)


# --- the lowering -------------------------------------------------------------------------------


def test_add_communication_small_case() -> None:
    lowered = add_communication(one_f_one_b(2, 2))
    assert str(lowered) == (
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1\n"
        "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"
    )


def test_add_communication_skips_stages_on_one_rank() -> None:
    schedule = interleaved_1f1b(1, 3, 2)
    assert add_communication(schedule) == schedule
    with pytest.raises(ValueError, match="already has 0SEND_F0"):
        add_communication(add_communication(gpipe(2, 1)))


# --- the simulator catches broken schedules ---------------------------------------------------


def test_deadlock_two_ranks_receiving_first() -> None:
    broken = schedule_from_text(
        2, 2, 1,
        "0F0 0RECV_B0 0B0 0SEND_F0",
        "1RECV_F0 1F0 1B0 1SEND_B0",
    )
    with pytest.raises(ScheduleError) as info:
        simulate(broken)
    assert str(info.value) == (
        "deadlock: rank 0 is stuck at 0RECV_B0 waiting for 1SEND_B0 on rank 1; "
        "rank 1 is stuck at 1RECV_F0 waiting for 0SEND_F0 on rank 0"
    )


def test_deadlock_without_communication() -> None:
    broken = schedule_from_text(2, 2, 2, "0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0")
    with pytest.raises(ScheduleError, match="deadlock: rank 0 is stuck at 0B0 waiting for 1B0 on rank 1; "
                                            "rank 1 is stuck at 1F1 waiting for 0F1 on rank 0"):
        simulate(broken)


def test_missing_and_duplicated_compute() -> None:
    with pytest.raises(ScheduleError, match=r"stage 1 microbatch 1 has no B \(expected exactly one 1B1 in rank 1's"):
        simulate(schedule_from_text(2, 2, 2, "0F0 0F1 0B0 0B1", "1F0 1F1 1B0"))
    with pytest.raises(ScheduleError, match="stage 0 microbatch 0 has 2 F actions"):
        simulate(schedule_from_text(1, 1, 1, "0F0 0F0 0B0"))


def test_backward_before_forward() -> None:
    with pytest.raises(ScheduleError, match="rank 0 runs 0B0 before 0F0: a microbatch's backward needs its forward"):
        simulate(schedule_from_text(1, 1, 1, "0B0 0F0"))


def test_backward_before_next_stage_backward_on_one_rank() -> None:
    with pytest.raises(ScheduleError, match="rank 0 runs 0B0 before 1B0: it consumes that action's result"):
        simulate(schedule_from_text(1, 2, 1, "0F0 1F0 0B0 1B0"))


def test_unmatched_send_and_receive() -> None:
    with pytest.raises(ScheduleError, match="rank 0: 0SEND_F0 has no matching 1RECV_F0 on rank 1"):
        simulate(schedule_from_text(2, 2, 1, "0F0 0SEND_F0 0B0", "1F0 1B0"))
    with pytest.raises(ScheduleError, match="rank 1: 1RECV_F0 has no matching 0SEND_F0 on rank 0"):
        simulate(schedule_from_text(2, 2, 1, "0F0 0B0", "1RECV_F0 1F0 1B0"))
    with pytest.raises(ScheduleError, match="1SEND_F0 talks to stage 2 on the same rank"):
        simulate(schedule_from_text(1, 3, 1, "0F0 1F0 1SEND_F0 2RECV_F0 2F0 2B0 1B0 0B0"))


def test_compute_without_its_receive() -> None:
    lowered = schedule_from_text(2, 2, 1, "0F0 0RECV_B0 0B0", "1F0 1B0 1SEND_B0")
    with pytest.raises(ScheduleError, match="rank 1 runs 1F0 before 1RECV_F0: its input comes from another rank"):
        simulate(lowered)


def test_send_before_its_compute() -> None:
    with pytest.raises(ScheduleError, match="rank 0 runs 0SEND_F0 before 0F0: a send needs the result it sends"):
        simulate(schedule_from_text(2, 2, 1, "0SEND_F0 0F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"))


def test_channel_order() -> None:
    # Valid when receives are matched by identity, wrong for a transport that matches by order.
    swapped = schedule_from_text(
        2, 2, 2,
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F1 1RECV_F0 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1",
    )
    simulate(swapped)
    with pytest.raises(ScheduleError, match=r"rank 0 -> rank 1: transfer 0 is 0SEND_F0 on rank 0, but rank 1 posts "
                                            r"1RECV_F1 there \(the receive of 0SEND_F1\)"):
        check_channel_order(swapped)


def test_bad_durations() -> None:
    with pytest.raises(ValueError, match="forward_time > 0"):
        simulate(gpipe(2, 2), forward_time=0.0)


def test_comm_time_delays_each_hop() -> None:
    result = simulate(add_communication(gpipe(3, 1)), 1.0, 2.0, comm_time=0.5)
    assert result.makespan == pytest.approx(3 * 1.0 + 3 * 2.0 + 4 * 0.5)


# --- rendering ----------------------------------------------------------------------------------


def test_render_1f1b() -> None:
    assert render(one_f_one_b(2, 3)) == (
        "time   0  1  2  3  4  5  6  7\n"
        "rank 0 F0 F1 .  B0 F2 B1 .  B2\n"
        "rank 1 .  F0 B0 F1 B1 F2 B2 ."
    )
    assert render(add_communication(one_f_one_b(2, 3))) == render(one_f_one_b(2, 3))


def test_render_interleaved_shows_stages() -> None:
    assert render(interleaved_1f1b(2, 2, 2)) == (
        "time   0   1   2   3   4   5   6   7   8   9\n"
        "rank 0 0F0 0F1 2F0 2F1 .   2B0 .   2B1 0B0 0B1\n"
        "rank 1 .   1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1 ."
    )
