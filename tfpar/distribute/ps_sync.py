"""Synchronous parameter-server steps: gradients of the workers' parts, kept on the ps."""

import contextlib

import tensorflow as tf

ASYNC = "async"
SYNC = "sync"
MODES = (ASYNC, SYNC)


class SyncGradients:
    """Gradients of one synchronous step, stored on the ps, one slot per worker part.

    Slot k holds part k's gradient times its example count, written with `assign`,
    so a closure run again after a worker failure leaves the same value. `mean`
    then gives the mean gradient over the combined batch, computed on the ps:

        parts of 3 and 5 examples, mean gradients g0 and g1:
        slot0 = 3 * g0, slot1 = 5 * g1, mean = (slot0 + slot1) / 8
    """

    def __init__(self, strategy, variables, num_parts):
        self.variables = list(variables)
        with strategy.scope():
            self.slots = [[tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                       name=f"sync_gradient_{k}")
                           for v in self.variables] for k in range(num_parts)]

    def store(self, part, gradients, count):
        """Stores part `part`'s mean `gradients` over its `count` examples."""
        for slot, gradient in zip(self.slots[part], gradients):
            slot.assign(tf.convert_to_tensor(gradient) * tf.cast(count, slot.dtype))

    def mean(self, num_parts, total):
        """The mean gradient over parts 0..num_parts-1, which hold `total` examples."""
        means = []
        for i in range(len(self.variables)):
            # A sharded slot has no single device: its sum stays on the worker.
            device = getattr(self.slots[0][i], "device", None)
            with tf.device(device) if device else contextlib.nullcontext():
                summed = tf.add_n([tf.convert_to_tensor(self.slots[k][i])
                                   for k in range(num_parts)])
                means.append(summed / tf.cast(total, summed.dtype))
        return means
