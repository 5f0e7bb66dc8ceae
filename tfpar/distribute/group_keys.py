"""Process-wide collective group keys, so strategies of any size coexist.

Every stock `MirroredStrategy` numbers its collective groups from 1. A second
strategy with a different number of replicas then joins group 1 with the wrong
size and TensorFlow aborts ("joining a group with size 4, but that group has
size 2"). Each tfpar strategy takes its own block of keys instead.

Multi-worker runs stay consistent because every worker creates its strategies
in the same order, so the n-th strategy gets the same block everywhere.
"""

import itertools
import threading

# Keys a strategy may use: one per distinct device group it reduces over.
_BLOCK = 1000
_lock = threading.Lock()
_blocks = itertools.count(1)


def next_key_base():
    """The base of a fresh block; keys base+1 .. base+_BLOCK are the caller's."""
    with _lock:
        return next(_blocks) * _BLOCK
