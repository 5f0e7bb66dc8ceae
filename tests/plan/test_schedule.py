"""Pipeline schedules as plain data: no TensorFlow needed."""

import dataclasses
import subprocess
from collections import Counter
import sys

import pytest

from tfpar.errors import ScheduleError
from tfpar.plan.schedule import (
    BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action, Schedule, bubble_fraction,
    execution_order, format_table, gpipe, grid, interleaved_1f1b, make_schedule, max_in_flight,
    one_f_one_b, timeline, validate, zero_bubble_h1)

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


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
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
    entries, makespan = timeline(gpipe(2, 2), backward_cost=1)
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
    # A backward costs two forwards, and fills two steps.
    steps = grid(one_f_one_b(2, 2))
    assert [[str(a) if a else None for a in step] for step in steps] == [
        ["0F0", None], ["0F1", "1F0"], [None, "1B0"], [None, "1B0"], ["0B0", "1F1"],
        ["0B0", "1B1"], [None, "1B1"], ["0B1", None], ["0B1", None]]


def test_format_table():
    text = format_table(gpipe(4, 4))
    lines = text.splitlines()
    assert lines[0].split() == ["step"] + [str(t) for t in range(21)]
    assert lines[1].split() == ["stage", "0", "0F0", "0F1", "0F2", "0F3"] + ["."] * 9 + [
        "0B0", "0B0", "0B1", "0B1", "0B2", "0B2", "0B3", "0B3"]
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
    with pytest.raises(ScheduleError, match=r"<stage><F\|B\|I\|W><micro_batch>"):
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
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble_h1", "2bw"])
def test_bad_arguments(name, k, m, message):
    with pytest.raises(ScheduleError, match=message):
        make_schedule(name, k, m)


def test_unknown_schedule_name():
    with pytest.raises(ValueError, match=r"Unknown schedule 'zero_bubble'. Use one of: "
                                         r"'gpipe', '1f1b', 'interleaved_1f1b', "
                                         r"'zero_bubble_h1', '2bw', or a tfpar.plan.schedule"):
        make_schedule("zero_bubble", 2, 2)
    assert issubclass(ScheduleError, ValueError)


def test_import_does_not_import_tensorflow():
    subprocess.run(
        [sys.executable, "-c",
         "import tfpar.plan.schedule, sys; assert 'tensorflow' not in sys.modules"],
        check=True)


# --- Past 1F1B: virtual stages and the split backward -------------------------------------

@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("m", [4, 8, 12])
@pytest.mark.parametrize("v", [1, 2, 3])
def test_interleaved_and_zero_bubble_bubbles_follow_their_formulas(k, m, v):
    """Computed by the dry run with F = I = W = 1, B = 2: interleaved 1F1B's bubble is
    (K-1) / (vM + K-1) of the step (1F1B's shrunk by v); zero-bubble H1's is
    (K-1)(F+I-W) / makespan, (K-1)/(3M + K-1) with one chunk per stage."""
    inter = interleaved_1f1b(k, m, v)
    zero = zero_bubble_h1(k, m, v)
    for schedule in (inter, zero):
        validate(schedule)
        assert schedule.num_chunks == k * v
        for s, order in enumerate(schedule.stage_orders):
            assert {a.stage for a in order} == set(range(s, k * v, k))
    assert bubble_fraction(inter) == pytest.approx((k - 1) / (v * m + k - 1))
    if v == 1:
        assert bubble_fraction(zero) == pytest.approx((k - 1) / (3 * m + k - 1))
        assert inter.to_strings() == one_f_one_b(k, m).to_strings()
    if k > 1:
        assert bubble_fraction(zero) < bubble_fraction(inter) <= bubble_fraction(
            one_f_one_b(k, m)) + 1e-12
    kinds = Counter(a.kind for order in zero.stage_orders for a in order)
    assert kinds == {FORWARD: k * v * m, INPUT_GRAD: k * v * m, WEIGHT_GRAD: k * v * m}
    # F and I keep the interleaved order; W passes only fill in.
    for z, i in zip(zero.stage_orders, inter.stage_orders):
        assert [(a.stage, a.micro_batch, a.kind) for a in z if a.kind != WEIGHT_GRAD] == [
            (a.stage, a.micro_batch, INPUT_GRAD if a.kind == BACKWARD else a.kind) for a in i]


def test_the_issues_k4_m8_figures():
    one, inter, zero = one_f_one_b(4, 8), interleaved_1f1b(4, 8, 2), zero_bubble_h1(4, 8)
    assert round(bubble_fraction(one), 3) == 0.273
    assert bubble_fraction(inter) < bubble_fraction(one)
    assert bubble_fraction(zero) < bubble_fraction(one)
    assert format_table(inter).splitlines()[-1] == (
        "bubble fraction: 0.158 (interleaved_1f1b, 4 stages, 2 virtual stages, "
        "8 micro-batches)")
    assert format_table(zero).splitlines()[-1] == (
        "bubble fraction: 0.111 (zero_bubble_h1, 4 stages, 8 micro-batches)")
    # Interleaved: Megatron's warm-up, 2(K-1-r) + (v-1)K chunk forwards on stage r.
    for r, order in enumerate(inter.stage_orders):
        warm = next(i for i, a in enumerate(order) if a.kind == BACKWARD) - 1
        assert warm == 2 * (4 - 1 - r) + 4


def test_interleaving_needs_micro_batches_in_groups_of_stages():
    with pytest.raises(ScheduleError, match=r"num_micro_batches \(6\) must be a multiple "
                                            r"of num_stages \(4\). Use 8 micro-batches"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ScheduleError, match=r"virtual_stages must be 1"):
        make_schedule("1f1b", 2, 4, virtual_stages=2)


def custom_split(*rows, m=2):
    return Schedule.from_strings(rows, m)


@pytest.mark.parametrize("rows,message", [
    (("0F0 0F1 0I0 0B0 0W0 0B1", "1F0 1F1 1B0 1B1"),
     r"Stage 0 runs 0B0 and 0I0 0W0: a backward is either whole \(B\) or split"),
    (("0F0 0F1 0I0 0B1", "1F0 1F1 1B0 1B1"), r"Stage 0 never runs 0W0"),
    (("0F0 0F1 0W0 0I0 0B1", "1F0 1F1 1B0 1B1"), r"Stage 0 runs 0W0 before 0I0"),
])
def test_validate_rejects_bad_split_backwards(rows, message):
    with pytest.raises(ScheduleError, match=message):
        validate(custom_split(*rows))


def test_a_deadlocked_custom_schedule_shows_the_grid_with_the_stuck_steps_marked():
    bad = custom_split("0F0 0F1 0I1 0W1 0I0 0W0", "1F0 1I0 1W0 1F1 1I1 1W1")
    validate(bad.__class__(2, 2, "ok", bad.stage_orders))  # Reordered backwards are fine.
    stuck = custom_split("0F0 0I0 0F1 0W0 0I1 0W1", "1F1 1F0 1I0 1W0 1I1 1W1")
    with pytest.raises(ScheduleError) as error:
        validate(stuck)
    text = str(error.value)
    assert "stage 0 at 0I0 (waits for 1I0); stage 1 at 1F1 (waits for 0F1)" in text
    assert "stage 0: 0F0 >>0I0 0F1 0W0 0I1 0W1" in text
    assert "stage 1: >>1F1 1F0 1I0 1W0 1I1 1W1" in text


def test_virtual_stage_actions_must_sit_on_their_chunks_stage():
    rows = ["0F0 1F0 2B0 0B0", "2F0 3F0 3B0 1B0"]
    with pytest.raises(ScheduleError, match=r"Action 1F0 is in stage 0's list but names chunk "
                                            r"1, which stage 1 holds"):
        validate(Schedule.from_strings(rows, 1, virtual_stages=2))
    good = Schedule.from_strings(["0F0 2F0 2B0 0B0", "1F0 3F0 3B0 1B0"], 1, virtual_stages=2)
    validate(good)
    assert [str(a) for a in execution_order(good)] == [
        "0F0", "1F0", "2F0", "3F0", "3B0", "2B0", "1B0", "0B0"]


def test_2bw_is_1f1b_order_with_two_weight_versions():
    """2BW runs 1F1B's actions; its table says the weights are versioned; a custom
    schedule can ask for 2 versions, not 3."""
    two = make_schedule("2bw", 4, 8)
    assert two.stage_orders == one_f_one_b(4, 8).stage_orders
    assert (two.weight_versions, one_f_one_b(4, 8).weight_versions) == (2, 1)
    assert "2 weight versions: gradients of W(t-1) applied to W(t)" in format_table(two)
    with pytest.raises(ScheduleError, match=r"weight_versions is 1 \(synchronous\) or 2"):
        validate(dataclasses.replace(two, weight_versions=3))
    with pytest.raises(ScheduleError, match=r"virtual_stages must be 1"):
        make_schedule("2bw", 2, 4, virtual_stages=2)
