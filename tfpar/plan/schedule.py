"""Pipeline schedules as plain data: which stage runs which micro-batch, in what order.

Pure Python. A schedule lists, per stage, its forward (`F`) and backward (`B`)
actions in execution order; the executor runs each list in exactly that order.
A wrong order would hang the training step, so `validate` dry-runs it first.

>>> gpipe(2, 2).to_strings()
['0F0 0F1 0B0 0B1', '1F0 1F1 1B0 1B1']
"""

import dataclasses
import re
from collections import Counter

from tfpar.errors import ScheduleError

FORWARD = "F"
BACKWARD = "B"
SCHEDULES = ("gpipe", "1f1b")

_ACTION = re.compile(r"(\d+)([FB])(\d+)")


@dataclasses.dataclass(frozen=True)
class Action:
    """Stage `stage` runs the forward or backward pass of micro-batch `micro_batch`.

    >>> str(Action(1, FORWARD, 0)), Action.parse("0B3")
    ('1F0', Action(stage=0, kind='B', micro_batch=3))
    """

    stage: int
    kind: str
    micro_batch: int

    def __str__(self):
        return f"{self.stage}{self.kind}{self.micro_batch}"

    @classmethod
    def parse(cls, text):
        """Reads an action written like `str(action)`, e.g. `"1F0"`."""
        match = _ACTION.fullmatch(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ScheduleError(
                f"An action is written <stage><F|B><micro_batch>, such as '1F0' (stage 1, "
                f"forward, micro-batch 0). Received: {text!r}")
        return cls(int(match[1]), match[2], int(match[3]))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """`stage_orders[s]` is the tuple of actions stage `s` runs, in order."""

    num_stages: int
    num_micro_batches: int
    name: str
    stage_orders: tuple

    @classmethod
    def from_strings(cls, rows, num_micro_batches, name="custom"):
        """Builds an (unvalidated) schedule from one space-separated string per stage.

        >>> Schedule.from_strings(["0F0 0B0"], 1).to_strings()
        ['0F0 0B0']
        """
        orders = tuple(tuple(Action.parse(text) for text in row.split()) for row in rows)
        return cls(len(orders), num_micro_batches, name, orders)

    def to_strings(self):
        """One space-separated string of actions per stage."""
        return [" ".join(str(action) for action in order) for order in self.stage_orders]


def _check_count(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ScheduleError(f"{name} must be an integer >= 1. Received: {name}={value!r}")


def gpipe(num_stages, num_micro_batches):
    """Every stage runs all forwards F0..F(M-1), then all backwards B0..B(M-1).

    Backwards go first-in-first-out, as in `one_f_one_b`, so both schedules add the
    micro-batch gradients in the same order (float sums depend on the order). Every
    stage holds the activations of all M micro-batches at its peak.

    >>> gpipe(2, 3).stage_orders[1][3]
    Action(stage=1, kind='B', micro_batch=0)
    """
    _check_count("num_stages", num_stages)
    _check_count("num_micro_batches", num_micro_batches)
    micro = range(num_micro_batches)
    orders = tuple(
        tuple(Action(s, FORWARD, m) for m in micro) + tuple(Action(s, BACKWARD, m) for m in micro)
        for s in range(num_stages))
    return Schedule(num_stages, num_micro_batches, "gpipe", orders)


def one_f_one_b(num_stages, num_micro_batches):
    """PipeDream-flush 1F1B: warm-up forwards, then one forward one backward, then cool-down.

    With K stages and M micro-batches, stage `s` warms up with `min(K - 1 - s, M)`
    forwards, so it holds at most `min(K - s, M)` micro-batches' activations (GPipe: M)
    for the same bubble. Backwards run in micro-batch order.

    >>> one_f_one_b(2, 3).to_strings()
    ['0F0 0F1 0B0 0F2 0B1 0B2', '1F0 1B0 1F1 1B1 1F2 1B2']
    """
    _check_count("num_stages", num_stages)
    _check_count("num_micro_batches", num_micro_batches)
    orders = []
    for s in range(num_stages):
        warmup = min(num_stages - 1 - s, num_micro_batches)
        order = [Action(s, FORWARD, m) for m in range(warmup)]
        for m in range(warmup, num_micro_batches):
            order += [Action(s, FORWARD, m), Action(s, BACKWARD, m - warmup)]
        order += [Action(s, BACKWARD, m)
                  for m in range(num_micro_batches - warmup, num_micro_batches)]
        orders.append(tuple(order))
    return Schedule(num_stages, num_micro_batches, "1f1b", tuple(orders))


def make_schedule(name, num_stages, num_micro_batches):
    """Builds the schedule called `name`, one of `SCHEDULES`."""
    builders = {"gpipe": gpipe, "1f1b": one_f_one_b}
    if name not in builders:
        raise ScheduleError(
            f"Unknown schedule {name!r}. Use one of: {', '.join(repr(n) for n in SCHEDULES)}.")
    return builders[name](num_stages, num_micro_batches)


def _dependencies(action, num_stages):
    """What must finish before `action`: activations flow down the stages, gradients up."""
    s, m = action.stage, action.micro_batch
    if action.kind == FORWARD:
        return [Action(s - 1, FORWARD, m)] if s > 0 else []
    if s == num_stages - 1:
        return [Action(s, FORWARD, m)]
    return [Action(s, FORWARD, m), Action(s + 1, BACKWARD, m)]


def _check_actions(schedule):
    """Each stage must run its own F and B of every micro-batch exactly once, F first."""
    _check_count("num_stages", schedule.num_stages)
    _check_count("num_micro_batches", schedule.num_micro_batches)
    k, m_count, orders = schedule.num_stages, schedule.num_micro_batches, schedule.stage_orders
    if len(orders) != k:
        raise ScheduleError(
            f"A schedule for {k} stages needs one action list per stage. Received "
            f"{len(orders)} lists.")
    for s, order in enumerate(orders):
        for action in order:
            if not isinstance(action, Action) or action.kind not in (FORWARD, BACKWARD):
                raise ScheduleError(
                    f"Stage {s}'s list holds {action!r}; it must hold only Actions of kind "
                    f"'F' or 'B', e.g. Action.parse('{s}F0').")
            if not 0 <= action.stage < k:
                raise ScheduleError(
                    f"Action {action} names stage {action.stage}, but stages run 0..{k - 1}.")
            if action.stage != s:
                raise ScheduleError(
                    f"Action {action} is in stage {s}'s list but names stage {action.stage}: "
                    f"each list holds only its own stage's actions. Move it to stage "
                    f"{action.stage}'s list.")
            if not 0 <= action.micro_batch < m_count:
                raise ScheduleError(
                    f"Action {action} names micro-batch {action.micro_batch}, but there are "
                    f"{m_count} micro-batches (0..{m_count - 1}).")
        counts = Counter(order)
        repeated = [f"{a} ({n} times)" for a, n in counts.items() if n > 1]
        if repeated:
            raise ScheduleError(
                f"Stage {s} runs {', '.join(repeated)}; each action must run exactly once.")
        missing = [Action(s, kind, m) for kind in (FORWARD, BACKWARD) for m in range(m_count)
                   if Action(s, kind, m) not in counts]
        if missing:
            raise ScheduleError(
                f"Stage {s} never runs {' '.join(map(str, missing))}; each stage must run one "
                f"forward and one backward per micro-batch.")
        position = {action: i for i, action in enumerate(order)}
        for m in range(m_count):
            forward, backward = Action(s, FORWARD, m), Action(s, BACKWARD, m)
            if position[backward] < position[forward]:
                raise ScheduleError(
                    f"Stage {s} runs {backward} before {forward}: a backward needs the "
                    f"activations of its own forward. Move {backward} after {forward}.")


def _simulate(schedule, forward_cost, backward_cost):
    """Runs each stage's list in order, each action once its dependencies are done.

    Returns {action: (start, end)}. Start times only depend on earlier actions, so
    the order in which stages are visited does not change the result.
    """
    k, orders = schedule.num_stages, schedule.stage_orders
    spans, done_upto, free_at = {}, [0] * k, [0] * k
    progressed = True
    while progressed:
        progressed = False
        for s, order in enumerate(orders):
            while done_upto[s] < len(order):
                action = order[done_upto[s]]
                needs = _dependencies(action, k)
                if any(need not in spans for need in needs):
                    break
                start = max([free_at[s]] + [spans[need][1] for need in needs])
                cost = forward_cost if action.kind == FORWARD else backward_cost
                spans[action] = (start, start + cost)
                free_at[s], done_upto[s], progressed = start + cost, done_upto[s] + 1, True
    stuck = [
        f"stage {s} at {order[done_upto[s]]} (waits for "
        f"{', '.join(str(n) for n in _dependencies(order[done_upto[s]], k) if n not in spans)})"
        for s, order in enumerate(orders) if done_upto[s] < len(order)]
    if stuck:
        raise ScheduleError(
            f"Schedule {schedule.name!r} would deadlock: {'; '.join(stuck)}. A forward needs "
            f"the previous stage's forward of its micro-batch; a backward needs its own "
            f"forward and the next stage's backward. Reorder the stage lists so the awaited "
            f"actions come first.")
    return spans


def validate(schedule):
    """Raises `ScheduleError` unless `schedule` is complete and runs to the end."""
    _check_actions(schedule)
    _simulate(schedule, 1, 1)


def timeline(schedule, forward_cost=1, backward_cost=1):
    """Simulates `schedule`; returns `([(start, end, action), ...], makespan)`.

    Each action starts when its stage is free and its dependencies have finished.
    Entries are sorted by start time, ties by stage.

    >>> entries, makespan = timeline(gpipe(1, 2))
    >>> [(start, str(action)) for start, _, action in entries], makespan
    ([(0, '0F0'), (1, '0F1'), (2, '0B0'), (3, '0B1')], 4)
    """
    for name, cost in (("forward_cost", forward_cost), ("backward_cost", backward_cost)):
        # Zero costs would let an action start with its dependency and break the order.
        if not isinstance(cost, (int, float)) or isinstance(cost, bool) or not cost > 0:
            raise ScheduleError(f"{name} must be a number > 0. Received: {name}={cost!r}")
    _check_actions(schedule)
    spans = _simulate(schedule, forward_cost, backward_cost)
    entries = sorted(((start, end, a) for a, (start, end) in spans.items()),
                     key=lambda entry: (entry[0], entry[2].stage))
    return entries, max(end for _, end, _ in entries)


def grid(schedule):
    """Unit-cost time steps, each a tuple of the Action per stage (None for a bubble)."""
    entries, makespan = timeline(schedule)
    steps = [[None] * schedule.num_stages for _ in range(makespan)]
    for start, _, action in entries:
        steps[start][action.stage] = action
    return [tuple(step) for step in steps]


def bubble_fraction(schedule, forward_cost=1, backward_cost=1):
    """The fraction of stage time spent idle; GPipe with unit costs: (K-1)/(M+K-1)."""
    entries, makespan = timeline(schedule, forward_cost, backward_cost)
    busy = sum(end - start for start, end, _ in entries)
    return 1 - busy / (schedule.num_stages * makespan)


def max_in_flight(schedule):
    """Per stage, the peak number of micro-batches forwarded but not yet backwarded."""
    _check_actions(schedule)
    peaks = []
    for order in schedule.stage_orders:
        live = peak = 0
        for action in order:
            live += 1 if action.kind == FORWARD else -1
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def execution_order(schedule):
    """All actions in one sequence that respects stage order and dependencies."""
    return [action for _, _, action in timeline(schedule)[0]]


def format_table(schedule):
    """The unit-cost grid as text, one row per stage, then the bubble fraction."""
    steps = grid(schedule)
    width = max(len(str(len(steps) - 1)),
                *(len(str(a)) for order in schedule.stage_orders for a in order))
    label = len(f"stage {schedule.num_stages - 1}")
    lines = ["step".ljust(label) + "  " + " ".join(f"{t:>{width}}" for t in range(len(steps)))]
    for s in range(schedule.num_stages):
        cells = (str(step[s]) if step[s] else "." for step in steps)
        lines.append(f"stage {s}".ljust(label) + "  " + " ".join(f"{c:>{width}}" for c in cells))
    k, m = schedule.num_stages, schedule.num_micro_batches
    lines.append(
        f"bubble fraction: {bubble_fraction(schedule):.3f} ({schedule.name}, {k} "
        f"stage{'s' * (k != 1)}, {m} micro-batch{'es' * (m != 1)})")
    return "\n".join(lines)
