"""Tensors laid out on a device mesh, in plain Python: which piece of a variable each
device holds, and how a layer computes on pieces (tensor parallelism, as Megatron-LM).

A mesh is a grid of devices with named axes (`keras.distribution.DeviceMesh`); a layout
names, for each dimension of a tensor, the mesh axis it is split over or None
(`keras.distribution.TensorLayout`). Devices are numbered in row-major order of the mesh.

A layer whose kernel is split computes on its piece (`einsum_split`):
- split along a dimension the output keeps ("column parallel"): each device computes its
  part of the output; no communication forward;
- split along a contracted dimension ("row parallel"): each device computes a partial
  sum, and one all-reduce over the split axis adds them.
A Megatron MLP block (column then row) thus costs one all-reduce forward and one backward,
of the block's output activations (`megatron_mlp_bytes`).
"""

import dataclasses
import re

COLUMN = "column"  # Split along a dimension the output keeps.
ROW = "row"  # Split along a contracted dimension: partial sums, then one all-reduce.
REPLICATED = "replicated"  # Not split: every device holds it whole.


@dataclasses.dataclass(frozen=True)
class Mesh:
    """A grid of devices: `shape` (devices per axis) and one name per axis.

    >>> mesh = Mesh((2, 2), ("batch", "model"))
    >>> mesh.size, mesh.coordinates(3), mesh.group(0, "model"), mesh.group(0, "batch")
    (4, (1, 1), [0, 1], [0, 2])
    """

    shape: tuple
    axis_names: tuple

    def __post_init__(self):
        shape, names = tuple(self.shape), tuple(self.axis_names)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", names)
        if len(shape) != len(names) or not shape:
            raise ValueError(f"A mesh needs one name per axis. Received: shape={shape}, "
                             f"axis_names={names}")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
            raise ValueError(f"Mesh axes need a whole number >= 1 of devices. Received: "
                             f"shape={shape}")
        if len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"Mesh axis names must be distinct strings. Received: {names}")

    @property
    def size(self):
        """Number of devices."""
        total = 1
        for n in self.shape:
            total *= n
        return total

    def axis_size(self, axis):
        """Devices along `axis` (a name), or a ValueError naming the mesh's axes."""
        return self.shape[self._axis_index(axis)]

    def _axis_index(self, axis):
        if axis not in self.axis_names:
            raise ValueError(f"The mesh has no axis {axis!r}; its axes are "
                             f"{list(self.axis_names)}.")
        return self.axis_names.index(axis)

    def coordinates(self, index):
        """The position of device `index` on each axis."""
        coordinates = []
        for n in reversed(self.shape):
            coordinates.append(index % n)
            index //= n
        return tuple(reversed(coordinates))

    def index(self, coordinates):
        """The device at `coordinates`."""
        index = 0
        for c, n in zip(coordinates, self.shape):
            index = index * n + c
        return index

    def group(self, index, axis):
        """The devices that differ from device `index` along `axis` only, in order: those
        an all-reduce over `axis` spans."""
        position = list(self.coordinates(index))
        a = self._axis_index(axis)
        members = []
        for k in range(self.shape[a]):
            position[a] = k
            members.append(self.index(position))
        return members

    def groups(self, axis):
        """Every group of devices along `axis` (each device in exactly one)."""
        seen, groups = set(), []
        for index in range(self.size):
            if index not in seen:
                group = self.group(index, axis)
                seen.update(group)
                groups.append(group)
        return groups


def check_layout(mesh, axes, shape, name="a tensor"):
    """`axes` as a tuple, once it fits `shape` on `mesh`: one entry per dimension, each a
    mesh axis or None, no mesh axis twice, every split dimension divisible by its axis'
    size. Otherwise a ValueError that says what to change.

    >>> check_layout(Mesh((1, 2), ("batch", "model")), [None, "model"], (8, 6))
    (None, 'model')
    """
    axes = tuple(axes)
    if len(axes) != len(shape):
        raise ValueError(f"The layout {axes} of {name} names {len(axes)} dimensions; its "
                         f"shape {tuple(shape)} has {len(shape)}.")
    named = [a for a in axes if a is not None]
    if len(set(named)) != len(named):
        raise ValueError(f"The layout {axes} of {name} splits two dimensions over the same "
                         f"mesh axis.")
    for dim, (axis, size) in enumerate(zip(axes, shape)):
        if axis is None or size is None:  # (A size unknown until the step runs.)
            continue
        parts = mesh.axis_size(axis)
        if size % parts:
            raise ValueError(
                f"Dimension {dim} of {name} (size {size}) does not split into {parts} "
                f"equal parts over mesh axis {axis!r}: change the layout or the mesh.")
    return axes


def batch_layout(mesh, batch_axis, shape):
    """The layout of a batch's tensor: its first dimension split over `batch_axis` (data
    parallelism), or whole on every device when there is no such axis, the axis has one
    device, or the rows do not split evenly (a partial last batch).

    >>> mesh = Mesh((2, 2), ("batch", "model"))
    >>> batch_layout(mesh, "batch", (8, 3)), batch_layout(mesh, "batch", (5, 3))
    (('batch', None), (None, None))
    """
    shape = tuple(shape)
    whole = (None,) * len(shape)
    if (batch_axis is None or not shape or shape[0] is None
            or mesh.axis_size(batch_axis) == 1 or shape[0] % mesh.axis_size(batch_axis)):
        return whole
    return (batch_axis,) + whole[1:]


def shard_shape(mesh, axes, shape):
    """The shape of the piece each device holds.

    >>> shard_shape(Mesh((2, 4), ("batch", "model")), (None, "model"), (16, 32))
    (16, 8)
    """
    return tuple(size // (1 if axis is None else mesh.axis_size(axis))
                 for axis, size in zip(axes, shape))


def shard_slices(mesh, axes, shape, index):
    """The (start, stop) of device `index`'s piece in each dimension.

    >>> shard_slices(Mesh((2, 2), ("batch", "model")), (None, "model"), (4, 6), 3)
    ((0, 4), (3, 6))
    """
    coordinates = mesh.coordinates(index)
    piece = shard_shape(mesh, axes, shape)
    slices = []
    for axis, size, part in zip(axes, shape, piece):
        k = 0 if axis is None else coordinates[mesh.axis_names.index(axis)]
        slices.append((k * part, (k + 1) * part))
    return tuple(slices)


def parse_einsum(equation):
    """The input, kernel and output subscripts of a two-operand einsum equation (an
    ellipsis as "."), or a ValueError.

    >>> parse_einsum("...i,io->...o")
    ('.i', 'io', '.o')
    """
    match = re.fullmatch(r"\s*([\w.]+)\s*,\s*([\w.]+)\s*->\s*([\w.]*)\s*", equation)
    if not match:
        raise ValueError(f"Not a two-operand einsum equation: {equation!r}")
    return tuple(part.replace("...", ".") for part in match.groups())


def einsum_split(equation, kernel_axes):
    """How a layer computing `einsum(equation, inputs, kernel)` runs with its kernel
    laid out as `kernel_axes`: (mode, mesh axis, output dimension). Mode is `REPLICATED`,
    `COLUMN` (the output is split along that dimension of the output subscripts) or `ROW`
    (partial sums to all-reduce over the axis); None when the layer cannot compute on
    its piece (a kernel split twice, or along a dimension the inputs also index in a way
    this does not handle) and must gather the kernel first.

    Dense: "...i,io->...o".

    >>> einsum_split("...i,io->...o", (None, "model"))
    ('column', 'model', 1)
    >>> einsum_split("...i,io->...o", ("model", None))
    ('row', 'model', None)
    >>> einsum_split("...i,io->...o", (None, None))
    ('replicated', None, None)
    >>> einsum_split("...i,io->...o", ("batch", "model")) is None
    True
    """
    inputs, kernel, output = parse_einsum(equation)
    if len(kernel) != len(kernel_axes):
        raise ValueError(f"The kernel layout {tuple(kernel_axes)} does not match the "
                         f"kernel subscripts {kernel!r} of {equation!r}.")
    split = [(letter, axis) for letter, axis in zip(kernel, kernel_axes) if axis is not None]
    if not split:
        return REPLICATED, None, None
    if len(split) > 1:
        return None
    (letter, axis), = split
    if letter in output and letter not in inputs:
        return COLUMN, axis, output.index(letter)
    if letter in inputs and letter not in output:
        return ROW, axis, None
    return None


def ring_all_reduce_bytes(num_bytes, group_size):
    """Bytes each device sends in a ring all-reduce of `num_bytes` over `group_size`
    devices: 2 (n-1)/n of them (a reduce-scatter, then an all-gather).

    >>> ring_all_reduce_bytes(1000, 4)
    1500.0
    """
    return 2 * (group_size - 1) / group_size * num_bytes


def megatron_mlp_bytes(tokens, hidden, model_parallel, dtype_bytes=4):
    """Bytes each device sends per training step for one Megatron MLP block (a column-
    then a row-parallel layer) over `model_parallel` devices: one all-reduce of the
    block's output (tokens x hidden) forward and one of its input gradient backward
    (Shoeybi et al. 2019, section 3).

    >>> megatron_mlp_bytes(tokens=512, hidden=1024, model_parallel=2)
    4194304.0
    """
    activation = tokens * hidden * dtype_bytes
    return 2 * ring_all_reduce_bytes(activation, model_parallel)
