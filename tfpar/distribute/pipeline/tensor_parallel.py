"""Tensor parallelism inside a pipeline stage (Megatron's layout), on one host or across processes.

Each stage of a `PipelineStrategy(tensor_parallel=T, layout_map=...)` runs on T devices.
The user's `keras.distribution.LayoutMap` (the keys a user writes for
`keras.distribution.ModelParallel`) says which `Dense` layers are split over the stage's
"model" axis (and `EinsumDense` layers alike: column when the split kernel axis is an output
axis of the equation, row when it is contracted):

- *column* (kernel layout `(None, "model")`): the kernel (in, out) and bias are kept as T
  shards of out / T columns, shard t on the stage's device t, which computes
  `activation(x @ W_t + b_t)` from a copy of the whole input x. The copy's gradient is
  the sum of the T devices' input gradients: one reduction in the backward pass
  (Megatron's f).
- *row* (kernel layout `("model", None)`): the kernel is kept as T shards of in / T rows;
  device t computes `x_t @ W_t` from slice t of its input, the T partial products are
  summed (one reduction in the forward pass, Megatron's g), then the (whole) bias and the
  activation are applied on the stage's first device.
- A column layer whose output feeds only a row layer of the same stage (the Megatron MLP)
  hands it its T slices as they are: no gather in between. Otherwise its slices are
  concatenated on the stage's first device.
- Inside a layer of layers (a Transformer block): an attention layer whose query, key and
  value are column-split and output row-split by heads runs by heads, its own call once
  per device on that device's share (`head_split_call`); a column's slices go to a row
  layer the block calls on its output; other split layers gather or slice around the
  block's own code.
- Layers the layout map does not split run whole on the stage's first device, as in a
  pipeline without tensor parallelism.

In a traced step a stage runs replicated, as Megatron runs it: every device runs the
stage's split layers' shares, the blocks that can (`replicated_call`) and the small unsplit
layers, a row layer's partial products are all-reduced onto every device and a column
layer's input gradients too, by peer collectives (`tensor_groups`: NCCL on GPUs, a ring on
CPUs, in one process or several), and activations cross between stages by scatter-gather
(`Crossings`). Eagerly, and in blocks tfpar cannot run replicated, the reductions sum T
tensors onto the stage's first device instead: with NCCL when the stage's devices are GPUs
of this process (`select_communication`: a `NcclReduce`), else an add on that device
(`"reduce_to_one"`); devices of several processes all-reduce by peer collectives (NCCL's
on GPUs, TensorFlow's in-process NCCL ops would hang there; the ring on CPUs) and use the
first device's result (`communication_of`). Each shard's forward and backward run on its device
(`placed_call`). What cannot be split is refused when the model is placed, before the
first step, naming the layer and the layout key.
"""

import contextlib
import dataclasses
import functools
import re
import threading

import numpy as np
import tensorflow as tf

from tfpar import devices as devices_lib
from tfpar.distribute.common.placed_call import placed, placed_call
from tfpar.distribute.pipeline import tensor_groups
from tfpar.errors import PlacementError
from tfpar.keras import models
from tfpar.keras import split_variables as keras_tp
from tfpar.keras import tf_runtime
from tfpar.keras import variable_birth
from tfpar.plan.communication import RING, select_communication

MODEL_AXIS = "model"
COLUMN, ROW = "column", "row"
# Names of the reductions' ops in a traced step (a test counts them).
FORWARD_REDUCTION, BACKWARD_REDUCTION, GATHER = "tp_reduce_forward", "tp_reduce_backward", "tp_gather"


@dataclasses.dataclass(frozen=True)
class SplitLayer:
    """How one layer is split: `kind` COLUMN or ROW, by the layout under `key`."""

    layer: object
    kind: str
    key: str  # The LayoutMap key that matched its kernel.
    split_variables: tuple  # (variable, axis) kept as shards.
    out_axis: object = None  # COLUMN: the output axis split (negative: from the end).
    in_axis: object = None  # ROW: the input axis split (negative).
    # The layer of the model graph whose call calls this one (a Transformer block), or None
    # when this layer is itself a node of the graph.
    within: object = None

    @property
    def bias_split(self):
        return len(self.split_variables) > 1


class Split:
    """An activation left split along `axis`, one slice per device of the stage, and the
    Keras mask the whole activation would carry."""

    def __init__(self, parts, axis, mask=None):
        self.parts = list(parts)
        self.axis = axis
        self.mask = mask


def _mask_of(x):
    return x.mask if isinstance(x, Split) else models.mask_of(x)


def check_layout_map(layout_map, tensor_parallel, num_stages, num_replicas):
    """Refuses a layout map that is not one, or whose device mesh says other degrees."""
    if not keras_tp.is_layout_map(layout_map):
        raise ValueError(f"layout_map must be a keras.distribution.LayoutMap (keys: variable "
                         f"path patterns, values: layouts such as (None, 'model')). Received: "
                         f"{type(layout_map).__name__}")
    mesh = layout_map.device_mesh
    if mesh is None:
        return
    # ("batch" is the data axis of Keras' own examples.)
    degrees = {"data": num_replicas, "batch": num_replicas, "pipe": num_stages,
               MODEL_AXIS: tensor_parallel}
    for name, size in zip(mesh.axis_names, mesh.shape):
        if name in degrees and degrees[name] != size:
            what = {"data": "num_replicas", "batch": "num_replicas", "pipe": "num_stages",
                    MODEL_AXIS: "tensor_parallel"}[name]
            raise ValueError(
                f"The layout map's device mesh has axis {name!r} of size {size}, but the "
                f"strategy has {what}={degrees[name]}: the two disagree. Pass {what}={size}, "
                f"or make the mesh's {name!r} axis {degrees[name]} long.")


MESH_AXES = ("data", "batch", "pipe", MODEL_AXIS)


def degrees_of_mesh(layout_map, devices, num_replicas, num_stages, tensor_parallel,
                    from_cluster=False):
    """(devices, R, K, T) with what the layout map's `keras.distribution.DeviceMesh` says
    where the strategy's arguments are left at their defaults: the degrees said once, as a
    mesh with axes "data" (or "batch"), "pipe" and "model", and the devices as its array
    read in that order (replica-major, then stage, then the model axis). Arguments given
    win; `check_layout_map` refuses a mesh that disagrees with them."""
    mesh = getattr(layout_map, "device_mesh", None) if keras_tp.is_layout_map(
        layout_map) else None
    if mesh is None:
        return devices, num_replicas, num_stages, tensor_parallel
    names = list(mesh.axis_names)
    unknown = [name for name in names if name not in MESH_AXES]
    if unknown:
        raise ValueError(f"The layout map's device mesh has axes {unknown}, which a "
                         f"PipelineStrategy does not know: name its axes among "
                         f"{', '.join(repr(a) for a in MESH_AXES)}.")
    sizes = dict(zip(names, mesh.shape))
    if tensor_parallel == 1:
        tensor_parallel = sizes.get(MODEL_AXIS, 1)
    if num_replicas == 1:
        num_replicas = sizes.get("data", sizes.get("batch", 1))
    if num_stages is None and "pipe" in sizes:
        num_stages = sizes["pipe"]
    if devices is None and not from_cluster:
        order = [names.index(a) for a in MESH_AXES if a in names]
        devices = [d if d.startswith("/") else "/" + d
                   for d in np.transpose(np.asarray(mesh.devices), order).reshape(-1)]
    return devices, num_replicas, num_stages, tensor_parallel


def _key_of(layout_map, path):
    """(the LayoutMap key matching `path`, its layout) or (None, None). Keras' own lookup
    first, which refuses a path that several keys match."""
    layout = layout_map[path]
    if layout is None:
        return None, None
    keys = list(layout_map)  # (A Mapping's `in` would match patterns too.)
    if path in keys:
        return path, layout
    return next(k for k in keys if re.fullmatch(k, path)), layout


def plan_layers(program, layout_map, tensor_parallel):
    """{id(layer): SplitLayer} for the layers of `program` the layout map splits over the
    "model" axis; PlacementError, naming the layer and the key, for a layout it cannot run."""
    planned, calls = {}, {}
    for stage in program.stages:
        for node in stage.nodes:
            calls.setdefault(id(node.operation), []).append(stage.index)
    for stage in program.stages:
        for layer in stage.layers:
            if keras_tp.einsum_spec(layer) is None and keras_tp.sublayers(layer):
                planned.update(_plan_within(layer, layout_map, tensor_parallel))
                continue
            split = _plan_layer(layer, layout_map, tensor_parallel)
            if split is None:
                continue
            if len(calls.get(id(layer), ())) != 1:
                raise PlacementError(
                    f"Layer {layer.name!r} is split by the layout map (key {split.key!r}) but "
                    f"is called {len(calls.get(id(layer), ()))} times in the model: a split "
                    f"layer must be called once. Drop its layout, or give each call a layer "
                    f"of its own.")
            planned[id(layer)] = split
    _check_every_key_matches(layout_map, [v.path for stage in program.stages
                                          for layer in stage.layers for v in layer.weights])
    return planned


def _check_every_key_matches(layout_map, paths):
    """Refuses layout keys that match no variable path: a misspelt key would leave its
    layer whole, and the stage's other devices idle, without a word."""
    unmatched = [key for key in layout_map
                 if not any(key == path or re.fullmatch(key, path) for path in paths)]
    if unmatched:
        shown = ", ".join(paths[:6]) + (", ..." if len(paths) > 6 else "")
        raise PlacementError(
            f"The layout map's key(s) {', '.join(repr(k) for k in unmatched)} match no "
            f"variable of the model. A key is a regular expression matched against a whole "
            f"variable path (as Keras' LayoutMap does), e.g. '.*d1/kernel'; the model's "
            f"paths are {shown}. Fix the key(s), or drop them.")


def _plan_within(composite, layout_map, t):
    """{id(sublayer): SplitLayer} for the Dense and EinsumDense layers inside `composite`
    (a layer of layers) that the layout map splits. Each runs split whenever the composite
    calls it, its output gathered (a column) or its input sliced (a row): one more transfer
    per layer than a Megatron pair passed from node to node."""
    planned, covered = {}, set()
    for sub in keras_tp.sublayers(composite):
        if keras_tp.einsum_spec(sub) is None:
            continue
        split = _plan_layer(sub, layout_map, t)
        covered.update(id(v) for v in sub.weights)
        if split is not None:
            planned[id(sub)] = dataclasses.replace(split, within=composite)
    for variable in composite.weights:
        key, layout = _key_of(layout_map, variable.path)
        if id(variable) not in covered and layout is not None and MODEL_AXIS in layout.axes:
            raise PlacementError(
                f"The layout map's key {key!r} splits {variable.path}, a weight of layer "
                f"{composite.name!r} ({type(composite).__name__}) that no Dense or "
                f"EinsumDense layer in it owns: a tensor-parallel pipeline splits those only. "
                f"Drop that layout.")
    return planned


def _from_end(spec, letter):
    """The (negative) axis of `letter` in an einsum operand spec, counted from its end; None
    when it is not there or stands before an ellipsis."""
    tail = spec.split("...")[-1]
    return tail.index(letter) - len(tail) if letter in tail else None


def _plan_layer(layer, layout_map, t):
    layouts = {}
    for variable in layer.weights:
        key, layout = _key_of(layout_map, variable.path)
        if layout is None:
            continue
        axes = tuple(layout.axes)
        others = sorted({a for a in axes if a is not None and a != MODEL_AXIS})
        if others:
            raise PlacementError(
                f"The layout map's key {key!r} lays out {variable.path} over mesh axes "
                f"{others}: a tensor-parallel pipeline splits weights over the {MODEL_AXIS!r} "
                f"axis only (the data and pipe axes are the strategy's replicas and stages). "
                f"Use None or {MODEL_AXIS!r} in the layout.")
        if MODEL_AXIS in axes:
            layouts[id(variable)] = (variable, key, axes)
    if not layouts:
        return None
    first_key = next(iter(layouts.values()))[1]
    spec = keras_tp.einsum_spec(layer)
    if spec is None:
        raise PlacementError(
            f"The layout map's key {first_key!r} splits a weight of layer {layer.name!r} "
            f"({type(layer).__name__}) over {MODEL_AXIS!r}, but a tensor-parallel pipeline "
            f"splits Dense and EinsumDense layers only (column: a kernel axis that is an "
            f"output axis, e.g. (None, {MODEL_AXIS!r}) for Dense; row: a contracted one, "
            f"({MODEL_AXIS!r}, None)). Drop that layout, or use keras.layers.Dense there.")
    why = keras_tp.refusal(layer)
    if why:
        raise PlacementError(f"Layer {layer.name!r} cannot be split by the layout map (key "
                             f"{first_key!r}): {why}. Drop its layout, or that setting.")
    inputs, kernel_spec, outputs, bias_spec = spec
    kernel, bias = layer.kernel, layer.bias
    if id(kernel) not in layouts:
        _, key, _ = layouts[id(bias)]
        raise PlacementError(
            f"The layout map's key {key!r} splits the bias of layer {layer.name!r} but not its "
            f"kernel: split the kernel, (None, {MODEL_AXIS!r}), and its bias follows.")
    _, key, axes = layouts[id(kernel)]
    split_at = [i for i, a in enumerate(axes) if a == MODEL_AXIS]
    letter = kernel_spec[split_at[0]] if len(axes) == len(kernel_spec) else None
    out_axis = in_axis = None
    if letter is not None and len(split_at) == 1:
        if letter in outputs and letter not in inputs:
            out_axis = _from_end(outputs, letter)
        elif letter in inputs and letter not in outputs:
            in_axis = _from_end(inputs, letter)
    if out_axis is None and in_axis is None:
        raise PlacementError(
            f"The layout map's key {key!r} gives the kernel of {type(layer).__name__} layer "
            f"{layer.name!r} the layout {axes}: a tensor-parallel pipeline splits one kernel "
            f"axis over {MODEL_AXIS!r}, one that is an output axis (column: (None, "
            f"{MODEL_AXIS!r}) for Dense) or a contracted input axis (row: ({MODEL_AXIS!r}, "
            f"None)), after any '...'.")
    kind, what = (COLUMN, "output units") if out_axis is not None else (ROW, "input features")
    size = kernel.shape[split_at[0]]
    if size % t:
        raise PlacementError(
            f"The layout map's key {key!r} splits {type(layer).__name__} layer "
            f"{layer.name!r} by {what} ({size}) over tensor_parallel={t} devices, which does "
            f"not divide them. Use a tensor_parallel that divides {size}, or other units.")
    bias_layout = layouts.get(id(bias)) if bias is not None else None
    if bias_layout is not None and kind == ROW:
        raise PlacementError(
            f"The layout map's key {bias_layout[1]!r} splits the bias of layer "
            f"{layer.name!r}, a row layer (its kernel split along a contracted axis) whose "
            f"bias is added once, after the partial products are summed. Drop the bias "
            f"layout.")
    split = [(kernel, split_at[0])]
    if kind == COLUMN and bias is not None and letter in keras_tp.bias_letters(layer):
        split.append((bias, bias_spec.index(letter)))
    elif bias_layout is not None:
        raise PlacementError(
            f"The layout map's key {bias_layout[1]!r} splits the bias of layer "
            f"{layer.name!r}, which has no {letter!r} axis to split: drop the bias layout.")
    return SplitLayer(layer, kind, key, tuple(split), out_axis, in_axis)


def communication_of(devices):
    """How the sums of a stage's T `devices` run where its blocks cannot run replicated
    (eager steps, block classes tfpar does not know): "nccl" on GPUs of this process (its
    in-process NCCL ops), else "reduce_to_one" (an add on the first device, which runs
    the block). Over devices of several processes, where TensorFlow's in-process NCCL ops
    cannot run and no device may sum for the others: an all-reduce by peer collectives,
    "nccl" on GPUs, "ring" on CPUs, of which the first device's result is used."""
    types = [devices_lib.device_type(d) for d in devices]
    spans = devices_lib.spans_tasks(devices)
    if spans and set(types) != {"GPU"}:
        return RING
    return select_communication(
        "auto", types, multi_worker=spans,
        physical_gpus=devices_lib.physical_gpus_of(devices, host=devices_lib.host_task()))


def reduce_sum(parts, devices, communication, name):
    """The sum of `parts` (part t on devices[t]) on devices[0]. `communication`: "nccl"
    (TensorFlow's in-process NcclReduce), "reduce_to_one" (an add there), or the
    `tf.distribute.CrossDeviceOps` of devices of several processes: an all-reduce by peer
    collectives, of which devices[0]'s result is used (no device receives every part)."""
    if isinstance(communication, tf.distribute.CrossDeviceOps):
        return communication.reduce(tf.distribute.ReduceOp.SUM,
                                    tf_runtime.per_replica(parts), destinations=devices[0])
    with tf.device(devices[0]):
        if communication == "nccl":
            return tf.raw_ops.NcclReduce(input=list(parts), reduction="sum", name=name)
        return tf.add_n(list(parts), name=name)


def _copies(x, devices):
    copies = []
    for device in devices:
        with tf.device(device):
            copies.append(tf.identity(x))
    return copies


def copy_to_shards(x, devices, communication):
    """Megatron's f: x on every device; in the backward pass, the sum of their gradients."""

    @tf.custom_gradient
    def copy(x):
        def gradient(*upstream):
            grads = [u if u is not None else tf.zeros_like(x) for u in upstream]
            return reduce_sum(grads, devices, communication, BACKWARD_REDUCTION)

        return _copies(x, devices), gradient

    return copy(x)


def sum_of_shards(parts, devices, communication):
    """Megatron's g: the sum of the partial results; in the backward pass, its gradient
    copied to every device."""

    @tf.custom_gradient
    def total(*parts):
        def gradient(upstream):
            return _copies(upstream, devices)

        return reduce_sum(parts, devices, communication, FORWARD_REDUCTION), gradient

    return total(*parts)


def _input_of(args, kwargs):
    return args[0] if args else kwargs["inputs"]


def _gathered(split_value, devices):
    with tf.device(devices[0]):
        return tf.concat(split_value.parts, split_value.axis, name=GATHER)


class _Handed(threading.local):
    """The slices of the column layers a composite layer called in this thread, by the
    gathered output it was handed: a row layer the composite calls on that very tensor
    (an MLP inside a Transformer block) takes the slices, and the gather is never run."""

    def __init__(self):
        self.slices = None


_handed = _Handed()


@contextlib.contextmanager
def _handing_slices():
    before, _handed.slices = _handed.slices, {}
    try:
        yield
    finally:
        _handed.slices = before


def _hand(gathered, parts):
    if _handed.slices is not None:
        _handed.slices[id(gathered)] = (gathered, parts)


def _slices_handed(x, axis):
    entry = (_handed.slices or {}).get(id(x))
    if entry is not None and entry[0] is x and entry[1].axis == axis:
        return entry[1].parts
    return None


def column_call(split, shards, stage_devices, keep_split, group_of=None):
    """The call of a column layer: a `Split` of its output when `keep_split`. With
    `group_of` (peer collectives) and in a function, each device's share reads its own copy
    of the input (a `Replicated` one as it is), through Megatron's f."""
    layer, kernels = split.layer, shards[0]
    biases = shards[1] if split.bias_split else [layer.bias] * len(kernels)

    def call(args, kwargs, training):
        del training
        devices, communication = stage_devices()
        x = _input_of(args, kwargs)
        mask = _mask_of(x)
        if _replicates(group_of):
            group = group_of(devices)
            if isinstance(x, tensor_groups.Replicated):
                copies = x.copies
            else:
                copies = tensor_groups.enter(
                    _gathered(x, devices) if isinstance(x, Split) else x, devices)
            x = copies[0]
            parts = Split([placed(functools.partial(_column_share, layer, k, b, group, t), d,
                                  (c,), {})
                           for t, (k, b, d, c) in enumerate(zip(kernels, biases, devices,
                                                                copies))], split.out_axis)
        else:
            if isinstance(x, Split):
                x = _gathered(x, devices)
            copies = copy_to_shards(x, devices, communication)
            parts = Split([placed_call(functools.partial(keras_tp.column_shard, layer, k, b),
                                       d, c)
                           for k, b, d, c in zip(kernels, biases, devices, copies)],
                          split.out_axis)
        if keep_split:
            parts.mask = mask if layer.supports_masking else None
            return parts
        gathered = _gathered(parts, devices)
        _hand(gathered, parts)
        return keras_tp.with_output_mask(layer, x, gathered, mask)

    return call


def _column_share(layer, kernel, bias, group, t, x):
    return keras_tp.column_shard(layer, kernel, bias, group.f(x, t))


def _replicates(group_of):
    """Whether split layers run with peer collectives now: asked for, and in a function
    (eagerly, each device's collective would wait for the next device's Python)."""
    return (group_of is not None and not tf.executing_eagerly()
            and not models.in_symbolic_scope())


def row_call(split, shards, stage_devices, group_of=None):
    """The call of a row layer, on a `Split` input or a whole one. With `group_of` (peer
    collectives) and in a function: each device's partial product is all-reduced onto every
    device (Megatron's g), which adds the bias and the activation itself; the output is
    `Replicated`."""
    layer, kernels = split.layer, shards[0]

    def call(args, kwargs, training):
        del training
        devices, communication = stage_devices()
        x = _input_of(args, kwargs)
        mask = _mask_of(x)
        slices = _slices_handed(x, split.in_axis)
        if isinstance(x, Split) and x.axis == split.in_axis:
            slices = x.parts
        elif isinstance(x, tensor_groups.Replicated):
            slices = [_slice_on(c, t, len(devices), split.in_axis, d)
                      for t, (c, d) in enumerate(zip(x.copies, devices))]
            x = x.copies[0]
        elif slices is None:
            if isinstance(x, Split):
                x = _gathered(x, devices)
            slices = []
            for part, device in zip(tf.split(x, len(devices), split.in_axis), devices):
                with tf.device(device):
                    slices.append(tf.identity(part))
        if _replicates(group_of):
            group = group_of(devices)
            outputs = []
            for t, (k, d, piece) in enumerate(zip(kernels, devices, slices)):
                # The bias's gradient is equal on every device: the first device's counts.
                keep = None if t == 0 else functools.partial(_is_storage_of, _storage_ids(k))
                y = placed(functools.partial(_row_share, layer, k, group, t), d, (piece,), {},
                           keep)
                outputs.append(keras_tp.with_output_mask(layer, x, y, mask))
            return tensor_groups.Replicated(outputs)
        partials = [placed_call(functools.partial(keras_tp.row_shard, layer, k), d, s)
                    for k, d, s in zip(kernels, devices, slices)]
        y = sum_of_shards(partials, devices, communication)
        with tf.device(devices[0]):
            y = keras_tp.bias_and_activation(layer, y)
        return keras_tp.with_output_mask(layer, x, y, mask)

    return call


def _row_share(layer, kernel, group, t, x):
    return keras_tp.bias_and_activation(layer, group.g(keras_tp.row_shard(layer, kernel, x), t))


def _is_storage_of(ids, variable):
    return id(variable) in ids


def _slice_on(x, t, parts, axis, device):
    with tf.device(device):
        return tf.split(x, parts, axis)[t]


class _Shard(threading.local):
    """The shard of the heads an attention layer's call is running for in this thread."""

    def __init__(self):
        self.index = None


_shard = _Shard()


def _projection_on_shard(split, shards, group=None, inputs_seen=None):
    """A projection's call for the shard `_shard.index` of the stage's devices: a column's
    product with its kernel (and bias) shard, a row's partial product with its kernel shard.
    With `group` (a block run replicated): a column's input through f (one f per input
    tensor and device: a block's query, key and value read one, `inputs_seen`), a row's
    slice of a whole input taken, its partial product all-reduced (g) and the whole bias
    and activation added, as every device does; without, the row's bias is added once,
    after the sum."""
    layer, kernels = split.layer, shards[0]
    biases = shards[1] if split.bias_split else [layer.bias] * len(kernels)

    def call(inputs, *args, **kwargs):
        t = _shard.index
        if split.kind == COLUMN:
            if group is not None:
                key = (id(inputs), t)
                if key not in inputs_seen:
                    inputs_seen[key] = (inputs, group.f(inputs, t))
                inputs = inputs_seen[key][1]
            return keras_tp.column_shard(layer, kernels[t], biases[t], inputs)
        if group is None:
            return keras_tp.row_shard(layer, kernels[t], inputs)
        x = inputs
        shard_size = kernels[t].shape[split.split_variables[0][1]]
        if x.shape[split.in_axis] != shard_size:  # A whole input: this device's slice.
            x = tf.split(x, len(kernels), split.in_axis)[t]
        return _row_share(layer, kernels[t], group, t, x)

    return call


def _runs_by_heads(projections, splits):
    """Whether an attention layer's query, key and value projections are column-split and
    its output projection row-split along the heads axis (the second from the end of a
    (..., heads, head size) projection): then each device can run whole heads."""
    *qkv, output = (splits.get(id(layer)) for layer in projections)
    return (all(s is not None and s.kind == COLUMN and s.out_axis == -2 for s in qkv)
            and output is not None and output.kind == ROW and output.in_axis == -2)


def head_split_call(attention, projections, stage_devices, gathered_calls):
    """The call of an attention layer run by heads (Megatron's attention): each of the
    stage's T devices runs the layer's own call on a copy of its inputs with its share of
    the heads (the projections' shards), so scores, softmax and the weighted sum of values
    stay on it and divide by T; the T shares of the output projection's product are
    summed (one reduction each way, as a Megatron pair) and the bias added once.
    `projections`: {projection layer: (SplitLayer, shards)}. A call that returns the
    scores or reads a cache runs with its projections gathered (`gathered_calls`)."""
    shard_calls = {layer: _projection_on_shard(split, shards)
                   for layer, (split, shards) in projections.items()}
    output_split = next(split for split, _ in projections.values() if split.kind == ROW)
    own = keras_tp.own_call(attention)

    def on_shard(t, masks, *args, **kwargs):
        leaves = tf.nest.flatten((args, kwargs))
        for i, mask in masks.items():
            models.set_mask(leaves[i], mask)
        _shard.index = t
        try:
            return own(*args, **kwargs)
        finally:
            _shard.index = None

    def call(*args, **kwargs):
        if not keras_tp.head_by_head_arguments(kwargs):
            with keras_tp.calls_replaced(gathered_calls):
                return own(*args, **kwargs)
        devices, communication = stage_devices()
        leaves = tf.nest.flatten((args, kwargs))
        copies = {}  # id(tensor) -> its copy on each device: one f per distinct input.
        for x in leaves:
            if tf.is_tensor(x) and id(x) not in copies:
                copies[id(x)] = (copy_to_shards(x, devices, communication)
                                 if x.dtype.is_floating else _copies(x, devices))
        masks = {i: models.mask_of(x) for i, x in enumerate(leaves)
                 if models.mask_of(x) is not None}
        partials = []
        with keras_tp.calls_replaced(shard_calls):
            for t, device in enumerate(devices):
                shard_leaves = [copies[id(x)][t] if tf.is_tensor(x) else x for x in leaves]
                shard_args, shard_kwargs = tf.nest.pack_sequence_as((args, kwargs), shard_leaves)
                partials.append(placed_call(functools.partial(on_shard, t, masks), device,
                                            *shard_args, **shard_kwargs))
        y = sum_of_shards(partials, devices, communication)
        with tf.device(devices[0]):
            y = keras_tp.bias_and_activation(output_split.layer, y)
        models.keep_mask(partials[0], y)
        return y

    return call


def _shares_stay_local(composite, splits):
    """Whether each device of a block run replicated can compute its share alone: every
    attention layer with a split projection split by heads in all four, and columns
    outside attention split along their last axis only where a row layer reads that axis
    split (the block's MLP: nothing but elementwise code between them). A split by head
    size, or a column whose whole output an unsplit layer reads, needs the whole output:
    such a block runs on the first device instead."""
    by_id = {id(layer): split for layer, (split, _) in splits.items()}
    in_attention = set()
    for layer in [composite, *keras_tp.sublayers(composite)]:
        projections = keras_tp.attention_projections(layer)
        if projections is None:
            continue
        in_attention.update(id(p) for p in projections)
        if any(id(p) in by_id for p in projections) and not _runs_by_heads(projections, by_id):
            return False
    others = [split for key, split in by_id.items() if key not in in_attention]
    columns = [s for s in others if s.kind == COLUMN]
    rows = [s for s in others if s.kind == ROW]
    return all(s.out_axis == -1 for s in columns) and (
        not columns or any(s.in_axis == -1 for s in rows))


def _storage_ids(variable):
    """Ids of the TensorFlow variables a read of Keras `variable` may touch (its storage and,
    under the strategy, each copy)."""
    value = models.storage(variable)
    copies = tf.distribute.get_strategy().experimental_local_results(value)
    return {id(value), *(id(c) for c in copies)}


def replicated_call(composite, splits, stage_devices, group_of, fallback):
    """The call of a block run replicated on the stage's T devices (Megatron's block):
    each device runs the block's own call on its copy of the inputs, every split layer
    answering with that device's share (`_projection_on_shard`), the row layers' sums
    all-reduced by peer collectives (`tensor_groups.TensorGroup`), so layer norms,
    residuals and attention by heads run on every device and no device sums for the
    others. The output is `Replicated`: the next replicated block takes its copies, any
    other consumer the first device's. `fallback` runs the block when this cannot (eager
    execution: the devices' collectives would wait for each other's Python)."""
    sharded = [v for _, shards in splits.values() for group_shards in shards
               for v in group_shards]
    column_biases = [split.layer.bias for split, _ in splits.values()
                     if split.kind == COLUMN and not split.bias_split
                     and split.layer.bias is not None]

    def call(args, kwargs, training):
        if not _replicates(group_of):
            return fallback(tensor_groups.whole_values(args),
                            tensor_groups.whole_values(kwargs), training)
        devices, _ = stage_devices()
        group = group_of(devices)
        # Gradients of what every device computes alike (layer norms, a row's bias) are
        # taken from the first device's run; the shares' from each.
        own = set()
        for variable in sharded + column_biases:
            own |= _storage_ids(variable)
        leaves = tf.nest.flatten((args, kwargs))
        copies = {}
        for x in leaves:
            if isinstance(x, tensor_groups.Replicated):
                copies[id(x)] = x.copies
            elif tf.is_tensor(x) and id(x) not in copies:
                copies[id(x)] = tensor_groups.enter(x, devices)
        inputs_seen = {}
        projections = {split.layer: _projection_on_shard(split, shards, group, inputs_seen)
                       for split, shards in splits.values()}
        outputs = []
        rows = [split.layer for split, _ in splits.values() if split.kind == ROW]
        with keras_tp.calls_replaced(projections), keras_tp.input_specs_lifted(rows):
            for t, device in enumerate(devices):
                shard_leaves = [copies[id(x)][t] if id(x) in copies else x for x in leaves]
                shard_args, shard_kwargs = tf.nest.pack_sequence_as((args, kwargs),
                                                                    shard_leaves)

                def run(*a, t=t, **k):
                    _shard.index = t
                    try:
                        return keras_tp.run_node(composite, a, k, training)
                    finally:
                        _shard.index = None

                keep = None if t == 0 else functools.partial(_is_storage_of, own)
                outputs.append(placed(run, device, shard_args, shard_kwargs, keep))
        flat = [tf.nest.flatten(o) for o in outputs]
        return tf.nest.pack_sequence_as(outputs[0], [
            tensor_groups.Replicated(per_device) if tf.is_tensor(per_device[0]) else per_device[0]
            for per_device in zip(*flat)])

    return call


def _repeated_where_replicated(layer, stage_devices, group_of, reads_model_input):
    """The call of an unsplit node no larger than its input: run on every device when its
    input is `Replicated` or the model's own (as Megatron runs what follows a row layer, and
    the first layers, on every rank: no device sends the others its output, nor their
    gradient back), else once."""
    repeated = replicated_call(layer, {}, stage_devices, group_of, None)

    def call(args, kwargs, training):
        leaves = tf.nest.flatten((args, kwargs))
        if (reads_model_input or any(isinstance(x, tensor_groups.Replicated)
                                     for x in leaves)) and _replicates(group_of):
            return repeated(args, kwargs, training)
        args, kwargs = tensor_groups.whole_values((args, kwargs))
        return keras_tp.run_node(layer, args, kwargs, training)

    return call


def _no_larger_than_input(node):
    """Whether a node's outputs hold no more numbers per example than its inputs."""
    def size(tensors):
        total = 0
        for t in tensors:
            dims = list(t.shape)[1:]
            if any(d is None for d in dims):
                return None
            total += int(np.prod(dims, dtype=np.int64))
        return total

    given, made = size(node.input_tensors), size(node.outputs)
    return given is not None and made is not None and made <= given


def _as_layer_call(split_call):
    """A split layer's call as its `call` attribute (inputs, then Keras' keywords)."""

    def call(inputs, *args, **kwargs):
        return split_call((inputs, *args), {}, kwargs.get("training"))

    return call


def _composite_call(composite, replacements):
    """The call of a layer of layers whose split layers (`replacements`: {layer: call}) run
    split while it runs."""

    def call(args, kwargs, training):
        with keras_tp.calls_replaced(replacements), _handing_slices():
            return keras_tp.run_node(composite, args, kwargs, training)

    return call


def _calls_within(composite, splits, devices):
    """{layer inside `composite` (or itself): its call} for the split layers the composite
    calls (`splits`: {layer: (SplitLayer, shards)}): each attention layer whose projections
    are split by heads runs by heads; the other split layers run split with their output
    gathered (a column) or input sliced (a row), a column's slices handed to a row layer
    called on its output."""
    by_id = {id(layer): split for layer, (split, _) in splits.items()}
    gathered = {layer: _as_layer_call(column_call(split, shards, devices, False)
                                      if split.kind == COLUMN else
                                      row_call(split, shards, devices))
                for layer, (split, shards) in splits.items()}
    calls = dict(gathered)
    for layer in [composite, *keras_tp.sublayers(composite)]:
        projections = keras_tp.attention_projections(layer)
        if projections is None or not _runs_by_heads(projections, by_id):
            continue
        for projection in projections:
            del calls[projection]
        calls[layer] = head_split_call(
            layer, {p: splits[p] for p in projections}, devices,
            {p: gathered[p] for p in projections})
    return calls


def _sole_consumer(node, program, stage):
    """The node of `stage` that alone reads `node`'s output (not the stage's output)."""
    output = node.outputs[0]
    if any(t is output for t in stage.output_tensors) or len(node.outputs) != 1:
        return None
    readers = [n for s in program.stages for n in s.nodes
               if any(t is output for t in n.input_tensors)]
    if len(readers) != 1 or readers[0] not in stage.nodes:
        return None
    if any(t is output for t in program.graph.outputs):
        return None
    return readers[0]


def make_shards(variable, axis, homes):
    """Keeps `variable` as len(homes) shards along `axis`, shard t with its copies on
    `homes[t]` (one device per replica); returns the shards (Keras variables).

    The whole value is made, and later read whole (`get_weights`, saving), on this
    process's CPU (the chief's, with stages on worker processes), never on a stage device:
    a device holds its shard and no more, and the initializer draws what one device's
    would."""
    host = devices_lib.host_of(devices_lib.host_task())
    with tf.device(host):
        value = keras_tp.initial_value(variable)
        parts = tf.split(value, len(homes), axis)
    shards = []
    for t, (part, home) in enumerate(zip(parts, homes)):
        with variable_birth.variable_home(home):
            shards.append(keras_tp.shard_variable(variable, part, t))
    keras_tp.store_as_shards(variable, keras_tp.ShardedStorage(
        shards, axis, variable.shape, variable.dtype, host, name=variable.path))
    return tuple(shards)


class Crossings:
    """How a replicated stage's values cross to the next stage in a training step, and how a
    replicated first stage takes the model's inputs (Megatron's scatter-gather: each of the
    T links carries 1/T of an activation, the group all-gathers the rest;
    `tensor_groups.scatter_rows`). Values whose rows do not split into T static parts
    cross whole, through the stage's first device, as outside a training step."""

    def __init__(self, program, stage_devices, group_of):
        self._program, self._stage_devices, self._group_of = program, stage_devices, group_of

    def _group(self, index):
        devices, _ = self._stage_devices(index)
        return self._group_of(devices)

    def leave(self, index, value, whole):
        if not isinstance(value, tensor_groups.Replicated) or not _replicates(self._group_of):
            return whole(value)
        next_devices, _ = self._stage_devices(index + 1)
        sliced = tensor_groups.scatter_rows(value, self._group(index), next_devices)
        return whole(value) if sliced is None else sliced

    def arrive(self, index, inputs):
        def gathered(x):
            return (tensor_groups.gather_rows(x, self._group(index))
                    if isinstance(x, tensor_groups.Sliced) else x)

        if isinstance(inputs, tuple) and not isinstance(inputs, tensor_groups.Sliced):
            return tuple(gathered(x) for x in inputs)
        return gathered(inputs)

    def fed(self, values, stage):
        """`values` (the model's inputs by id of their symbolic tensors) with each one that a
        replicated node of the first stage reads spread over the stage's devices."""
        if not _replicates(self._group_of):
            return values
        read = {id(t) for node in stage.nodes if id(node) in self._program.takes_replicated
                for t in node.input_tensors}
        group, spread = None, dict(values)
        for key, x in values.items():
            if key in read and tf.is_tensor(x):
                group = group or self._group(stage.index)
                replicated = tensor_groups.spread_rows(x, group)
                if replicated is not None:
                    spread[key] = replicated
        return spread


def split_program(program, planned, shard_homes, stage_devices, group_of):
    """Gives each planned layer's split variables their shards and the program the split
    calls. `shard_homes(stage_index)`: for each of the stage's T devices, its device in
    every replica; `stage_devices(stage_index)`: () -> (this replica's T devices of the
    stage, their communication), asked while a step is built; `group_of(devices)`: their
    `tensor_groups.TensorGroup` (split layers and blocks run with peer collectives, in a
    function). Returns the stages with their variables replaced by shards."""
    stages = []
    program.whole_values = tensor_groups.whole_values
    program.crossings = Crossings(program, stage_devices, group_of)
    model_inputs = {id(t) for t in program.graph.inputs}
    for stage in program.stages:
        homes = shard_homes(stage.index)
        devices = functools.partial(stage_devices, stage.index)
        split_ids = set()
        inner = {}  # id(composite layer) -> (it, {its split layer: the call run for it})
        held = {id(layer) for layer in stage.layers}
        for split in planned.values():
            if id(split.layer) not in held and id(split.within) not in held:
                continue
            layer = split.layer
            shards = []
            for variable, axis in split.split_variables:
                made = make_shards(variable, axis, homes)
                program.substitutes[id(variable)] = made
                split_ids.add(id(variable))
                shards.append(made)
            if split.within is not None:
                inner.setdefault(id(split.within), (split.within, {}))[1][split.layer] = (
                    split, shards)
                continue
            node = next(n for n in stage.nodes if n.operation is layer)
            if split.kind == COLUMN:
                reader = _sole_consumer(node, program, stage)
                read_by = planned.get(id(reader.operation)) if reader is not None else None
                keep = (read_by is not None and read_by.kind == ROW
                        and read_by.in_axis == split.out_axis)
                program.calls[id(node)] = column_call(split, shards, devices, keep, group_of)
            else:
                program.calls[id(node)] = row_call(split, shards, devices, group_of)
            program.takes_replicated.add(id(node))
        for composite, splits in inner.values():
            node = next(n for n in stage.nodes if n.operation is composite)
            call = _composite_call(composite, _calls_within(composite, splits, devices))
            if (keras_tp.replication_refusal(composite) is None
                    and _shares_stay_local(composite, splits)):
                call = replicated_call(composite, splits, devices, group_of, call)
                program.takes_replicated.add(id(node))
            program.calls[id(node)] = call
        for node in stage.nodes:
            if (id(node) not in program.calls and _no_larger_than_input(node)
                    and keras_tp.repeat_refusal(node.operation) is None):
                program.calls[id(node)] = _repeated_where_replicated(
                    node.operation, devices, group_of,
                    any(id(t) in model_inputs for t in node.input_tensors))
                program.takes_replicated.add(id(node))
        stages.append(dataclasses.replace(
            stage,
            trainable_variables=tuple(program.optimizer_variables(stage.trainable_variables)),
            placed_variables=tuple(v for v in stage.placed_variables if id(v) not in split_ids)))
    return tuple(stages)
