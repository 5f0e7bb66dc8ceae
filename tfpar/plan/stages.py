"""Cutting a model's layers into pipeline stages, and splitting batches. Pure Python.

A model is seen as its layer calls ("units") in an order where every unit comes
after the units it reads from. A stage is a contiguous range of units, written
`(start, stop)` as in `placement.partition`. A pipeline passes one activation from a
stage to the next (with the model inputs later units read, which the caller leaves out of
the count), so a stage may only start where exactly one tensor crosses:

    units:  0 dense_a   1 dense_b   2 add(dense_a, dense_b)   3 dense_c
    cut 1:  dense_a's output crosses            -> allowed
    cut 2:  dense_a's and dense_b's outputs     -> not allowed (two tensors)
    cut 3:  add's output crosses                -> allowed
"""

from tfpar.errors import BatchSizeError, PlacementError
from tfpar.plan.placement import partition


def crossing_tensors(unit_inputs, unit_outputs, graph_inputs=(), graph_outputs=()):
    """Returns, for each cut 1..n-1 (before unit i), the tensors that cross it.

    A tensor crosses cut i when it is made before unit i (or is a graph input)
    and read at or after unit i (or is a graph output).

    Args:
      unit_inputs, unit_outputs: per unit, the ids of the tensors it reads/makes.
      graph_inputs, graph_outputs: ids of the graph's inputs and outputs.

    >>> crossing_tensors([["x"], ["a"], ["a", "b"]], [["a"], ["b"], ["c"]], ["x"], ["c"])
    [('a',), ('a', 'b')]
    """
    n = len(unit_inputs)
    made = {t: -1 for t in graph_inputs}
    for i, outputs in enumerate(unit_outputs):
        for t in outputs:
            made.setdefault(t, i)
    read = {}
    for i, inputs in enumerate(unit_inputs):
        for t in inputs:
            read[t] = max(read.get(t, -1), i)
    for t in graph_outputs:
        read[t] = n
    return [tuple(t for t, at in made.items() if at < cut <= read.get(t, -1))
            for cut in range(1, n)]


def _check_stage_count(num_stages):
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise PlacementError(f"num_stages must be an integer >= 1. Received: {num_stages!r}")


def stage_ranges(costs, num_stages, cuts=None, boundaries=(), names=None):
    """Cuts units into `num_stages` contiguous, non-empty stages.

    Args:
      costs: per unit, the number balanced between stages (e.g. parameters).
      num_stages: how many stages.
      cuts: the positions (1..n-1) where a stage may start; None: anywhere.
      boundaries: positions where the user starts stages (`StageBoundary`). When
        given, they alone decide the stages.
      names: per unit, a name for error messages.

    Returns:
      `[(start, stop), ...]`, one range per stage.

    >>> stage_ranges([1, 1, 1, 1], 2)
    [(0, 2), (2, 4)]
    >>> stage_ranges([1, 1, 1, 1], 2, cuts=[1, 3])
    [(0, 3), (3, 4)]
    >>> stage_ranges([1, 1, 1, 1], 2, boundaries=[1])
    [(0, 1), (1, 4)]
    """
    _check_stage_count(num_stages)
    n = len(costs)
    names = list(names) if names is not None else [f"#{i}" for i in range(n)]
    cuts = list(range(1, n)) if cuts is None else sorted(set(cuts))
    if n < num_stages:
        raise PlacementError(
            f"Cannot cut {n} layer{'s' * (n != 1)} into {num_stages} pipeline stages: each "
            f"stage needs at least one layer. Use at most {n} stages (fewer devices, or "
            f"num_stages <= {n}).")
    boundaries = list(boundaries)
    if boundaries:
        bad = [b for b in boundaries if b not in cuts]
        if bad:
            raise PlacementError(
                f"A stage cannot start at {', '.join(names[b] for b in bad)}: a stage must "
                f"start where exactly one activation crosses from the previous stage.")
        if len(boundaries) + 1 != num_stages:
            raise PlacementError(
                f"The model's {len(boundaries)} StageBoundary marker"
                f"{'s' * (len(boundaries) != 1)} make {len(boundaries) + 1} stages, but the "
                f"strategy runs {num_stages} stages. Use {len(boundaries) + 1} devices per "
                f"pipeline replica (num_stages={len(boundaries) + 1}), or move the markers.")
        starts = [0] + sorted(boundaries)
        return list(zip(starts, starts[1:] + [n]))
    segment_starts = [0] + cuts
    segments = list(zip(segment_starts, segment_starts[1:] + [n]))
    if len(segments) < num_stages:
        raise PlacementError(
            f"Cannot cut the model into {num_stages} pipeline stages: a stage must start "
            f"where exactly one activation crosses, and the model has only {len(cuts)} such "
            f"place{'s' * (len(cuts) != 1)}"
            + (f" (before {', '.join(names[c] for c in cuts)})" if cuts else "")
            + f". Use at most {len(segments)} stages.")
    segment_costs = [sum(costs[start:stop]) for start, stop in segments]
    return [(segments[first][0], segments[last - 1][1])
            for first, last in partition(segment_costs, num_stages)]


def check_micro_batches(batch_size, num_micro_batches, num_replicas=1):
    """Returns the micro-batch size; raises `BatchSizeError` unless the batch splits evenly.

    Every pipeline replica gets `batch_size / num_replicas` examples, cut into
    `num_micro_batches` equal micro-batches.

    >>> check_micro_batches(64, 4, num_replicas=2)
    8
    """
    parts = num_micro_batches * num_replicas
    if (not isinstance(batch_size, int) or isinstance(batch_size, bool)
            or batch_size < parts or batch_size % parts):
        lower = batch_size - batch_size % parts if isinstance(batch_size, int) else 0
        examples = " or ".join(str(b) for b in (lower, lower + parts) if b > 0)
        split = (f"{num_replicas} pipeline replicas x {num_micro_batches} micro-batches"
                 if num_replicas > 1 else f"{num_micro_batches} micro-batches")
        raise BatchSizeError(
            f"A batch of {batch_size} examples does not split evenly into {split} "
            f"({parts} equal parts). Use a batch size that is a multiple of {parts}, such "
            f"as {examples}; fewer micro-batches; or drop the last partial batch "
            f"(dataset.batch(..., drop_remainder=True)).")
    return batch_size // parts
