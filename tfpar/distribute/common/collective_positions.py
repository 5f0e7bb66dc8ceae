"""Instance keys for collectives a strategy builds itself in groups of its own (halving-
doubling's pairs, the hierarchy's hosts).

TensorFlow resolves a collective's instance key (its group, shape, peers) the first time it
runs and keeps it: a key drawn afresh at every call costs a resolution each time (halving-
doubling was slower than the ring until keys were fixed). A key here is the same for the
same position in a traced function and the same buffer, so each key keeps one shape; and
workers that trace at different times agree (a worker whose last batch kept its shape does
not retrace where the others do: the gradients' buffers are the same).
"""

import collections
import threading
import weakref

import tensorflow as tf

from tfpar.keras import tf_runtime


class InstanceKeys:
    """Numbers the collectives of each group by where they are made."""

    def __init__(self):
        self._lock = threading.Lock()
        # Per traced function, how many collectives each (group, device) made so far.
        self._positions = weakref.WeakKeyDictionary()
        self._keys = {}  # group -> {(position, *signature): instance key}

    def next(self, group, device, signature, in_call):
        """The instance key of `device`'s next collective in `group`, about a buffer of
        `signature` (elements, dtype, collective): numbered by its position in the traced
        function, or in eager by `in_call` (a Counter per group of the calling all-reduce:
        one all-reduce runs before the next starts on a device)."""
        with self._lock:
            in_call[group] += 1
            if tf.inside_function():
                counts = self._positions.setdefault(tf_runtime.outermost_function_graph(),
                                                    collections.Counter())
                counts[group, device] += 1
                position = counts[group, device]
            else:
                position = -in_call[group]
            keys = self._keys.setdefault(group, {})
            return keys.setdefault((position, *signature), len(keys) + 1)
