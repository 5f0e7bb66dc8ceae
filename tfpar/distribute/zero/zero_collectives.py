"""ZeRO's collectives (reduce-scatter, all-gather, sends to owners, broadcasts) and their
group and instance keys."""

import collections
import threading
import weakref

import tensorflow as tf

from tfpar.distribute.common import group_keys
from tfpar.keras import tf_runtime
from tfpar.keras.replicas import replica_id, replica_in_sync


# Instance keys per tag: a variable read (and its gradient sent) this many times in a step
# at most.
_OCCURRENCES = 64


def _runs(tensors):
    """Makes the step run what computes `tensors` although nothing uses them: a
    replica's gradients of variables it does not own, which carry its sends to their
    owners. (TensorFlow's automatic control dependencies keep no collective broadcast
    whose value is unused: they are "async stateful" ops, pruned like pure ones.)"""
    if tensors:
        with tf.control_dependencies(tensors):
            tf.debugging.Assert(True, ["gradients sent to their owners"])


class ShardCollectives:
    """Reduce-scatter and all-gather over a strategy's replicas, in replica context.

    "nccl" uses NCCL's own reduce-scatter and all-gather (collective ops with the NCCL
    hint, selected when every replica is a GPU; across workers the group spans all
    replicas, keyed by this worker's devices as TensorFlow keys its own NCCL
    all-reduce); "pairwise" (CPUs across workers) sends each gradient to its owner
    alone, each send a broadcast in a group of two replicas; "all_reduce" (CPUs of one host)
    has no reduce-scatter: gradients are all-reduced through the strategy's cross-device
    ops, each replica keeping its own. Except under "nccl" the all-gather goes through the
    strategy. "placed" (a pipeline's stage replicas, which one program drives on every
    device, of this process or of workers): each gradient summed by an add on its owner's
    device, each updated weight copied from its owner to the other copies, the bytes of a
    reduce-scatter and an all-gather, each variable's own owner the root.
    (TensorFlow 2.21 has no CPU reduce-scatter: `CollectiveReduceScatterV2` with the
    ring hint times out, and the all-to-all ops either hang (V2) or cannot form a group
    across workers (V3); BUILD_NOTES.)
    """

    def __init__(self, kind, collective_keys=None, devices=None, timeout_seconds=None,
                 key_base=None):
        self.kind = kind
        self._keys = collective_keys
        self._devices = devices  # This worker's replica devices.
        self._timeout = timeout_seconds or 0
        # Per replica device, the functions whose first collective carries the timeout.
        self._timed = collections.defaultdict(weakref.WeakSet)
        self._key_base = key_base  # The strategy's block of group keys ("pairwise").
        self._lock = threading.Lock()
        # Per traced function: how many transfers of each (group, tag) a replica made.
        self._counts = weakref.WeakKeyDictionary()

    @property
    def scatters(self):
        """Whether `reduce_scatter` exists (else gradients are all-reduced)."""
        return self.kind != "all_reduce"

    def _timeout_here(self):
        """The timeout on this replica's first collective of the function being traced only
        (`tf_runtime.first_collective_timeout`)."""
        with self._lock:
            return tf_runtime.first_collective_timeout(
                self._timed[self._devices[replica_id()]], self._timeout)

    def _keys_here(self):
        group = self._keys.get_group_key(self._devices)
        device = self._devices[replica_id()]
        return group, self._keys.get_instance_key(group, device)

    def reduce_scatter(self, ctx, flat):
        """Each replica's slice of the sum of `flat` over the replicas (NCCL)."""
        if self.kind != "nccl":
            raise ValueError(f"No reduce-scatter for {self.kind!r} collectives: use "
                             f"reduce_to_owners.")
        group, instance = self._keys_here()
        return tf.raw_ops.CollectiveReduceScatterV2(
            input=flat, group_size=ctx.num_replicas_in_sync, group_key=group,
            instance_key=instance, ordering_token=[], merge_op="Add", final_op="Id",
            communication_hint="nccl")

    def _instance(self, group, tag):
        """The instance key of this replica's next collective in `group` about tag `tag` (a
        variable's ordinal) in the function being traced: the same on every replica
        whatever order each traces its collectives in. (Counted in trace order, as
        TensorFlow counts its own, the keys of a recomputed layer's reads and gradients
        differed between an owner and the others: a shape mismatch across workers.)"""
        graph = tf_runtime.outermost_function_graph()
        with self._lock:
            counts = self._counts.setdefault(graph, collections.Counter())
            key = (group, tag, self._devices[replica_id()])
            counts[key] += 1
            occurrence = counts[key]
        if not tf.inside_function():  # Eager: each runs before the next starts.
            occurrence = (occurrence - 1) % (_OCCURRENCES - 1) + 1
        elif occurrence >= _OCCURRENCES:
            raise ValueError(f"More than {_OCCURRENCES - 1} reads of one sharded variable in "
                             f"one step: not supported.")
        return 1 + tag * _OCCURRENCES + occurrence

    def _send_or_receive(self, me, other, source, n, value, tag):
        """A point-to-point transfer between replicas `me` and `other`, from `source`: the
        value sent (from `me`) or received (shaped like `value`), a broadcast in their group
        of two, about tag `tag`."""
        group = group_keys.pair_key(self._key_base, min(me, other), max(me, other), n)
        common = dict(group_size=2, group_key=group, instance_key=self._instance(group, tag),
                      communication_hint="auto", timeout_seconds=self._timeout_here())
        # TensorFlow's broadcasts carry no bfloat16 (compressed gradients): its bits go as
        # float16's, which has the same width.
        carried = tf.float16 if value.dtype == tf.bfloat16 else value.dtype
        if source == me:
            return tf.raw_ops.CollectiveBcastSendV2(input=tf.bitcast(value, carried)
                                                    if carried != value.dtype else value,
                                                    **common)
        received = tf.raw_ops.CollectiveBcastRecvV2(shape=value.shape, T=carried, **common)
        return tf.bitcast(received, value.dtype) if carried != value.dtype else received

    def reduce_to_owners(self, ctx, values, owners):
        """{key: the sum over the replicas of values[key]} for the keys this replica owns
        (`owners[key]`; keys are the variables' ordinals), and {key: the op that ends
        that transfer here}, one variable at a time: each other replica sends its value
        to the owner alone ("pairwise" across workers on CPUs, where TensorFlow has no
        reduce-scatter). Per replica that moves what a reduce-scatter would, (n-1)/n of
        the values, and nothing is flattened or padded. (A bucketed exchange, each pair
        sending both ways, hung across workers once there were more buckets than
        workers: BUILD_NOTES.)
        """
        me = replica_in_sync()
        mine, sends, done = {}, [], {}
        for key, value in values.items():
            summed = self.reduce_to_owner(ctx, value, owners[key], tf.zeros([0], value.dtype),
                                          key)
            done[key] = summed.op if tf.inside_function() else None  # (Eager: done.)
            if owners[key] == me:
                mine[key] = summed
            else:
                sends.append(summed)
        _runs(sends)
        return mine, done

    def reduce_to_owner(self, ctx, value, owner, not_owner, tag):
        """The sum of `value` over the replicas on replica `owner`; `not_owner` on the
        others. "pairwise": each other replica sends its value to the owner alone (the bytes
        of a reduce-scatter of it), as transfers about `tag` (the variable's ordinal); else
        an all-reduce."""
        me = replica_in_sync()
        n = ctx.num_replicas_in_sync
        if self.kind != "pairwise":
            summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, value)
            return summed if me == owner else not_owner
        if me != owner:
            sent = self._send_or_receive(me, owner, me, n, value, tag)
            with tf.control_dependencies([sent]):
                return tf.identity(not_owner)
        # The owner's receives wait for its own gradient: launched when the step starts
        # they would hold their buffers through the whole forward pass.
        with tf.control_dependencies([value]):
            received = [self._send_or_receive(me, other, other, n, value, tag)
                        for other in range(n) if other != me]
        return tf.add_n([value] + received)

    def broadcast(self, ctx, value, shape, dtype, tag):
        """`value` from the one replica that passes it (the others pass None), on every
        replica: a collective broadcast over all replicas about `tag` (a variable's
        ordinal), in tfpar's own group (NCCL: keyed as the strategy keys its own)."""
        if self.kind == "nccl" or self._key_base is None:
            group, instance = self._keys_here()
        else:
            group = group_keys.broadcast_key(self._key_base)
            instance = self._instance(group, tag)
        common = dict(group_size=ctx.num_replicas_in_sync, group_key=group,
                      instance_key=instance, timeout_seconds=self._timeout_here(),
                      communication_hint="nccl" if self.kind == "nccl" else "auto")
        if value is not None:
            return tf.raw_ops.CollectiveBcastSendV2(input=value, **common)
        return tf.raw_ops.CollectiveBcastRecvV2(shape=shape, T=dtype, **common)

    def sum_on_owners(self, ctx, values, owner_devices):
        """Each of `values` (this replica's) summed over the replicas on its owner's device
        ("placed"): an add there of every replica's value, so each device receives the
        (n-1)/n of the values it owns, as a reduce-scatter moves. Every replica gets the
        list; each uses the sums it owns. (Built once, across replicas: a merge call.)"""
        def sums(strategy, *per_replica):
            out = []
            for value, device in zip(per_replica, owner_devices):
                with tf.device(device):
                    out.append(tf.add_n(list(strategy.experimental_local_results(value))))
            return out

        return ctx.merge_call(sums, args=tuple(values))

    def copy_from_owners(self, ctx, copies, owners):
        """Every copy of each variable takes its owner's value ("placed"): `copies[k]` a
        variable's copies in replica order, `owners[k]` its owner. Each non-owner copy
        receives the owner's value once, the bytes of an all-gather. Read after the owners'
        updates, which every replica made before this merge call (the same resources:
        automatic control dependencies order them)."""
        def share(strategy):
            del strategy
            for variable_copies, owner in zip(copies, owners):
                # Read on the owner's device: `read_value` ends in an identity where it is
                # made, and a merge call's default device is this program's (measured: the
                # chief of a pipeline over workers sent every copy, 2x a worker's bytes).
                with tf.device(variable_copies[owner].device):
                    value = variable_copies[owner].read_value()
                for replica, copy in enumerate(variable_copies):
                    if replica != owner:
                        with tf.device(copy.device):
                            copy.assign(value, read_value=False)

        ctx.merge_call(share)

    def all_gather(self, ctx, flat, n):
        if self.kind == "nccl":
            group, instance = self._keys_here()
            return tf.raw_ops.CollectiveGatherV2(
                input=flat, group_size=n, group_key=group, instance_key=instance,
                ordering_token=[], communication_hint="nccl")
        return ctx.all_gather(flat, axis=0)
