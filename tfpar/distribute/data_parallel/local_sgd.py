"""Periodic averaging (local SGD): `DataParallelStrategy(sync_every=n)`.

Each replica steps on its own gradients with its own optimizer state; every n optimizer
steps, and when `fit` returns, the replicas' weights (and, with `sync_optimizer_state=True`,
the optimizer's float state) are set to their mean over the replicas: one all-reduce of the
weights per n steps in place of one of the gradients per step (PyTorch's
`PostLocalSGDOptimizer` with a `PeriodicModelAverager`). `sync_every=1` is plain data
parallelism, gradients summed every step.

Between averagings replica r's step is the gradient of N x its part of the global loss: for
a mean loss and parts of equal size, the mean loss of its own examples, as one device
training on those examples alone would take (clipping, weight decay and loss scaling apply
to that gradient). A step that overflows on any replica is skipped on all.

    >>> import tfpar
    >>> strategy = tfpar.DataParallelStrategy(["/cpu:0"], sync_every=4)
    >>> strategy.sync_every
    4
"""

import numbers

import tensorflow as tf


def check_sync_every(sync_every, shard=None, compression=None):
    """`sync_every` checked: an int >= 1, and 1 under ZeRO or gradient compression."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, numbers.Integral) \
            or sync_every < 1:
        raise ValueError(f"sync_every must be an int >= 1 (the optimizer steps between "
                         f"averagings of the replicas' weights), got {sync_every!r}.")
    if sync_every > 1 and shard:
        raise ValueError(
            f"sync_every={sync_every} lets each replica keep and step its own whole weights; "
            f"shard={shard!r} (ZeRO) divides them over the replicas. Choose one: drop "
            f"shard= or sync_every=.")
    if sync_every > 1 and compression:
        raise ValueError(
            f"sync_every={sync_every} sums no gradients between averagings; "
            f"compression={compression!r} compresses that sum. Choose one: drop "
            f"compression= or sync_every=.")
    return int(sync_every)


def average_replicas(strategy, variables):
    """Sets each replica's copy of each mirrored variable in `variables` to the mean of its
    copies over the replicas (in cross-replica context; inside a step or eagerly). One
    batched all-reduce through the strategy's own reduction (collectives across workers):
    no device gathers every copy."""
    variables = [v for v in variables if v.dtype.is_floating]
    if not variables:
        return tf.constant(False)
    extended = strategy.extended
    pairs = []
    for variable in variables:
        copies = strategy.experimental_local_results(variable)
        per_replica = strategy.experimental_distribute_values_from_function(
            # (The global replica id: this worker's replicas come in its devices' order.)
            lambda context, copies=copies: tf.identity(
                copies[context.replica_id_in_sync_group % len(copies)]))
        pairs.append((per_replica, variable))
    means = extended.batch_reduce_to(tf.distribute.ReduceOp.MEAN, pairs)
    for variable, mean in zip(variables, means):
        extended.update(variable, lambda copy, value: copy.assign(value), args=(mean,),
                        group=False)
    return tf.constant(True)
