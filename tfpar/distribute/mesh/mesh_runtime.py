"""Keras' `keras.distribution` layouts on TensorFlow: the TensorFlow side.

TensorFlow's own SPMD runtime, DTensor (`tf.experimental.dtensor`), computes on tensors
laid out on a device mesh: an op on split operands runs piece by piece, each device on
its own piece, and the runtime inserts the collectives the layouts need. A matmul whose
kernel is split by output columns needs none (column parallel); split along its
contracted rows, one all-reduce of partial sums (row parallel); a batch split along the
data axis has its replicated variables' gradients all-reduced over that axis only. Some ops
DTensor cannot lay out (a convolution's split filter, depthwise convolutions, RNN loops):
`tfpar.keras.keras_distribution` refuses those layers before a step. On GPUs DTensor's
collectives are NCCL's (`communication_environment`).

This module holds the mesh of a `keras.distribution.DeviceMesh` (`MeshRuntime`): values
placed piece by piece on their devices, batches split along the data axis, values read
back whole; `MeshVariable` is a variable that lives in pieces and reads back whole.
`tfpar.MeshStrategy` (`mesh_strategy.py`) is the strategy-style entry point; Keras is
adapted in `tfpar.keras.keras_distribution`.
"""

import os
import re

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar.keras import internals
from tfpar.plan import layouts
from tfpar.plan.placement import format_bytes


def device_name(keras_device):
    """A TensorFlow device name of a Keras device string ("cpu:0", "gpu:1")."""
    match = re.fullmatch(r"(?:/device:)?([A-Za-z]+):(\d+)", str(keras_device))
    if not match:
        raise ValueError(f"Not a device of this host: {keras_device!r} (expected 'cpu:0', "
                         f"'gpu:1', ...; keras.distribution.list_devices() lists them).")
    kind, index = match.groups()
    return f"/job:localhost/replica:0/task:0/device:{kind.upper()}:{index}"


def mesh_devices(device_mesh):
    """The TensorFlow device names of a `keras.distribution.DeviceMesh`, in row-major
    order of the mesh."""
    return [device_name(d) for d in np.asarray(device_mesh.devices).reshape(-1)]


def _region(bounds):
    """The index of the piece whose (start, stop) per dimension are `bounds`."""
    return tuple(slice(start, stop) for start, stop in bounds)


def communication_environment(device_types):
    """Environment DTensor reads for its collectives: NCCL when every device is a GPU.

    >>> communication_environment({"GPU"}), communication_environment({"CPU"})
    ({'DTENSOR_GPU_USE_NCCL_COMMUNICATION': '1'}, {})
    """
    return {"DTENSOR_GPU_USE_NCCL_COMMUNICATION": "1"} if set(device_types) == {"GPU"} else {}


_claimed = []


def _claim_dtensor_key_base(devices):
    """Spends DTensor's first collective key base on a one-group all-reduce.

    DTensor keys the g-th group of its n-th partition of a mesh 2048 x n + g. With n = 0
    and a mesh of several groups, keys 1, 2, ... are the ones every stock
    MirroredStrategy numbers its groups from; the two then meet in a group of other
    devices and both abort ("joining a group that is already full"; measured: a (2, 2)
    mesh, then a stock MirroredStrategy on 2 CPUs in the same process). Base 0 spent on
    one group (key 0, which no strategy uses), DTensor's keys start at 2048; tfpar's
    own strategies keep far above (`tfpar.distribute.common.group_keys`)."""
    if _claimed:
        return
    _claimed.append(True)
    mesh = dtensor.create_mesh([("tfpar_claim", len(devices))], devices=devices)
    pieces = []
    for device in devices:
        with tf.device(device):
            pieces.append(tf.ones([1]))
    dtensor.unpack(tf.reduce_sum(dtensor.pack(pieces, dtensor.Layout(["tfpar_claim"], mesh))))


class MeshRuntime:
    """The DTensor mesh of a `keras.distribution.DeviceMesh`: places values on it and reads
    them back. One per Keras mesh (`runtime_of`)."""

    def __init__(self, device_mesh):
        self.keras_mesh = device_mesh
        self.plan = layouts.Mesh(tuple(int(n) for n in device_mesh.shape),
                                 tuple(device_mesh.axis_names))
        self.devices = mesh_devices(device_mesh)
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"A device mesh names a device twice: {self.devices}")
        # (Read by DTensor when it starts: a GPU mesh's collectives are NCCL's.)
        for key, value in communication_environment(
                {tf.DeviceSpec.from_string(d).device_type for d in self.devices}).items():
            os.environ.setdefault(key, value)
        self.mesh = dtensor.create_mesh(list(zip(self.plan.axis_names, self.plan.shape)),
                                        devices=self.devices)
        _claim_dtensor_key_base(self.devices)

    def layout(self, axes):
        """The DTensor layout of `axes` (a mesh axis or None per dimension)."""
        return dtensor.Layout([a if a is not None else dtensor.UNSHARDED for a in axes],
                              self.mesh)

    def place(self, value, axes, name="a tensor"):
        """`value` (a whole tensor) as a DTensor laid out as `axes`: each device's piece is
        cut on that device, so no device ever holds more than its piece."""
        value = tf.convert_to_tensor(value)
        axes = layouts.check_layout(self.plan, axes, value.shape, name)
        if dtensor.is_dtensor(value):
            layout = dtensor.fetch_layout(value)
            if layout.mesh == self.mesh:  # Computed on the mesh already.
                return dtensor.relayout(value, self.layout(axes))
            if not layout.is_fully_replicated():
                raise ValueError(f"{name} is laid out on another device mesh "
                                 f"({layout.mesh}) than its variable's ({self.mesh}).")
            # Made on another mesh, whole on each of its devices (an optimizer built before
            # fit makes its zeros on the default mesh of the moment): one copy is cut below.
            # (DTensor cannot relayout across meshes.)
            value = dtensor.unpack(value)[0]
        pieces = []
        for index, device in enumerate(self.devices):
            bounds = layouts.shard_slices(self.plan, axes, value.shape, index)
            with tf.device(device):
                pieces.append(tf.identity(value[_region(bounds)]))
        return dtensor.pack(pieces, self.layout(axes))

    def relayout(self, tensor, axes):
        """`tensor`, computed on this mesh inside a step, laid out as `axes`."""
        axes = layouts.check_layout(self.plan, axes, tensor.shape, "a layer output")
        return dtensor.relayout(tensor, self.layout(axes))

    def whole(self, tensor):
        """The full value of a DTensor (or of a `MeshVariable`), as an ordinary tensor
        assembled from its pieces (no collective)."""
        if isinstance(tensor, MeshVariable):
            tensor = tensor.read_value()
        if not dtensor.is_dtensor(tensor):
            return tensor
        axes = [None if a == dtensor.UNSHARDED else a
                for a in dtensor.fetch_layout(tensor).sharding_specs]
        pieces = dtensor.unpack(tensor)
        if all(a is None for a in axes):
            return tf.identity(pieces[0])
        out = np.zeros(tensor.shape, tensor.dtype.as_numpy_dtype)
        for index, piece in enumerate(pieces):
            bounds = layouts.shard_slices(self.plan, axes, tensor.shape, index)
            out[_region(bounds)] = piece.numpy()
        return tf.constant(out)

    def batch(self, value, batch_axis=None):
        """A batch's tensor, its rows split over `batch_axis` (each device computing its
        part of the batch), or whole on every device when they do not split evenly."""
        value = tf.convert_to_tensor(value)
        return self.place(value, layouts.batch_layout(self.plan, batch_axis, value.shape))

    def variable(self, value, axes, name, trainable=True):
        """A `MeshVariable` of initial `value`, laid out as `axes`."""
        with tf.init_scope():
            placed = self.place(value, axes, name)
            variable = MeshVariable(placed, trainable=trainable, name=name)
        variable._tfpar_runtime = self
        variable._tfpar_axes = tuple(axes)
        return variable


def pieces(variable):
    """The pieces of a variable on a mesh (a Keras variable or a `MeshVariable`), one per
    device, in the mesh's order."""
    value = getattr(variable, "value", variable)
    return dtensor.unpack(value.read_value())


_runtimes = {}


def runtime_of(device_mesh):
    """The one `MeshRuntime` of a Keras `DeviceMesh`."""
    key = id(device_mesh)
    if key not in _runtimes:
        # (Eagerly: a mesh first met inside a tf.function is made and claimed outside it.)
        with tf.init_scope():
            _runtimes[key] = (device_mesh, MeshRuntime(device_mesh))  # Keep it alive.
    return _runtimes[key][1]


def any_mesh():
    """Whether any Keras mesh has been laid out in this process."""
    return bool(_runtimes)


@internals.overrides
class MeshVariable(dtensor.DVariable):
    """A DTensor variable that reads back whole and takes whole values (saving, loading,
    `get_weights`), each device keeping its piece."""

    def numpy(self):
        return self._tfpar_runtime.whole(self.read_value()).numpy()

    def __array__(self, dtype=None):
        return np.asarray(self.numpy(), dtype=dtype)

    def _laid_out(self, value):
        # A value written is first given the variable's layout. DTensor wrote a value
        # laid out otherwise as it was: a replicated bias updated by a gradient split like
        # its column-parallel layer's output held garbage (1.3e3) after one step.
        if tf.executing_eagerly() and not dtensor.is_dtensor(value):
            return self._tfpar_runtime.place(tf.cast(value, self.dtype), self._tfpar_axes,
                                             self.name)
        return dtensor.relayout(tf.cast(value, self.dtype),
                                self._tfpar_runtime.layout(self._tfpar_axes))

    # Read your writes. Inside a compiled step DTensor does not keep a read of a variable
    # after its write in order, although the graph orders them: with the batch split
    # along a data axis, SGD momentum's `variable += momentum` read the momentum from
    # before its update (0), so no variable moved (BUILD_NOTES). A read after a write in
    # the same graph therefore takes the written value itself, a data dependency.

    def _written(self):
        graph = tf.compat.v1.get_default_graph()
        written = getattr(self, "_tfpar_written", None)
        if tf.executing_eagerly() or written is None or written[0] is not graph:
            return None
        return written[1]

    def _read_variable_op(self, *args, **kwargs):
        written = self._written()
        if written is None:
            return super()._read_variable_op(*args, **kwargs)
        return tf.identity(written)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        value = self._laid_out(value)
        if not tf.executing_eagerly():
            self._tfpar_written = (tf.compat.v1.get_default_graph(), value)
        return super().assign(value, use_locking=use_locking, name=name,
                              read_value=read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        if not tf.executing_eagerly():
            return self.assign(self._read_variable_op() + self._laid_out(delta),
                               use_locking, name, read_value)
        return super().assign_add(self._laid_out(delta), use_locking=use_locking, name=name,
                                  read_value=read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        if not tf.executing_eagerly():
            return self.assign(self._read_variable_op() - self._laid_out(delta),
                               use_locking, name, read_value)
        return super().assign_sub(self._laid_out(delta), use_locking=use_locking, name=name,
                                  read_value=read_value)


def sharding_rows(model):
    """Per variable of `model` laid out on a mesh: (path, axes, full shape, shard shape,
    devices, bytes per device)."""
    rows = []
    for variable in model.weights:
        value = variable.value
        if not isinstance(value, MeshVariable):
            continue
        runtime = value._tfpar_runtime
        shape = tuple(variable.shape)
        piece = layouts.shard_shape(runtime.plan, value._tfpar_axes, shape)
        size = int(np.prod(piece, dtype=np.int64)) * value.dtype.size
        rows.append((variable.path, value._tfpar_axes, shape, piece, len(runtime.devices), size))
    return rows


def kernel_mode(equation, axes):
    """How a layer computing `einsum(equation, inputs, kernel)` runs with its kernel laid
    out as `axes`: "column", "row", "replicated", or "gathered" (the kernel is gathered
    before use)."""
    try:
        split = layouts.einsum_split(equation, axes)
    except ValueError:
        split = None
    return "gathered" if split is None else split[0]


def embedding_mode(axes):
    """How an Embedding with its table laid out as `axes` (vocabulary, features) looks
    up: "gathered" when the vocabulary is split (DTensor all-gathers the table first,
    seen in its collective log), "column" when only the features are, else
    "replicated".

    >>> embedding_mode(("model", None)), embedding_mode((None, "model"))
    ('gathered', 'column')
    """
    vocabulary, features = axes
    return "gathered" if vocabulary else "column" if features else "replicated"


def sharding_report(model, modes):
    """A table of `model`'s variables on the mesh: layout, shard shape, bytes per device;
    then each split layer's mode (`modes`: layer path -> mode) and the bytes each device
    holds."""
    rows = sharding_rows(model)
    if not rows:
        raise ValueError("This model has no variables on a device mesh: build it under "
                         "keras.distribution.set_distribution(...) after "
                         "tfpar.use_keras_distribution(), or under MeshStrategy.scope().")
    lines = [f"{'variable':44} {'layout':22} {'shape':>14} {'shard':>14} {'per device':>11}"]
    for path, axes, shape, piece, _, size in rows:
        lines.append(f"{path:44} {str(axes):22} {str(shape):>14} {str(piece):>14} "
                     f"{format_bytes(size):>11}")
    lines.append("")
    for layer, mode in modes.items():
        lines.append(f"layer {layer}: {mode}")
    total = sum(r[5] for r in rows)
    lines.append(f"each of the {rows[0][4]} devices holds {format_bytes(total)} of variables")
    return "\n".join(lines)
