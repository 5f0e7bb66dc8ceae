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

Between two replicated stages a block's output crosses as Megatron's scatter-gather does
(`scatter_rows`, `gather_rows`): device t of the stage sends its copy's t-th slice of rows
to device t of the next stage, which all-gather; the backward sends each slice's gradient
back the same way and all-gathers it. A model input a replicated stage reads is spread
from where it is fed the same way (`spread_rows`). Every link then carries 1/T of the
activation and the group's all-gather the rest, instead of T-1 whole copies leaving one
device.
"""

import collections
import threading

import tensorflow as tf

from tfpar import devices as devices_lib
from tfpar.distribute.common import collective_positions, group_keys
from tfpar.keras import models
from tfpar.keras import tf_runtime

ALL_REDUCE = "tp_all_reduce"  # The name of every group all-reduce (a test counts them).
ALL_GATHER = "tp_all_gather"
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
    device's share of the block needs it).

    The other copies are tied to it by a scalar made on their own device (`_tie`), not
    passed in: a custom gradient's inputs all go through one op on the caller's device,
    which would send every copy there and back for nothing."""
    if not (copies[0].dtype.is_floating or copies[0].dtype.is_complex) or len(copies) == 1:
        return copies[0]
    upstream_of = {}
    ties = [_tie(c, upstream_of) for c in copies[1:]]

    @tf.custom_gradient
    def first(x, *ties):
        def gradient(upstream):
            upstream_of["first"] = upstream  # (Read by each tie's gradient, which follows.)
            return [upstream] + [tf.zeros_like(t) for t in ties]

        return tf.identity(x), gradient

    y = first(copies[0], *ties)
    models.keep_mask(copies[0], y)
    return y


def _tie(copy, upstream_of):
    """A zero scalar on `copy`'s device whose consumer is `leave`'s output: in the backward
    pass (after that output's gradient is known) `copy` gets that gradient."""
    device = copy.device

    @tf.custom_gradient
    def tie(x):
        def gradient(_):
            return _identity_on(upstream_of["first"], device)

        return tf.zeros((), x.dtype), gradient

    with tf.device(device):
        return tie(copy)


class Sliced(tuple):
    """A `Replicated` value crossing to the next stage as T slices of its rows: slice t made
    on device t of this stage, for device t of the next (`scatter_rows`)."""


def _home(tensor, device):
    """Marks where the pipeline's executor anchors `tensor` (`execution._anchor`), in place
    of the receiving stage's first device."""
    tensor._tfpar_home = device  # pylint: disable=protected-access
    return tensor


def rows_split(x, parts):
    """Rows of x per part if x splits into `parts` equal static parts of rows, else None."""
    if x.shape.rank is None or x.shape.rank == 0 or x.shape[0] is None:
        return None
    rows = int(x.shape[0])
    return rows // parts if rows % parts == 0 and rows >= parts else None


def scatter_rows(value, group, next_devices):
    """`value` (`Replicated` over `group`) as a `Sliced` for the next stage's
    `next_devices`, or None when its rows do not split (the caller passes it whole).
    In the backward pass each device all-gathers its slice's gradient: every copy needs
    the whole one."""
    copies = value.copies
    t_all = len(group.devices)
    n = rows_split(copies[0], t_all)
    if (n is None or len(next_devices) != t_all or models.mask_of(copies[0]) is not None
            or not copies[0].dtype.is_floating):
        return None
    slices = []
    for t, copy in enumerate(copies):
        @tf.custom_gradient
        def cut(x, t=t):
            def gradient(upstream):
                return group.all_gather(upstream, t)

            return x[t * n:(t + 1) * n], gradient

        with tf.device(group.devices[t]):
            piece = cut(copy)
        piece._tfpar_source = group.devices[t]  # pylint: disable=protected-access
        slices.append(_home(piece, next_devices[t]))
    return Sliced(slices)


def gather_rows(sliced, group):
    """A `Sliced` that arrived at `group`'s devices, as `Replicated` (each device all-gathers
    the slices); in the backward pass each slice's gradient is its rows of its device's
    gradient, which are equal on every device of a replicated stage."""
    copies = []
    for t, piece in enumerate(sliced):
        n = int(piece.shape[0])
        key = group.key(piece, t, "gather")

        @tf.custom_gradient
        def whole(x, t=t, n=n, key=key):
            def gradient(upstream):
                with tf.device(group.devices[t]):
                    return upstream[t * n:(t + 1) * n]

            return group.gather(x, t, key), gradient

        with tf.device(group.devices[t]):
            copies.append(whole(piece))
    return Replicated(copies)


def spread_rows(x, group):
    """x, fed on one device, on each of `group`'s devices: its rows split where it is, slice
    t sent to device t, all-gathered there (x is a model input: no gradient). None when its
    rows do not split."""
    n = rows_split(x, len(group.devices))
    if n is None or models.mask_of(x) is not None:
        return None
    with tf.device(x.device):
        parts = tf.split(tf.stop_gradient(x), len(group.devices))
    copies = []
    for t, part in enumerate(parts):
        with tf.device(group.devices[t]):
            copies.append(group.gather(tf.identity(part), t, group.key(part, t, "gather")))
    return Replicated(copies)


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

    def key(self, x, t, collective="reduce"):
        """The instance key of device t's next `collective` of x."""
        device = self.devices[t]
        if x.shape.is_fully_defined():
            # A key per place in the traced function and shape: TensorFlow keeps an
            # instance's shape, and resolves it once.
            return self._instance_keys.next(self.group_key, device,
                                            (str(x.shape), x.dtype.name, collective),
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
        return self._reduce(x, t, self.key(x, t))

    def gather(self, x, t, key):
        """x's rows of every device of the group, in device order, on device t."""
        with tf.device(self.devices[t]):
            y = tf.raw_ops.CollectiveGatherV2(
                input=x, group_size=len(self.devices), group_key=self.group_key,
                instance_key=key, ordering_token=[self._token(t).handle],
                communication_hint=self._hint, timeout_seconds=0, name=ALL_GATHER)
        if x.shape.rank is not None:  # (TensorFlow's shape function leaves it unknown.)
            rows = None if x.shape[0] is None else x.shape[0] * len(self.devices)
            y.set_shape([rows] + x.shape.as_list()[1:])
        return y

    def all_gather(self, x, t):
        """`gather` of x, its key drawn now."""
        return self.gather(x, t, self.key(x, t, "gather"))

    def f(self, x, t):
        """Megatron's f: x as it is; in the backward pass, the group's sum of gradients."""

        @tf.custom_gradient
        def copy(x):
            return tf.identity(x), lambda upstream: self.all_reduce(upstream, t)

        return copy(x)

    def g(self, x, t):
        """Megatron's g: the group's sum of x (every device holds it); in the backward pass,
        the gradient as it is."""

        key = self.key(x, t)  # (Outside the custom gradient: it may count on the token.)

        @tf.custom_gradient
        def total(x):
            return self._reduce(x, t, key), lambda upstream: upstream

        return total(x)


def group_key_of(key_base, index):
    """The group key of the `index`-th tensor-parallel group of a pipeline whose collective
    block starts at `key_base`."""
    return group_keys.tensor_group_key(key_base, index)
