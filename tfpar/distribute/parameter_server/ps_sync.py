"""Synchronous parameter-server steps: gradients of the workers' parts, kept on the ps."""

import contextlib

import tensorflow as tf

ASYNC = "async"
SYNC = "sync"
MODES = (ASYNC, SYNC)

MAX_COUNTS = 64  # Mean-reduced losses in one step whose counts the parts add up.


class SyncGradients:
    """Gradients of one synchronous step, stored on the ps, one slot per worker part.

    Each part's gradient is its share of the batch's gradient (its loss is its part of
    the batch's loss, see `tfpar.keras.replicas.batch_part`), written with `assign`, so
    a closure run again after a worker failure leaves the same value; `sum` adds the
    parts on the ps. Each part also stores the counts its losses are divided by (valid
    mask entries, sums of sample weights), which `global_counts` adds up:

        parts with 3 and 1 valid tokens, token losses a, b, c | d:
        counts 3 | 1, global count 4; shares (a+b+c)/4 | d/4; sum = mean of all 4
    """

    def __init__(self, strategy, variables, num_parts):
        self.variables = list(variables)
        with strategy.scope():
            self.slots = [[tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                       name=f"sync_gradient_{k}")
                           for v in self.variables] for k in range(num_parts)]
            self.counts = [tf.Variable(tf.zeros(MAX_COUNTS), trainable=False,
                                       name=f"sync_counts_{k}") for k in range(num_parts)]

    def store(self, part, gradients):
        """Stores part `part`'s share of the gradients."""
        for slot, gradient in zip(self.slots[part], gradients):
            slot.assign(tf.convert_to_tensor(gradient))

    def sum(self, num_parts):
        """The batch's gradient: the sum of parts 0..num_parts-1, computed on the ps."""
        sums = []
        for i in range(len(self.variables)):
            # A sharded slot has no single device: its sum stays on the worker.
            device = getattr(self.slots[0][i], "device", None)
            with tf.device(device) if device else contextlib.nullcontext():
                sums.append(tf.add_n([tf.convert_to_tensor(self.slots[k][i])
                                      for k in range(num_parts)]))
        return sums

    def store_counts(self, part, counts):
        """Stores the counts of part `part`'s mean-reduced losses, in the order computed."""
        if len(counts) > MAX_COUNTS:
            raise ValueError(f"A step with more than {MAX_COUNTS} mean-reduced losses cannot "
                             f"run in sync mode (it has {len(counts)}).")
        padded = tf.stack([tf.reshape(c, ()) for c in counts] +
                          [tf.zeros(())] * (MAX_COUNTS - len(counts)))
        self.counts[part].assign(padded)

    def global_counts(self, num_parts):
        """The counts summed over parts 0..num_parts-1."""
        return tf.add_n([tf.convert_to_tensor(self.counts[k]) for k in range(num_parts)])
