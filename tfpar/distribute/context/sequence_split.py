"""Context parallelism over a data-parallel strategy's replicas: each replica holds a slice
of every sequence of the batch (two chunks of 2C, an early and a late one: the plan,
`tfpar.plan.context_parallel`), and attention gathers the keys and values of the others.

The input is cut as it is distributed (`split_sequences`): every tensor whose second axis is
the sequence (the first input's length) is laid out so that TensorFlow's even split of the
batch gives replica c its chunks of every example; a tensor without it (a per-example
weight) is repeated for each replica. In a replica, `SequenceShards` says which positions
the replica holds and gathers a tensor's sequence from every replica in global order, a
collective whose gradient TensorFlow reduces back (`ReplicaContext.all_gather`). Everything
else is data parallelism: each replica's tokens add their share of the loss, normalized by
the global count of tokens, and the gradients are summed over the replicas.

    >>> # strategy = tfpar.DataParallelStrategy(context_parallel=2)
"""

import tensorflow as tf

from tfpar.distribute.context import blockwise_attention
from tfpar.keras.replicas import replica_in_sync
from tfpar.plan import context_parallel as plan

# Keys per block of a replica's attention: its scores are its L/C queries x this many keys
# at a time (`blockwise_attention`).
ATTENTION_BLOCK = 256


def _sequence_length(dataset):
    first = tf.nest.flatten(dataset.element_spec)[0]
    shape = getattr(first, "shape", None)
    if shape is None or shape.rank is None or shape.rank < 2 or shape[1] is None:
        raise ValueError(
            f"Context parallelism splits each batch's sequences over the replicas, along "
            f"the second axis of the first input, which needs a static length: the first "
            f"input's spec is {first}. Batch sequences padded to a fixed length "
            f"(e.g. dataset.padded_batch(batch, padded_shapes=...) or keras-hub's "
            f"preprocessors' sequence_length).")
    return int(shape[1])


def split_sequences(dataset, devices):
    """`dataset` (global batches) laid out so that splitting each batch evenly over
    `devices` replicas gives replica c chunks c and 2C-1-c of every example's sequence."""
    length = _sequence_length(dataset)
    if length % (2 * devices):
        raise ValueError(
            f"Context parallelism splits the second axis of the first input as the sequence: "
            f"its length {length} does not split into 2 x {devices} = {2 * devices} equal "
            f"chunks (two per replica, for causal load balancing). Pad sequences to a "
            f"multiple of {2 * devices}; a model whose inputs have no sequence axis trains "
            f"with data parallelism (context_parallel=1).")
    size = length // (2 * devices)
    order = [chunk for device in range(devices) for chunk in plan.chunks_of(device, devices)]

    def split(t):
        if not isinstance(t, tf.Tensor) or t.shape.rank is None or t.shape.rank == 0:
            return t
        if t.shape.rank >= 2 and t.shape[1] == length:
            rest = tf.shape(t)[2:]
            batch = tf.shape(t)[0]
            chunks = tf.reshape(t, tf.concat([[batch, 2 * devices, size], rest], 0))
            chunks = tf.gather(chunks, order, axis=1)  # [B, (device, its 2 chunks), s, ...]
            parts = tf.reshape(chunks, tf.concat([[batch, devices, 2 * size], rest], 0))
            perm = [1, 0] + list(range(2, t.shape.rank + 1))
            parts = tf.transpose(parts, perm)  # [C, B, 2s, ...]
            out = tf.reshape(parts, tf.concat([[devices * batch, 2 * size], rest], 0))
            out.set_shape([None, 2 * size] + t.shape[2:].as_list())
            return out
        return tf.concat([t] * devices, axis=0)  # (Per example: each replica has them all.)

    def each(*element):
        return tf.nest.map_structure(split, element[0] if len(element) == 1 else element)

    return dataset.map(each)


def worker_part(dataset, devices, first, local):
    """For a worker whose replicas are `first` ... `first + local - 1` of `devices`: its
    replicas' chunks of each global batch of `dataset` (every worker reads the same
    batches), one element per replica in turn, for `distribute_datasets_from_function`."""
    split = split_sequences(dataset, devices)

    def mine(t):
        if not isinstance(t, tf.Tensor) or t.shape.rank in (None, 0):
            return t
        examples = tf.shape(t)[0] // devices
        part = t[first * examples:(first + local) * examples]
        return tf.reshape(part, tf.concat([[local, examples], tf.shape(part)[1:]], 0))

    def each(*element):
        return tf.nest.map_structure(mine, element[0] if len(element) == 1 else element)

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return split.map(each).unbatch().with_options(options)


class SequenceShards:
    """What a replica of a context-parallel strategy holds of the sequence, in replica
    context: `positions(local)`, `gather(x)` (x's sequence from every replica, in order),
    `causal(local)` (the mask of which keys each of its queries sees), `attend(...)` (its
    queries against the gathered keys, by blocks)."""

    def __init__(self, devices):
        self.devices = devices

    def _device(self):
        return replica_in_sync() % self.devices

    def is_first(self):
        """Whether this replica holds the sequences' first chunk."""
        return self._device() == 0

    def length(self, local):
        return local * self.devices

    def positions(self, local):
        """The positions of this replica's `local` tokens in the whole sequence."""
        known = tf.constant(plan.positions_of(self._device(), self.devices,
                                              self.length(local)), tf.int32)
        # Not a constant to TensorFlow: Grappler folded every mask made from the positions
        # (each block's) into a constant the function keeps for its life, O(L^2 / C) bytes
        # (measured: 251 MiB at 8,192 positions over 2 replicas, 1 GiB at 16,384). A zero
        # from a stateful op cannot be folded.
        zero = tf.cast(tf.timestamp() * 0.0, tf.int32)
        return known + zero

    def gather(self, x, axis=1):
        """`x`'s sequence axis from every replica, in the sequence's order (its gradient:
        each replica's part of the summed gradients)."""
        local = x.shape[axis]
        if local is None:
            raise ValueError(f"Context parallelism gathers a sequence of static length; "
                             f"got a tensor of shape {x.shape}.")
        # (No bool collectives. And a tensor made in the replica, on its device: an input's
        # has none across workers, which TensorFlow's gather takes as no destination.)
        carried = tf.cast(x, tf.int32) if x.dtype == tf.bool else tf.identity(x)
        if x.dtype == tf.bfloat16:
            whole = _bfloat16_all_gather(carried, axis)
        else:
            whole = tf.distribute.get_replica_context().all_gather(carried, axis=axis)
        whole = tf.gather(whole, plan.global_order(self.devices, self.length(local)),
                          axis=axis)
        shape = x.shape.as_list()
        shape[axis] = self.length(local)
        whole.set_shape(shape)  # (Every replica holds as many examples: x's other axes.)
        return tf.cast(whole, tf.bool) if x.dtype == tf.bool else whole

    def attend(self, query, key, value, mask=None, scale=1.0, masked_rows="zero", keep=None):
        """This replica's queries against the whole sequence's `key` and `value`, a block of
        ATTENTION_BLOCK keys at a time with a recomputing backward (`blockwise_attention`)."""
        return blockwise_attention.attention(query, key, value, mask, scale, ATTENTION_BLOCK,
                                             masked_rows, keep)

    def causal(self, local):
        """[1, local, length]: True where query i of this replica may see key j (j <= the
        query's position)."""
        keys = tf.range(self.length(local), dtype=tf.int32)
        return self.positions(local)[None, :, None] >= keys[None, None, :]


def _bfloat16_all_gather(x, axis):
    """The replica context's all_gather of a bfloat16 tensor, which TensorFlow's collective
    gather does not take: its bits gathered as float16 (the same bytes, moved unchanged),
    and its gradient as TensorFlow's all_gather's (the replicas' sum, this replica's part),
    summed in float32."""
    context = tf.distribute.get_replica_context()

    @tf.custom_gradient
    def gather(part):
        bits = context.all_gather(tf.bitcast(part, tf.float16), axis=axis)

        def gradient(upstream):
            summed = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                        tf.cast(upstream, tf.float32))
            local = part.shape[axis]
            mine = tf.range(local) + local * context.replica_id_in_sync_group
            return tf.cast(tf.gather(summed, mine, axis=axis), tf.bfloat16)

        return tf.bitcast(bits, tf.bfloat16), gradient

    return gather(x)


def check_context_parallel(context_parallel, sync_every=1):
    """Validates `DataParallelStrategy(context_parallel=...)`; returns it."""
    if isinstance(context_parallel, bool) or not isinstance(context_parallel, int) \
            or context_parallel < 1:
        raise ValueError(f"context_parallel is the number of replicas each sequence is split "
                         f"over, an int >= 1. Received: {context_parallel!r}")
    if context_parallel == 1:
        return 1
    if sync_every != 1:
        raise ValueError(
            f"context_parallel={context_parallel} splits each sequence over the replicas, so "
            f"each replica's gradient is only part of an example's: the replicas must sum "
            f"them every step. Drop sync_every={sync_every}.")
    return context_parallel


def check_devices(context_parallel, replicas):
    """Fails before any step unless the sequence splits over every replica."""
    if context_parallel > 1 and context_parallel != replicas:
        raise ValueError(
            f"context_parallel={context_parallel} must equal the number of replicas "
            f"({replicas}) for now: data parallelism beside it (replicas = data x context) "
            f"is not built yet. Pass {context_parallel} devices, or "
            f"context_parallel={replicas}.")
