"""Values that one replica holds, made known to every replica of every worker.

Used to resume a multi-worker run from the chief's backup and to gather sharded
optimizer state into a full checkpoint: one all-reduce of values masked to their owners.
"""

import tensorflow as tf

from tfpar.keras.replicas import replica_in_sync


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
    copy counts; `read(i)`: value i, called in its owner's replica only (elsewhere it
    may not exist). One all-reduce per dtype of the values masked to their owners,
    integer values (step counters) too, in the same order on every worker.
    """
    @tf.function
    def gather():
        def owned_values():
            me = replica_in_sync()
            # (tf.identity: a copy on this replica's device, whatever device `read` gives.)
            masked = [tf.identity(read(i)) if owners[i] == me else tf.zeros(shape, dtype)
                      for i, (shape, dtype) in enumerate(specs)]
            out = [None] * len(masked)
            for dtype in sorted({t.dtype for t in masked}, key=lambda d: d.name):
                indices = [i for i, t in enumerate(masked) if t.dtype == dtype]
                reduced = tf.distribute.get_replica_context().all_reduce(
                    tf.distribute.ReduceOp.SUM, [masked[i] for i in indices])
                for i, t in zip(indices, reduced):
                    out[i] = t
            return out
        return strategy.run(owned_values)

    if not specs:
        return []
    return [strategy.experimental_local_results(value)[0] for value in gather()]
