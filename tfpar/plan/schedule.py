"""Pipeline schedules as plain data: which stage runs which micro-batch, in what order.

Pure Python. A schedule lists, per stage (device), its actions in execution order; the
executor runs each list in exactly that order. A wrong order would hang the training
step, so `validate` dry-runs it first. Actions:

- `F`: a forward pass; `B`: a whole backward pass;
- or the backward split in two (zero-bubble schedules): `I`, the input gradient (on the
  critical path: the previous stage waits for it), and `W`, the weight gradient
  (deferrable, it fills idle time).

With virtual stages (`virtual_stages=v`, interleaved schedules) the model is cut into
K x v chunks and device `r` holds chunks r, r + K, r + 2K, ...; an action names its chunk.

>>> gpipe(2, 2).to_strings()
['0F0 0F1 0B0 0B1', '1F0 1F1 1B0 1B1']
"""

import dataclasses
import re
from collections import Counter

from tfpar.errors import ScheduleError

FORWARD = "F"
BACKWARD = "B"
INPUT_GRAD = "I"
WEIGHT_GRAD = "W"
KINDS = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble_h1", "2bw")

_ACTION = re.compile(r"(\d+)([FBIW])(\d+)")


@dataclasses.dataclass(frozen=True)
class Action:
    """Stage (or chunk) `stage` runs pass `kind` (F, B, I or W) of micro-batch `micro_batch`.

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
                f"An action is written <stage><F|B|I|W><micro_batch>, such as '1F0' (stage 1, "
                f"forward, micro-batch 0). Received: {text!r}")
        return cls(int(match[1]), match[2], int(match[3]))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """`stage_orders[s]` is the tuple of actions stage (device) `s` runs, in order.

    With `virtual_stages` v > 1 the model is cut into `num_stages` x v chunks, chunk c
    on stage c % num_stages, and actions name chunks. With `weight_versions=2`
    (PipeDream-2BW) a step's gradients are those of the weights before the previous
    step's update, and are applied to the latest weights: W(t+1) = W(t) - lr * g(W(t-1)).

    >>> Schedule.from_strings(["0F0 2F0 2B0 0B0", "1F0 3F0 3B0 1B0"], 1,
    ...                       virtual_stages=2).rank_of(3)
    1
    """

    num_stages: int
    num_micro_batches: int
    name: str
    stage_orders: tuple
    virtual_stages: int = 1
    weight_versions: int = 1

    @classmethod
    def from_strings(cls, rows, num_micro_batches, name="custom", virtual_stages=1):
        """Builds an (unvalidated) schedule from one space-separated string per stage.

        >>> Schedule.from_strings(["0F0 0B0"], 1).to_strings()
        ['0F0 0B0']
        """
        orders = tuple(tuple(Action.parse(text) for text in row.split()) for row in rows)
        return cls(len(orders), num_micro_batches, name, orders, virtual_stages)

    @property
    def num_chunks(self):
        """The parts the model is cut into: stages x virtual stages."""
        return self.num_stages * self.virtual_stages

    def rank_of(self, chunk):
        """The stage (device) that holds model chunk `chunk`."""
        return chunk % self.num_stages

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


def two_bw(num_stages, num_micro_batches):
    """PipeDream-2BW's weight rule on 1F1B's order: two weight versions, each step's
    gradients computed on the older one and applied to the newer, one step late.

    Each step still ends when its last backward does (tfpar runs steps one at a time):
    the rule, and its memory (one more copy of the trainable weights), are 2BW's; the
    overlap of one step's cool-down with the next one's warm-up is not done.

    >>> two_bw(2, 2).weight_versions, two_bw(2, 2).to_strings()
    (2, ['0F0 0F1 0B0 0B1', '1F0 1B0 1F1 1B1'])
    """
    orders = one_f_one_b(num_stages, num_micro_batches).stage_orders
    return Schedule(num_stages, num_micro_batches, "2bw", orders, weight_versions=2)


def _interleaved_sequences(num_stages, num_micro_batches, virtual_stages, rank):
    """Megatron's interleaved order for `rank`: its forwards and its backwards as
    (chunk, micro-batch) lists. Micro-batches go in groups of K through each of the
    rank's chunks in turn (forwards first chunk first, backwards last chunk first)."""
    k, v = num_stages, virtual_stages
    total = num_micro_batches * v
    forwards, backwards = [], []
    for i in range(total):
        local = (i // k) % v
        micro = (i // (k * v)) * k + i % k
        forwards.append((local * k + rank, micro))
        backwards.append(((v - 1 - local) * k + rank, micro))
    return forwards, backwards


def _check_virtual(num_stages, num_micro_batches, virtual_stages):
    _check_count("num_stages", num_stages)
    _check_count("num_micro_batches", num_micro_batches)
    _check_count("virtual_stages", virtual_stages)
    if virtual_stages > 1 and num_micro_batches % num_stages:
        raise ScheduleError(
            f"Interleaved schedules send micro-batches through each chunk in groups of "
            f"num_stages: num_micro_batches ({num_micro_batches}) must be a multiple of "
            f"num_stages ({num_stages}). Use {num_stages * -(-num_micro_batches // num_stages)} "
            f"micro-batches, or virtual_stages=1.")


def interleaved_1f1b(num_stages, num_micro_batches, virtual_stages=2):
    """Megatron's interleaved 1F1B: each stage holds `virtual_stages` (v) chunks of the
    model, so a micro-batch visits every stage v times and the bubble shrinks by v:
    (K-1)/(v*M) of the ideal time. Stage r warms up with 2(K-1-r) + (v-1)K chunk
    forwards. v=1 is 1F1B. M must be a multiple of K.

    >>> interleaved_1f1b(2, 2, 2).to_strings()
    ['0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1', '1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1']
    """
    _check_virtual(num_stages, num_micro_batches, virtual_stages)
    k, v = num_stages, virtual_stages
    total = num_micro_batches * v
    orders = []
    for r in range(k):
        forwards, backwards = _interleaved_sequences(k, num_micro_batches, v, r)
        warmup = min((k - 1 - r) * 2 + (v - 1) * k, total) if v > 1 else min(k - 1 - r, total)
        order = [Action(c, FORWARD, m) for c, m in forwards[:warmup]]
        for i in range(total - warmup):
            c, m = forwards[warmup + i]
            order.append(Action(c, FORWARD, m))
            c, m = backwards[i]
            order.append(Action(c, BACKWARD, m))
        order += [Action(c, BACKWARD, m) for c, m in backwards[total - warmup:]]
        orders.append(tuple(order))
    return Schedule(k, num_micro_batches, "interleaved_1f1b", tuple(orders), v)


def zero_bubble_h1(num_stages, num_micro_batches, virtual_stages=1):
    """Zero-bubble H1 (Qi et al., 2023): each backward is split into I (input gradient,
    which the previous stage waits for) and W (weight gradient, which nobody waits
    for), and W passes are deferred to fill the time a stage would otherwise wait. The F
    and I passes keep 1F1B's order (interleaved 1F1B's with virtual stages), so each
    stage holds as many micro-batches between F and I as there; a stage defers at most
    `max_deferred` W passes (default K-1 per virtual stage). With F = I = W the bubble
    falls from 1F1B's (K-1)(F+B) to (K-1)(F+I-W) time units.

    >>> zero_bubble_h1(2, 2).to_strings()
    ['0F0 0F1 0I0 0W0 0I1 0W1', '1F0 1I0 1F1 1I1 1W0 1W1']
    """
    _check_virtual(num_stages, num_micro_batches, virtual_stages)
    k, v, m_count = num_stages, virtual_stages, num_micro_batches
    plan = interleaved_1f1b(k, m_count, v) if v > 1 else one_f_one_b(k, m_count)
    sequences = [[Action(a.stage, INPUT_GRAD if a.kind == BACKWARD else a.kind, a.micro_batch)
                  for a in order] for order in plan.stage_orders]
    cap = (k - 1) * v
    end, free_at, position = {}, [0] * k, [0] * k
    orders, deferred = [[] for _ in range(k)], [[] for _ in range(k)]
    last = k * v - 1

    def ready(action):
        """When `action`'s inputs are there (None: not yet known)."""
        c, m = action.stage, action.micro_batch
        if action.kind == FORWARD:
            needs = [Action(c - 1, FORWARD, m)] if c > 0 else []
        else:
            needs = [Action(c, FORWARD, m)] + (
                [Action(c + 1, INPUT_GRAD, m)] if c < last else [])
        if any(n not in end for n in needs):
            return None
        return max([end[n] for n in needs], default=0)

    while any(position[r] < len(sequences[r]) or deferred[r] for r in range(k)):
        choices = []  # (start, stage, deferred W or not)
        for r in range(k):
            nxt = sequences[r][position[r]] if position[r] < len(sequences[r]) else None
            at = ready(nxt) if nxt is not None else None
            t = free_at[r]
            if deferred[r] and (nxt is None or len(deferred[r]) > cap or at is None or at > t):
                choices.append((t, r, True))  # A W fills the wait (or must run now).
            elif at is not None:
                choices.append((max(t, at), r, False))
        t, r, weight = min(choices)
        if weight:
            action = deferred[r].pop(0)
        else:
            action = sequences[r][position[r]]
            position[r] += 1
            if action.kind == INPUT_GRAD:
                deferred[r].append(Action(action.stage, WEIGHT_GRAD, action.micro_batch))
        orders[r].append(action)
        end[action] = free_at[r] = t + 1
    return Schedule(k, m_count, "zero_bubble_h1", tuple(tuple(o) for o in orders), v)


def make_schedule(name, num_stages, num_micro_batches, virtual_stages=1):
    """Builds the schedule called `name`, one of `SCHEDULES`."""
    if name not in SCHEDULES:
        raise ScheduleError(
            f"Unknown schedule {name!r}. Use one of: {', '.join(repr(n) for n in SCHEDULES)}"
            f", or a tfpar.plan.schedule.Schedule.")
    if name in ("gpipe", "1f1b", "2bw"):
        _check_count("virtual_stages", virtual_stages)
        if virtual_stages != 1:
            raise ScheduleError(
                f"Schedule {name!r} runs one chunk per stage: virtual_stages must be 1. Use "
                f"'interleaved_1f1b' or 'zero_bubble_h1' for virtual stages.")
        builder = {"gpipe": gpipe, "1f1b": one_f_one_b, "2bw": two_bw}[name]
        return builder(num_stages, num_micro_batches)
    builder = {"interleaved_1f1b": interleaved_1f1b, "zero_bubble_h1": zero_bubble_h1}[name]
    return builder(num_stages, num_micro_batches, virtual_stages)


def _backward_kind(schedule):
    """{(chunk, micro-batch): the action that sends its input gradient (B or I)}."""
    kinds = {}
    for order in schedule.stage_orders:
        for action in order:
            if action.kind in (BACKWARD, INPUT_GRAD):
                kinds[action.stage, action.micro_batch] = action
    return kinds


def _dependencies(action, schedule, senders):
    """What must finish before `action`: activations flow down the chunks, gradients up;
    a W needs its own I."""
    c, m = action.stage, action.micro_batch
    if action.kind == FORWARD:
        return [Action(c - 1, FORWARD, m)] if c > 0 else []
    if action.kind == WEIGHT_GRAD:
        return [Action(c, INPUT_GRAD, m)]
    needs = [Action(c, FORWARD, m)]
    if c < schedule.num_chunks - 1:
        needs.append(senders.get((c + 1, m), Action(c + 1, BACKWARD, m)))
    return needs


def _check_actions(schedule):
    """Each chunk must run its F of every micro-batch, then either B, or I then W, once."""
    _check_count("num_stages", schedule.num_stages)
    _check_count("num_micro_batches", schedule.num_micro_batches)
    _check_count("virtual_stages", schedule.virtual_stages)
    if schedule.weight_versions not in (1, 2):
        raise ScheduleError(f"weight_versions is 1 (synchronous) or 2 (PipeDream-2BW). "
                            f"Received: weight_versions={schedule.weight_versions!r}")
    k, m_count, orders = schedule.num_stages, schedule.num_micro_batches, schedule.stage_orders
    chunks = schedule.num_chunks
    if len(orders) != k:
        raise ScheduleError(
            f"A schedule for {k} stages needs one action list per stage. Received "
            f"{len(orders)} lists.")
    for s, order in enumerate(orders):
        for action in order:
            if not isinstance(action, Action) or action.kind not in KINDS:
                raise ScheduleError(
                    f"Stage {s}'s list holds {action!r}; it must hold only Actions of kind "
                    f"'F', 'B', 'I' or 'W', e.g. Action.parse('{s}F0').")
            if not 0 <= action.stage < chunks:
                what = "stages" if chunks == k else "chunks (stages x virtual stages)"
                raise ScheduleError(
                    f"Action {action} names stage {action.stage}, but {what} run "
                    f"0..{chunks - 1}.")
            if schedule.rank_of(action.stage) != s:
                where = (f"names stage {action.stage}" if chunks == k else
                         f"names chunk {action.stage}, which stage "
                         f"{schedule.rank_of(action.stage)} holds")
                raise ScheduleError(
                    f"Action {action} is in stage {s}'s list but {where}: each list holds "
                    f"only its own stage's actions. Move it to stage "
                    f"{schedule.rank_of(action.stage)}'s list.")
            if not 0 <= action.micro_batch < m_count:
                raise ScheduleError(
                    f"Action {action} names micro-batch {action.micro_batch}, but there are "
                    f"{m_count} micro-batches (0..{m_count - 1}).")
        counts = Counter(order)
        repeated = [f"{a} ({n} times)" for a, n in counts.items() if n > 1]
        if repeated:
            raise ScheduleError(
                f"Stage {s} runs {', '.join(repeated)}; each action must run exactly once.")
        position = {action: i for i, action in enumerate(order)}
        for c in range(s, chunks, k):
            for m in range(m_count):
                _check_passes(s, position, c, m)


def _check_passes(s, position, c, m):
    forward, backward = Action(c, FORWARD, m), Action(c, BACKWARD, m)
    split = (Action(c, INPUT_GRAD, m), Action(c, WEIGHT_GRAD, m))
    has_split = [a in position for a in split]
    missing = [a for a in (forward,) if a not in position]
    if backward in position and any(has_split):
        both = " ".join(str(a) for a, h in zip(split, has_split) if h)
        raise ScheduleError(
            f"Stage {s} runs {backward} and {both}: a backward is either whole (B) or split "
            f"into I and W, not both.")
    if backward not in position and not all(has_split):
        missing += [backward] if not any(has_split) else [
            a for a, h in zip(split, has_split) if not h]
    if missing:
        raise ScheduleError(
            f"Stage {s} never runs {' '.join(map(str, missing))}; each stage must run one "
            f"forward and one backward (B, or I and W) per micro-batch.")
    chain = [forward] + ([backward] if backward in position else list(split))
    for before, after in zip(chain, chain[1:]):
        if position[after] < position[before]:
            why = ("a backward needs the activations of its own forward" if before == forward
                   else "the weight gradient needs the input gradient's pass")
            raise ScheduleError(
                f"Stage {s} runs {after} before {before}: {why}. Move {after} after {before}.")


def _costs(forward_cost, backward_cost):
    for name, cost in (("forward_cost", forward_cost), ("backward_cost", backward_cost)):
        # Zero costs would let an action start with its dependency and break the order.
        if not isinstance(cost, (int, float)) or isinstance(cost, bool) or not cost > 0:
            raise ScheduleError(f"{name} must be a number > 0. Received: {name}={cost!r}")
    half = backward_cost / 2
    return {FORWARD: forward_cost, BACKWARD: backward_cost, INPUT_GRAD: half, WEIGHT_GRAD: half}


def _simulate(schedule, costs):
    """Runs each stage's list in order, each action once its dependencies are done.

    Returns {action: (start, end)}. Start times only depend on earlier actions, so
    the order in which stages are visited does not change the result.
    """
    k, orders = schedule.num_stages, schedule.stage_orders
    senders = _backward_kind(schedule)
    spans, done_upto, free_at = {}, [0] * k, [0] * k
    progressed = True
    while progressed:
        progressed = False
        for s, order in enumerate(orders):
            while done_upto[s] < len(order):
                action = order[done_upto[s]]
                needs = _dependencies(action, schedule, senders)
                if any(need not in spans for need in needs):
                    break
                start = max([free_at[s]] + [spans[need][1] for need in needs])
                cost = costs[action.kind]
                spans[action] = (start, start + cost)
                free_at[s], done_upto[s], progressed = start + cost, done_upto[s] + 1, True
    stuck = [(s, order[done_upto[s]]) for s, order in enumerate(orders)
             if done_upto[s] < len(order)]
    if stuck:
        waits = "; ".join(
            f"stage {s} at {action} (waits for " + ", ".join(
                str(n) for n in _dependencies(action, schedule, senders) if n not in spans) + ")"
            for s, action in stuck)
        raise ScheduleError(
            f"Schedule {schedule.name!r} would deadlock: {waits}. A forward needs "
            f"the previous stage's forward of its micro-batch; a backward needs its own "
            f"forward and the next stage's backward. Reorder the stage lists so the awaited "
            f"actions come first.\n{_marked_grid(schedule, spans, dict(stuck))}")
    return spans


def _marked_grid(schedule, spans, stuck):
    """The actions that ran, stage by stage in order, each stage's stuck action marked
    `>>`: what a failed dry run shows."""
    lines = []
    for s, order in enumerate(schedule.stage_orders):
        cells = [str(a) for a in order if a in spans]
        if s in stuck:
            cells.append(f">>{stuck[s]}")
            cells += [str(a) for a in order[order.index(stuck[s]) + 1:]]
        lines.append(f"stage {s}: " + " ".join(cells))
    return "\n".join(lines)


def validate(schedule):
    """Raises `ScheduleError` unless `schedule` is complete and runs to the end."""
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"Not a schedule: {schedule!r} (expected a "
                            f"tfpar.plan.schedule.Schedule or a schedule's name).")
    _check_actions(schedule)
    _simulate(schedule, _costs(1, 2))


def timeline(schedule, forward_cost=1, backward_cost=2):
    """Simulates `schedule`; returns `([(start, end, action), ...], makespan)`.

    Each action starts when its stage is free and its dependencies have finished. A
    split backward's I and W each cost half a B. Entries are sorted by start time, ties
    by stage.

    >>> entries, makespan = timeline(gpipe(1, 2))
    >>> [(start, str(action)) for start, _, action in entries], makespan
    ([(0, '0F0'), (1, '0F1'), (2, '0B0'), (4, '0B1')], 6)
    """
    costs = _costs(forward_cost, backward_cost)
    _check_actions(schedule)
    spans = _simulate(schedule, costs)
    entries = sorted(((start, end, a) for a, (start, end) in spans.items()),
                     key=lambda entry: (entry[0], schedule.rank_of(entry[2].stage)))
    return entries, max(end for _, end, _ in entries)


def grid(schedule):
    """Time steps of one forward (F = I = W = 1, B = 2), each a tuple of the Action per
    stage (None for a bubble); a B fills two steps."""
    entries, makespan = timeline(schedule)
    steps = [[None] * schedule.num_stages for _ in range(int(makespan))]
    for start, end, action in entries:
        for t in range(int(start), int(end)):
            steps[t][schedule.rank_of(action.stage)] = action
    return [tuple(step) for step in steps]


def bubble_fraction(schedule, forward_cost=1, backward_cost=2):
    """The fraction of stage time spent idle; GPipe and 1F1B: (K-1)/(M+K-1) whatever the
    costs; interleaved: (K-1)/(vM+K-1) with unit costs."""
    entries, makespan = timeline(schedule, forward_cost, backward_cost)
    busy = sum(end - start for start, end, _ in entries)
    return 1 - busy / (schedule.num_stages * makespan)


def max_in_flight(schedule):
    """Per stage, the peak number of micro-batch chunks forwarded whose backward has not
    finished (B, or W for a split one): the activations the stage holds at its peak."""
    _check_actions(schedule)
    peaks = []
    for order in schedule.stage_orders:
        live = peak = 0
        for action in order:
            live += {FORWARD: 1, BACKWARD: -1, WEIGHT_GRAD: -1}.get(action.kind, 0)
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def execution_order(schedule):
    """All actions in one sequence that respects stage order and dependencies."""
    return [action for _, _, action in timeline(schedule)[0]]


def format_table(schedule):
    """The grid as text (F = I = W = 1 step, B = 2), one row per stage, then the bubble
    fraction."""
    steps = grid(schedule)
    width = max(len(str(len(steps) - 1)),
                *(len(str(a)) for order in schedule.stage_orders for a in order))
    label = len(f"stage {schedule.num_stages - 1}")
    lines = ["step".ljust(label) + "  " + " ".join(f"{t:>{width}}" for t in range(len(steps)))]
    for s in range(schedule.num_stages):
        cells = (str(step[s]) if step[s] else "." for step in steps)
        lines.append(f"stage {s}".ljust(label) + "  " + " ".join(f"{c:>{width}}" for c in cells))
    k, m, v = schedule.num_stages, schedule.num_micro_batches, schedule.virtual_stages
    virtual = f", {v} virtual stages" if v > 1 else ""
    if schedule.weight_versions == 2:
        virtual += ", 2 weight versions: gradients of W(t-1) applied to W(t)"
    lines.append(
        f"bubble fraction: {bubble_fraction(schedule):.3f} ({schedule.name}, {k} "
        f"stage{'s' * (k != 1)}{virtual}, {m} micro-batch{'es' * (m != 1)})")
    return "\n".join(lines)
