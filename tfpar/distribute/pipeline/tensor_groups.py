"""Megatron's f and g between the T devices of a tensor-parallel stage, as peer collectives.

A block run *replicated* (`tensor_parallel.replicated_call`) runs on each of the stage's T
devices: each holds the block's input, computes its share of every split layer, and the
partial products of a row layer are all-reduced so that every device holds the sum (g);
a column layer's input gradient is all-reduced in the backward pass (f). Each all-reduce
is one `CollectiveReduceV2` per device in the group's key (a ring on CPUs, NCCL on GPUs,
in one process or across processes), never a sum on one root device. Each device's
collectives are ordered by an ordering token of its own: the T devices' calls are built
one after the other in one function, and without tokens the function would chain every
device's collectives in that order (device 1's first waiting for device 0's second, which
waits for it).

A block's input enters from one device (`enter`: copies; the backward takes one device's
gradient, since all are equal there) and leaves to a consumer that is not replicated
(`leave`: the first device's copy; the backward hands the gradient to every copy).
"""

import collections
import threading

import tensorflow as tf

from tfpar import devices as devices_lib
from tfpar.distribute.common import collective_positions, group_keys
from tfpar.keras import models
from tfpar.keras import tf_runtime

ALL_REDUCE = "tp_all_reduce"  # The name of every group all-reduce (a test counts them).
# Instance keys of all-reduces of unknown shape: 2^30 up, clear of the positional ones.
_DYNAMIC_KEYS = 1 << 30


class Replicated:
    """A block's output held on each of the stage's T devices (copy t on device t), equal
    copies: what a replicated block hands the next one."""

    def __init__(self, copies):
        self.copies = list(copies)
        self._whole = None

    def whole(self):
        """The first device's copy, for a consumer that is not replicated (made once: its
        gradient reaches every copy)."""
        if self._whole is None:
            self._whole = leave(self.copies)
        return self._whole


def whole_values(structure):
    """`structure` with each `Replicated` in it as one tensor (`Replicated.whole`)."""
    return tf.nest.map_structure(
        lambda v: v.whole() if isinstance(v, Replicated) else v, structure)


def _identity_on(x, device):
    with tf.device(device):
        y = tf.identity(x)
    models.keep_mask(x, y)
    return y


def enter(x, devices):
    """x on every device; the gradient is the first device's (a replicated block's input
    gradients are equal on every device). Each copy is its own op on its device (one op
    for all would be placed on one device, and every copy would pass through it)."""
    if not (x.dtype.is_floating or x.dtype.is_complex):
        return [_identity_on(x, d) for d in devices]
    return [_copy_on(x, d, counts=(t == 0)) for t, d in enumerate(devices)]


def _copy_on(x, device, counts):
    @tf.custom_gradient
    def copy(x):
        return tf.identity(x), lambda upstream: upstream if counts else None

    with tf.device(device):
        y = copy(x)
    models.keep_mask(x, y)
    return y


def leave(copies):
    """The first device's copy; in the backward pass its gradient goes to every copy (each
    device's share of the block needs it)."""
    devices = [c.device for c in copies]
    if not (copies[0].dtype.is_floating or copies[0].dtype.is_complex):
        return copies[0]

    @tf.custom_gradient
    def first(*copies):
        def gradient(upstream):
            return [_identity_on(upstream, d) for d in devices]

        return tf.identity(copies[0]), gradient

    y = first(*copies)
    models.keep_mask(copies[0], y)
    return y


class TensorGroup:
    """The all-reduces of one group of T devices (a stage of one pipeline replica)."""

    def __init__(self, devices, group_key):
        self.devices = list(devices)
        self.group_key = group_key
        self._instance_keys = collective_positions.InstanceKeys()
        self._tokens = {}
        self._lock = threading.Lock()
        gpus = all(devices_lib.device_type(d) == "GPU" for d in self.devices)
        self._hint = "nccl" if gpus else "auto"

    def _token(self, t):
        """Device t's ordering token, which also counts its collectives of unknown shape."""
        with self._lock:
            if t not in self._tokens:
                self._tokens[t] = tf_runtime.ordering_token(self.devices[t], tf.int64)
            return self._tokens[t]

    def _key(self, x, t):
        """The instance key of device t's next all-reduce of x."""
        device = self.devices[t]
        if x.shape.is_fully_defined():
            # A key per place in the traced function and shape: TensorFlow keeps an
            # instance's shape, and resolves it once.
            return self._instance_keys.next(self.group_key, device,
                                            (str(x.shape), x.dtype.name, "reduce"),
                                            collections.Counter())
        # A shape known only when the step runs (a partial last batch under Keras'
        # retracing) may change from call to call: a fresh key each call, the same on
        # every device (each counts its own such collectives alike, on its token).
        with tf.device(device):
            count = self._token(t).assign_add(1, read_value=True)
            return tf.cast(_DYNAMIC_KEYS + count % _DYNAMIC_KEYS, tf.int32)

    def _reduce(self, x, t, key):
        with tf.device(self.devices[t]):
            return tf.raw_ops.CollectiveReduceV2(
                input=x, group_size=len(self.devices), group_key=self.group_key,
                instance_key=key, ordering_token=[self._token(t).handle], merge_op="Add",
                final_op="Id", communication_hint=self._hint, timeout_seconds=0,
                name=ALL_REDUCE)

    def all_reduce(self, x, t):
        """The sum of x over the group, as device t's member of the collective."""
        return self._reduce(x, t, self._key(x, t))

    def f(self, x, t):
        """Megatron's f: x as it is; in the backward pass, the group's sum of gradients."""

        @tf.custom_gradient
        def copy(x):
            return tf.identity(x), lambda upstream: self.all_reduce(upstream, t)

        return copy(x)

    def g(self, x, t):
        """Megatron's g: the group's sum of x (every device holds it); in the backward pass,
        the gradient as it is."""

        key = self._key(x, t)  # (Outside the custom gradient: it may count on the token.)

        @tf.custom_gradient
        def total(x):
            return self._reduce(x, t, key), lambda upstream: upstream

        return total(x)


def group_key_of(key_base, index):
    """The group key of the `index`-th tensor-parallel group of a pipeline whose collective
    block starts at `key_base`."""
    return group_keys.tensor_group_key(key_base, index)
