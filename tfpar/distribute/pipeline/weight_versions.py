"""PipeDream-2BW's two weight versions, for `PipelineStrategy(schedule="2bw")`.

PipeDream-2BW (Narayanan et al., 2021) keeps two versions of the weights so that a
pipeline never waits for an update: micro-batches in flight compute their gradients on
the older version while the newer one is being written. Its update rule is

    W(t+1) = W(t) - lr * grad f(W(t-1))        (any optimizer: its update of W(t) with
                                                 the gradient computed on W(t-1))

A step here: each trainable variable's copy is set to the older version for the forward
and backward passes (the older version's slot takes the current weights), then set back
to the current weights, to which the optimizer applies the step's gradients.

The older version is valid while the optimizer's `iterations` is the value it was saved
at (the end of the previous step). At the first step, or after anything else moved
`iterations` (a new optimizer, a restored checkpoint), both versions are the current
weights: the step is an ordinary one. The older version is not saved in checkpoints.
"""

# pylint: disable=protected-access

import tensorflow as tf

from tfpar.distribute.pipeline import mirrored_placement
from tfpar.keras import tf_variables
from tfpar.keras.replicas import replica_id


def _plain_variable(shape, dtype, value, device, name):
    return mirrored_placement.plain_variable(
        device, initial_value=lambda: tf.fill(shape, tf.constant(value, dtype)),
        dtype=dtype, trainable=False, name=name)


class WeightVersions:
    """The older version of `variables` (trainable Keras variables, mirrored): one plain
    variable next to each of their copies."""

    def __init__(self, variables):
        self._variables = list(variables)
        self._older = [tuple(_plain_variable(c.shape, c.dtype, 0, c.device, "older_version")
                             for c in self._copies(v))
                       for v in self._variables]
        # Per replica: the optimizer's iterations when the older version was saved.
        self._saved_at = tuple(_plain_variable((), tf.int64, -1, c.device, "older_version_at")
                               for c in self._copies(self._variables[0]))

    @staticmethod
    def _copies(variable):
        return tf_variables.copies(mirrored_placement.distributed_value(variable))

    def covers(self, variables):
        """True if these are the variables it versions (a model's trainable set), their
        copies where they were."""
        return ([id(v) for v in variables] == [id(v) for v in self._variables]
                and all(tuple(c.device for c in self._copies(v)) == tuple(o.device for o in old)
                        for v, old in zip(self._variables, self._older)))

    def _local_pairs(self):
        replica = replica_id()
        for variable, older in zip(self._variables, self._older):
            yield self._copies(variable)[replica], older[replica]

    def use_older(self, iterations):
        """In a step (replica context): the variables take the older version; the older
        version's slot takes the current weights."""
        saved_at = self._saved_at[replica_id()]
        valid = tf.equal(saved_at.read_value(), tf.cast(iterations, tf.int64))
        for copy, older in self._local_pairs():
            with tf.device(copy.device):
                current = copy.read_value()
                previous = older.read_value()
                copy.assign(tf.where(valid, previous, current))
                older.assign(current)

    def use_current(self):
        """After the step's passes: the variables take the current weights back."""
        for copy, older in self._local_pairs():
            with tf.device(copy.device):
                copy.assign(older.read_value())

    def mark_saved(self, iterations):
        """After the update: the older version is that of iterations `iterations`."""
        self._saved_at[replica_id()].assign(tf.cast(iterations, tf.int64))
