"""The replica context of a tfpar strategy, for the seam's wrappers of Keras' step."""

import tensorflow as tf

from tfpar.contract import hooks_of


def replica_context(marker="_tfpar_exact_replicas", min_replicas=2):
    """The replica context of a tfpar strategy carrying `marker`, or None.

    `_tfpar_exact_replicas`: strategies whose replicas each run Keras' own step on a
    part of the batch (data parallelism); `_tfpar_mirrored`: every tfpar mirrored
    strategy (the pipeline's too, whose step is its own).
    """
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    if not getattr(hooks_of(tf.distribute.get_strategy()), marker):
        return None
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync < min_replicas:
        return None
    return context
