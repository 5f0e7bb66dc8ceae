"""All-reduce by halving-doubling or recursive doubling (the steps:
`tfpar.plan.halving_doubling`), in TensorFlow's own collectives: each exchange of two
replicas is a collective gather in a group of the two; each hand-over (replicas beyond a
power of two) a collective sum in such a group.
`DataParallelStrategy(communication="halving_doubling")` routes its replicas' dense
all-reduces here (`tf_runtime.replace_launchers`); sparse gradients, gathers and broadcasts
stay TensorFlow's.

On CPUs TensorFlow's ring takes 2 (n-1) steps one after another, each a message between
two processes: a latency that grows with the replicas. Halving-doubling sends the same
bytes in 2 log2(n) steps; recursive doubling, for small buffers, sends log2(n) times the
buffer in log2(n) steps. (On GPUs NCCL chooses its own rings and trees: communication="auto"
takes it.)
"""

import collections

import tensorflow as tf

from tfpar.distribute.common import collective_positions, group_keys
from tfpar.plan import halving_doubling as steps_lib


class Exchanges:
    """Carries out halving-doubling all-reduces over `world` replicas of the strategy whose
    group keys start at `key_base`, buffers up to `doubling_bytes` by recursive doubling.
    Called as `exchanges(tensor, device, rank, timeout_seconds, ordering_token)` -> the sum
    over replicas (`tf_runtime.replace_launchers`' launchers call it)."""

    def __init__(self, world, key_base, doubling_bytes=None):
        self.world = world
        self.doubling_bytes = (steps_lib.DOUBLING_BYTES if doubling_bytes is None
                               else doubling_bytes)
        self._key_base = key_base
        group_keys.exchange_slot(key_base)  # (Taken now, in the order strategies are made.)
        self._instance_keys = collective_positions.InstanceKeys()

    def algorithm_for(self, nbytes):
        return steps_lib.choose(nbytes, self.world, self.doubling_bytes)

    def _group(self, me, partner):
        lower, gap = min(me, partner), abs(me - partner)
        return group_keys.exchange_key(self._key_base, lower, gap.bit_length() - 1)

    def __call__(self, tensor, device, rank, timeout_seconds=None, ordering_token=None):
        tensor = tf.convert_to_tensor(tensor)
        elements = tensor.shape.num_elements()
        if elements is None or self.world == 1:
            return None  # A size known when run only: TensorFlow's ring (keys, above).
        algorithm = self.algorithm_for(elements * tensor.dtype.size)
        with tf.device(device):
            flat = tf.reshape(tensor, [-1])
            summed = self._all_reduce(flat, device, rank, algorithm, timeout_seconds or 0,
                                      [] if ordering_token is None else [ordering_token])
            return tf.reshape(summed, tf.shape(tensor))

    def _common(self, me, partner, device, timeout, token, signature, in_call):
        group = self._group(me, partner)
        return dict(group_size=2, group_key=group,
                    instance_key=self._instance_keys.next(group, device, signature, in_call),
                    ordering_token=token, communication_hint="auto", timeout_seconds=timeout)

    @staticmethod
    def _swap(mine, me, partner, common):
        """The partner's `mine`: a gather of the two, each marked (1: the lower replica)
        so that each finds the other's whatever order the gather puts them in."""
        flag = tf.constant([1 if me < partner else 0], mine.dtype)
        both = tf.raw_ops.CollectiveGatherV2(input=tf.concat([mine, flag], 0), **common)
        rows = tf.reshape(both, [2, -1])
        first_is_mine = tf.cast(tf.equal(rows[0, -1], flag[0]), tf.int32)
        return tf.gather(rows, first_is_mine)[:-1]

    def _all_reduce(self, flat, device, me, algorithm, timeout, token):
        q = steps_lib.core_size(self.world)
        size = flat.shape.num_elements()
        chunk = steps_lib.chunk_elements(size, self.world)  # Per chunk of the core's q.
        held, span = flat, None  # span: the chunks `held` covers, once cut.
        in_call = collections.Counter()  # Collectives of this all-reduce per group.
        for step in steps_lib.plan(me, self.world, algorithm):
            elements = size if span is None else (span[1] - span[0]) * chunk
            collective = "gather" if step.kind in _GATHERS else "reduce"
            # The timeout (when the launcher gives one) on the first exchange only, as the
            # launcher times one collective per function (`tf_runtime.replace_launchers`).
            common = self._common(me, step.partner, device, timeout, token,
                                  (elements, flat.dtype.name, collective), in_call)
            timeout = 0
            if step.kind in (steps_lib.GIVE, steps_lib.TAKE, steps_lib.GIVE_RESULT,
                             steps_lib.TAKE_RESULT):
                # A hand-over as a sum of the two (the receiver's zeros when it is the
                # result): a collective that takes the ordering token, as broadcasts do not.
                mine = tf.zeros_like(held) if step.kind == steps_lib.TAKE_RESULT else held
                held = tf.raw_ops.CollectiveReduceV2(input=mine, merge_op="Add", final_op="Id",
                                                     **common)
            elif step.kind == steps_lib.SWAP:
                held = held + self._swap(held, me, step.partner, common)
            elif step.kind == steps_lib.HALVE:
                if span is None:  # The first halving cuts the buffer into q chunks.
                    held, span = tf.pad(held, [[0, q * chunk - size]]), (0, q)
                kept = _chunks(held, span, step.keep, chunk)
                theirs = self._swap(_chunks(held, span, step.send, chunk), me, step.partner,
                                    common)
                held, span = kept + theirs, step.keep
            else:  # DOUBLE: the partner's summed chunks beside this replica's.
                theirs = self._swap(held, me, step.partner, common)
                held = tf.concat([held, theirs] if step.keep < step.send else [theirs, held], 0)
                span = (min(step.keep[0], step.send[0]), max(step.keep[1], step.send[1]))
                if span == (0, q):
                    held, span = held[:size], None  # Whole again: the padding off.
        return held


_GATHERS = (steps_lib.SWAP, steps_lib.HALVE, steps_lib.DOUBLE)


def _chunks(held, span, chunks, chunk):
    """The elements of chunks [start, stop) in `held`, which covers chunks `span`."""
    return held[(chunks[0] - span[0]) * chunk:(chunks[1] - span[0]) * chunk]
