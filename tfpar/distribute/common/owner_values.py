"""Values that one replica holds, made known to every replica of every worker.

Used to resume a multi-worker run from the chief's backup and to gather sharded
optimizer state into a full checkpoint: one all-reduce of values masked to their owners.
"""

import weakref

import tensorflow as tf


def broadcast_from_first_replica(strategy, values):
    """Every worker gets the first replica's (the chief's) value of each variable.

    For a resumed run: only the chief has the backup when workers share no
    filesystem, so it restores and the others receive.
    """
    values = list(values)
    received = values_of_owners(strategy, [(v.shape, v.dtype) for v in values],
                                [0] * len(values), lambda i: values[i])
    for variable, value in zip(values, received):
        variable.assign(value)


def values_of_owners(strategy, specs, owners, read):
    """Each value as its owner replica holds it, on every worker (as tensors on this
    worker's first device).

    `specs`: (shape, dtype) of each value; `owners`: the replica (index in sync) whose
    copy counts; `read(i)`: value i, called for its owner replica only (elsewhere it may
    not exist). One all-reduce per dtype of the values masked to their owners, integer
    values (step counters) too, in the same order on every worker.
    """
    if not specs:
        return []

    def masked(context):
        me = context.replica_id_in_sync_group
        return [tf.identity(read(i)) if owners[i] == me else tf.zeros(shape, dtype)
                for i, (shape, dtype) in enumerate(specs)]

    values = strategy.experimental_distribute_values_from_function(masked)
    return [strategy.experimental_local_results(value)[0]
            for value in _summing_function(strategy)(list(values))]


# One traced sum per strategy, reused for every call with the same shapes: a checkpoint
# of a sharded model reads its variables one at a time, and a function traced per read
# cost ~0.2 s each (100 variables: 24 s of a 52 s run). Its inputs are full-shaped on
# every replica, owner or not, so that every worker traces (and numbers its collectives)
# at the same calls.
_SUMMING_FUNCTIONS = weakref.WeakKeyDictionary()


def _summing_function(strategy):
    if strategy not in _SUMMING_FUNCTIONS:
        strategy_ref = weakref.ref(strategy)

        @tf.function
        def summed(values):
            def sum_by_dtype(values):
                # (A copy on this replica's device: a function's inputs have none, and
                # the all-reduce sends to the devices of what it sums.)
                values = [tf.identity(value) for value in values]
                out = [None] * len(values)
                for dtype in sorted({t.dtype for t in values}, key=lambda d: d.name):
                    indices = [i for i, t in enumerate(values) if t.dtype == dtype]
                    reduced = tf.distribute.get_replica_context().all_reduce(
                        tf.distribute.ReduceOp.SUM, [values[i] for i in indices])
                    for i, t in zip(indices, reduced):
                        out[i] = t
                return out
            return strategy_ref().run(sum_by_dtype, args=(values,))

        _SUMMING_FUNCTIONS[strategy] = summed
    return _SUMMING_FUNCTIONS[strategy]
