"""All-reduce over hosts in three steps (the plan: `tfpar.plan.host_hierarchy`), in
TensorFlow's own collectives: a sum within each host, a sum of one slice per replica across
the hosts, and the slices put together within each host again.
`DataParallelStrategy(communication="hierarchical")` across workers on several hosts routes
its replicas' dense all-reduces here (`tf_runtime.replace_launchers`); sparse gradients,
gathers and broadcasts stay TensorFlow's.
"""

import collections

import tensorflow as tf

from tfpar.distribute.common import collective_positions, group_keys
from tfpar.plan import host_hierarchy


class HostHierarchy:
    """Sums over the replicas of `layout` (a `host_hierarchy.HostLayout`) in three steps,
    with group keys from the strategy's block at `key_base`. Called as
    `hierarchy(tensor, device, rank, timeout_seconds, ordering_token)` -> the sum over
    replicas (`tf_runtime.replace_launchers`' launchers call it); None (TensorFlow's ring)
    when the layout has one host or one replica per host."""

    def __init__(self, layout, key_base):
        self.layout = layout
        self._key_base = key_base
        self._instance_keys = collective_positions.InstanceKeys()

    def _group_key(self, within_host, index):
        hosts = len(self.layout.hosts)
        return group_keys.hierarchy_key(self._key_base, index if within_host else hosts + index)

    def __call__(self, tensor, device, rank, timeout_seconds=None, ordering_token=None):
        tensor = tf.convert_to_tensor(tensor)
        elements = tensor.shape.num_elements()
        if elements is None or not self.layout.hierarchical:
            return None
        host, local = self.layout.place(rank)
        per_host = self.layout.per_host
        chunk = host_hierarchy.slice_elements(elements, per_host)
        in_call = collections.Counter()  # Collectives of this all-reduce per group.
        timeout = timeout_seconds or 0
        token = [] if ordering_token is None else [ordering_token]
        hint = "nccl" if tf.DeviceSpec.from_string(device).device_type == "GPU" else "auto"

        def reduce(value, within_host, index, size):
            nonlocal timeout
            group = self._group_key(within_host, index)
            key = self._instance_keys.next(group, device,
                                           (value.shape.num_elements(), value.dtype.name,
                                            "reduce"), in_call)
            # The launcher's timeout, when it gives one, on the first collective only.
            summed = tf.raw_ops.CollectiveReduceV2(
                input=value, group_size=size, group_key=group, instance_key=key,
                ordering_token=token, merge_op="Add", final_op="Id",
                communication_hint=hint, timeout_seconds=timeout)
            timeout = 0
            return summed

        with tf.device(device):
            flat = tf.pad(tf.reshape(tensor, [-1]), [[0, per_host * chunk - elements]])
            host_sum = reduce(flat, True, host, per_host)
            mine = reduce(host_sum[local * chunk:(local + 1) * chunk], False, local,
                          len(self.layout.hosts))
            # Each replica's slice in its place, zeros elsewhere: their sum is the whole.
            placed = tf.pad(mine, [[local * chunk, (per_host - 1 - local) * chunk]])
            whole = reduce(placed, True, host, per_host)
            return tf.reshape(whole[:elements], tf.shape(tensor))
