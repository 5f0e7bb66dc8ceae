"""Pipeline schedules as plain data: no TensorFlow needed."""

import subprocess
import sys

import pytest

from tfpar.errors import ScheduleError
from tfpar.plan.schedule import (
    BACKWARD, FORWARD, SCHEDULES, Action, Schedule, bubble_fraction, execution_order,
    format_table, gpipe, grid, make_schedule, max_in_flight, one_f_one_b, timeline, validate)

# Derived by hand. 1F1B: stage s warms up with min(K - 1 - s, M) forwards, then
# alternates F/B, then drains the remaining backwards.
EXPECTED = {
    ("gpipe", 2, 2): ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"],
    ("gpipe", 1, 3): ["0F0 0F1 0F2 0B0 0B1 0B2"],
    ("1f1b", 2, 4): ["0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3",
                     "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"],
    ("1f1b", 4, 4): ["0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3",
                     "1F0 1F1 1F2 1B0 1F3 1B1 1B2 1B3",
                     "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2B3",
                     "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3"],
    # Fewer micro-batches than stages: warm-up is capped at M.
    ("1f1b", 4, 2): ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1",
                     "2F0 2F1 2B0 2B1", "3F0 3B0 3F1 3B1"],
}


@pytest.mark.parametrize("name,k,m", sorted(EXPECTED))
def test_expected_stage_orders(name, k, m):
    schedule = make_schedule(name, k, m)
    assert schedule.to_strings() == EXPECTED[name, k, m]
    assert (schedule.name, schedule.num_stages, schedule.num_micro_batches) == (name, k, m)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("k", range(1, 7))
@pytest.mark.parametrize("m", range(1, 11))
def test_schedule_table(name, k, m):
    schedule = make_schedule(name, k, m)
    validate(schedule)
    for s, order in enumerate(schedule.stage_orders):
        expected = {Action(s, kind, mb) for kind in (FORWARD, BACKWARD) for mb in range(m)}
        assert len(order) == 2 * m and set(order) == expected
        for mb in range(m):
            assert order.index(Action(s, FORWARD, mb)) < order.index(Action(s, BACKWARD, mb))
        backwards = [a.micro_batch for a in order if a.kind == BACKWARD]
        assert backwards == list(range(m))
    # Both schedules have the same bubble with equal forward and backward costs.
    assert bubble_fraction(schedule) == pytest.approx((k - 1) / (m + k - 1))
    peaks = max_in_flight(schedule)
    if name == "gpipe":
        assert peaks == [m] * k
    else:
        assert peaks == [min(k - s, m) for s in range(k)]
        assert max(peaks) <= k
    order = execution_order(schedule)
    assert len(order) == 2 * k * m
    position = {a: i for i, a in enumerate(order)}
    for stage_order in schedule.stage_orders:
        assert [position[a] for a in stage_order] == sorted(position[a] for a in stage_order)
    for a in order:
        if a.kind == FORWARD and a.stage > 0:
            assert position[Action(a.stage - 1, FORWARD, a.micro_batch)] < position[a]
        if a.kind == BACKWARD and a.stage < k - 1:
            assert position[Action(a.stage + 1, BACKWARD, a.micro_batch)] < position[a]


def test_timeline_gpipe_unit_costs():
    entries, makespan = timeline(gpipe(2, 2))
    assert makespan == 6  # 2 * (M + K - 1)
    assert [(start, end, str(a)) for start, end, a in entries] == [
        (0, 1, "0F0"), (1, 2, "0F1"), (1, 2, "1F0"), (2, 3, "1F1"),
        (3, 4, "1B0"), (4, 5, "0B0"), (4, 5, "1B1"), (5, 6, "0B1")]


def test_timeline_uneven_costs():
    # Backward twice the forward: K=2, M=2 GPipe runs F for 3 slots then B for 3 * 2.
    entries, makespan = timeline(gpipe(2, 2), forward_cost=1, backward_cost=2)
    assert makespan == 9
    busy = 2 * (2 * 1 + 2 * 2)
    assert bubble_fraction(gpipe(2, 2), 1, 2) == pytest.approx(1 - busy / (2 * 9))
    assert bubble_fraction(gpipe(2, 2), 0.5, 1.0) == pytest.approx(1 - 6 / 9)


@pytest.mark.parametrize("cost", [0, -1, "1", True])
def test_timeline_rejects_bad_costs(cost):
    with pytest.raises(ScheduleError, match=r"forward_cost must be a number > 0"):
        timeline(gpipe(2, 2), forward_cost=cost)


def test_grid_one_f_one_b():
    steps = grid(one_f_one_b(2, 2))
    assert [[str(a) if a else None for a in step] for step in steps] == [
        ["0F0", None], ["0F1", "1F0"], [None, "1B0"], ["0B0", "1F1"],
        [None, "1B1"], ["0B1", None]]


def test_format_table():
    text = format_table(gpipe(4, 4))
    lines = text.splitlines()
    assert lines[0].split() == ["step"] + [str(t) for t in range(14)]
    assert lines[1].split() == ["stage", "0", "0F0", "0F1", "0F2", "0F3"] + ["."] * 6 + [
        "0B0", "0B1", "0B2", "0B3"]
    assert lines[4].split()[2:6] == [".", ".", ".", "3F0"]
    assert len({len(line) for line in lines[:5]}) == 1  # fixed-width columns
    assert lines[-1] == "bubble fraction: 0.429 (gpipe, 4 stages, 4 micro-batches)"
    assert "bubble fraction: 0.000 (1f1b, 1 stage, 1 micro-batch)" in format_table(
        one_f_one_b(1, 1))


def test_format_table_wide_cells_stay_aligned():
    lines = format_table(one_f_one_b(4, 16)).splitlines()
    assert len({len(line) for line in lines[:5]}) == 1
    assert "0F10" in lines[1] and "3B15" in lines[4]
    assert lines[-1] == "bubble fraction: 0.158 (1f1b, 4 stages, 16 micro-batches)"


@pytest.mark.parametrize("text", ["1F0", "0B3", "12F15"])
def test_action_parse_round_trips(text):
    assert str(Action.parse(text)) == text


def test_action_str():
    assert str(Action(1, "F", 0)) == "1F0"
    assert Action.parse("2B7") == Action(2, BACKWARD, 7)


@pytest.mark.parametrize("text", ["1X0", "F0", "1F", "", "a1F0", 10])
def test_action_parse_rejects_bad_text(text):
    with pytest.raises(ScheduleError, match=r"<stage><F\|B><micro_batch>"):
        Action.parse(text)


def custom(*rows):
    """A hand-written schedule for 2 stages and 2 micro-batches."""
    orders = Schedule.from_strings(rows, 2).stage_orders
    return Schedule(2, 2, "custom", orders)


@pytest.mark.parametrize("schedule,message", [
    (custom("0F0 0F1 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"), r"Stage 0 runs 0F1 \(2 times\)"),
    (custom("0F0 0F1 0B0", "1F0 1F1 1B0 1B1"), r"Stage 0 never runs 0B1"),
    (custom("0F0 0F1 0B0 0B1", "1F0 1B1 1F1 1B0"), r"Stage 1 runs 1B1 before 1F1"),
    (custom("0F0 0F1 0B0 0B1", "1F0 0F1 1B0 1B1"),
     r"Action 0F1 is in stage 1's list but names stage 0"),
    (custom("0F0 0F1 0B0 0B1", "1F0 1F1 1B0 2B1"),
     r"Action 2B1 names stage 2, but stages run 0..1"),
    (custom("0F0 0F1 0F2 0B0 0B1", "1F0 1F1 1B0 1B1"),
     r"Action 0F2 names micro-batch 2, but there are 2 micro-batches \(0..1\)"),
    (custom("0F0 0F1 0B0 0B1"), r"2 stages needs one action list per stage. Received 1"),
])
def test_validate_rejects(schedule, message):
    with pytest.raises(ScheduleError, match=message):
        validate(schedule)


def test_validate_detects_deadlock():
    # Stage 0 waits in 0B0 for 1B0; stage 1 first waits in 1F1 for 0F1, which stage 0
    # only runs after 0B0: a cyclic wait, though each stage alone looks fine.
    schedule = custom("0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1")
    with pytest.raises(ScheduleError, match=r"would deadlock: stage 0 at 0B0 \(waits for 1B0\); "
                                            r"stage 1 at 1F1 \(waits for 0F1\)"):
        validate(schedule)
    with pytest.raises(ScheduleError, match="deadlock"):
        timeline(schedule)


def test_validate_accepts_a_valid_custom_order():
    # Any order whose waits resolve is fine, e.g. stage 1 reversing its micro-batches.
    validate(custom("0F0 0F1 0B1 0B0", "1F1 1F0 1B1 1B0"))


@pytest.mark.parametrize("k,m,message", [
    (2, 0, r"num_micro_batches must be an integer >= 1. Received: num_micro_batches=0"),
    (0, 2, r"num_stages must be an integer >= 1. Received: num_stages=0"),
    (2.0, 2, r"num_stages must be an integer >= 1. Received: num_stages=2.0"),
    (2, True, r"Received: num_micro_batches=True"),
    ("2", 2, r"Received: num_stages='2'"),
])
@pytest.mark.parametrize("name", SCHEDULES)
def test_bad_arguments(name, k, m, message):
    with pytest.raises(ScheduleError, match=message):
        make_schedule(name, k, m)


def test_unknown_schedule_name():
    with pytest.raises(ValueError, match=r"Unknown schedule 'zero_bubble'. Use one of: "
                                         r"'gpipe', '1f1b'"):
        make_schedule("zero_bubble", 2, 2)
    assert issubclass(ScheduleError, ValueError)


def test_import_does_not_import_tensorflow():
    subprocess.run(
        [sys.executable, "-c",
         "import tfpar.plan.schedule, sys; assert 'tensorflow' not in sys.modules"],
        check=True)
