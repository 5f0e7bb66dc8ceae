"""Keras variables whose storage is split over devices (tensor parallelism): the Keras side.

A tensor-parallel pipeline stage (`tfpar.distribute.pipeline.tensor_parallel`) keeps a
split layer's kernel as T shards, each a Keras variable of its own on one device. The
layer's own variable stays what Keras, the user and checkpoints see (same object, name,
path and shape); its storage becomes a `ShardedStorage` over the shards: a read gives the
whole value (the shards concatenated), a write (`load_weights`, `set_weights`, a restored
checkpoint) divides the value over the shards. Training reads and updates the shards
directly: the optimizer is built for them.

What Keras does in a layer's `__call__` around `call` is not done by a split call, but for
the output's mask (`with_output_mask`); `refusal` names the layers that need the rest (input
casting, regularizers, constraints).
"""

import contextlib
import functools

import numpy as np
import tensorflow as tf

from tfpar.keras import hooks
from tfpar.keras import internals
from tfpar.keras import variable_birth


class ShardedStorage:
    """The storage of a Keras variable held as shards (Keras variables) along `axis`."""

    # A TensorFlow checkpoint hands its restore every slice (`variable_birth`).
    RESTORES_SLICES = True

    def __init__(self, shards, axis, shape, dtype, device, name=""):
        self.shards = tuple(shards)
        self._shared_name = name  # The whole variable's (a checkpoint's "full name").
        self.axis = axis
        self.shape = tf.TensorShape(shape)
        self.dtype = tf.as_dtype(dtype)
        self.device = device  # Where a whole read is assembled.

    def read_value(self):
        with tf.device(self.device):
            return tf.concat([_fetch(s, self.device) for s in self.shards], self.axis)

    def value(self):
        return self.read_value()

    def numpy(self):
        return self.read_value().numpy()

    def __array__(self, dtype=None):
        return np.asarray(self.numpy(), dtype=dtype)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        del use_locking, name
        value = tf.convert_to_tensor(value, dtype=self.dtype)
        if value.shape != self.shape:
            raise ValueError(f"Cannot assign a value of shape {value.shape} to a variable of "
                             f"shape {self.shape} (split into {len(self.shards)} shards).")
        for shard, part in zip(self.shards, tf.split(value, len(self.shards), self.axis)):
            shard.assign(part)
        return self.read_value() if read_value else None

    def __repr__(self):
        return (f"ShardedStorage(shape={self.shape}, axis={self.axis}, "
                f"shards={[s.path for s in self.shards]})")

    # TensorFlow checkpoints (`tf.train.Checkpoint`): Keras' variable hands its checkpointing
    # to its storage. The variable is saved whole, under its own key, as T slices: each
    # shard's value, written by the process that holds it (TensorFlow's saver writes each
    # task's tensors there), and read back as any slicing of the whole (TensorFlow's
    # checkpoint reader assembles slices): by a plain one-device model, or by another T.

    def _slice_specs(self):
        """TensorFlow's slice spec (`Variable.SaveSliceInfo.spec`) of each shard."""
        specs, offset = [], 0
        full = self.shape.as_list()
        axis = self.axis % len(full)
        for shard in self.shards:
            shape = list(shard.shape)
            start = [0] * len(full)
            start[axis] = offset
            offset += shape[axis]
            specs.append(tf.Variable.SaveSliceInfo(
                full_name="", full_shape=full, var_offset=start, var_shape=shape).spec)
        return specs

    def _serialize_to_tensors(self):
        slices = {}
        for shard, spec in zip(self.shards, self._slice_specs()):
            # (The class's method: the shard's own is patched to save nothing, below.)
            saved = type(shard)._serialize_to_tensors(shard)  # pylint: disable=protected-access
            internals.check(set(saved) == {_VALUE_KEY},
                            f"a variable's checkpoint tensors {{{_VALUE_KEY!r}: value}}, "
                            f"not {sorted(saved)}")
            slices[spec] = saved[_VALUE_KEY]
        return {_VALUE_KEY: slices}

    def _restore_from_tensors(self, restored_tensors):
        slices = restored_tensors[_VALUE_KEY]
        if not isinstance(slices, dict):
            # TensorFlow's own restore of an object whose checkpoint is several slices under
            # one name hands it one slice (`TrackableSaveable.restore` keys restored tensors
            # by name; tfpar's wrap, `variable_birth`, hands them all): restoring on would
            # write that slice into every shard.
            raise ValueError(
                f"A tensor-parallel variable ({self._shared_name or self}) was given one of "
                f"its {len(self.shards)} slices by a TensorFlow checkpoint restore that does "
                f"not go through tfpar's (a restore outside the strategy's wraps). Read the "
                f"checkpoint into the model built without a strategy "
                f"(tf.train.Checkpoint(model=plain).read(path)) and copy its weights "
                f"(model.set_weights(plain.get_weights())), or save and load with Keras "
                f"(model.save_weights / model.load_weights).")
        return [type(shard)._restore_from_tensors(shard, {_VALUE_KEY: slices[spec]})  # pylint: disable=protected-access
                for shard, spec in zip(self.shards, self._slice_specs())]


_VALUE_KEY = variable_birth.VALUE_KEY


# A shard of another task comes over in pieces of at most this many bytes: its worker
# then holds one piece's send buffer at a time (gRPC copies what it sends), not a shard's
# (measured: reading a 96 MiB shard whole raised its worker's peak by 130 MiB).
FETCH_BYTES = 16 * 2**20


def _fetch(shard, device):
    """The value of `shard` (a Keras variable) on `device`: whole from this process's own
    devices, in pieces along its first axis from another task's."""
    from tfpar import devices as devices_lib

    variable = shard.value
    where = variable.device
    if not where or devices_lib.task_of(where) == devices_lib.task_of(device):
        return tf.convert_to_tensor(shard)
    shape = variable.shape
    row_bytes = max(1, shape[1:].num_elements() * variable.dtype.size)
    step = max(1, FETCH_BYTES // row_bytes)
    pieces = []
    for start in range(0, shape[0], step):
        with tf.device(where):
            piece = variable[start:start + step]
        with tf.device(device):
            pieces.append(tf.identity(piece))
        del piece  # Freed on its worker before the next piece is cut.
    return tf.concat(pieces, 0) if len(pieces) > 1 else pieces[0]


def _to_tensor(value, dtype=None, name=None, as_ref=False):
    del name, as_ref
    tensor = value.read_value()
    return tensor if dtype is None else tf.cast(tensor, dtype)


tf.register_tensor_conversion_function(ShardedStorage, _to_tensor)


def initial_value(variable):
    """The whole value `variable` starts from: its value if it has storage, else what its
    initializer makes (a variable kept without storage until it is placed)."""
    if not variable_birth.has_no_storage(variable):
        return tf.convert_to_tensor(variable)
    initializer = internals.attr(variable, "_initializer")
    initializer = getattr(initializer, "initializer", initializer)  # A pending variable's.
    return tf.convert_to_tensor(initializer(tuple(variable.shape), dtype=variable.dtype))


def store_as_shards(variable, storage):
    """Makes `storage` (a `ShardedStorage`) the storage of `variable`, which had none or
    whose own storage is dropped. Keras' variable must hand its TensorFlow checkpointing to
    its storage (`ShardedStorage._serialize_to_tensors`)."""
    for method in ("_serialize_to_tensors", "_restore_from_tensors"):
        internals.check(internals.delegates(type(variable), method, f"self.value.{method}("),
                        f"{type(variable).__name__}.{method} handing the checkpoint to its "
                        f"storage (self.value.{method})")
    internals.set_attr(variable, "_value", storage)
    internals.set_attr(variable, "_initializer", None)  # As Keras' own storage leaves it.
    for shard in storage.shards:
        # Saved as slices of the whole variable: not again where the optimizer, which
        # trains the shards, tracks them.
        hooks.patch_object(shard, "_serialize_to_tensors", _saved_with_the_whole)


def _saved_with_the_whole():
    return {}


def sharded_storage(variable):
    """The `ShardedStorage` of a Keras variable, or None."""
    value = internals.attr(variable, "_value")
    return value if isinstance(value, ShardedStorage) else None


def is_layout_map(value):
    import keras

    return isinstance(value, keras.distribution.LayoutMap)


def einsum_spec(layer):
    """(input, kernel, output, bias) einsum specs of a Dense or EinsumDense layer whose
    class keeps Keras' own call (Dense: "...i", "io", "...o", "o"), or None for any other
    layer. The bias spec is the output's from its first biased axis (Keras' bias shape)."""
    import re

    import keras

    dense, einsum = keras.layers.Dense, keras.layers.EinsumDense
    if isinstance(layer, dense) and type(layer).call is dense.call:
        return "...i", "io", "...o", "o"
    if not (isinstance(layer, einsum) and type(layer).call is einsum.call):
        return None
    match = re.fullmatch(r"([a-zA-Z.]+),([a-zA-Z]+)->([a-zA-Z.]+)", layer.equation)
    if match is None:
        return None
    inputs, kernel, outputs = match.groups()
    letters = bias_letters(layer)
    bias = outputs[min(outputs.index(c) for c in letters):] if letters else ""
    return inputs, kernel, outputs, bias


def bias_letters(layer):
    """The output axes a Dense or EinsumDense layer adds its bias along."""
    if layer.bias is None:
        return ""
    return getattr(layer, "bias_axes", None) or "o"


def shard_variable(variable, part, index):
    """A Keras variable holding `part` of `variable` (shard `index`), made where the
    strategy's `variable_home` in effect says."""
    import keras

    from tfpar.keras import models

    # (Placed before the first call, maybe a predict, inside the scope of Keras' build.)
    with models.outside_stateless_scope():
        return keras.Variable(part, dtype=variable.dtype, trainable=variable.trainable,
                              name=f"{variable.name}_shard{index}")


def _computed(layer, value):
    """`value` in the layer's compute dtype, as Keras' `Layer.__call__` gives the layer its
    inputs and, in its autocast scope, its variables (a mixed policy: float32 variables,
    bfloat16 or float16 computation). A split call does not run through `__call__`."""
    import keras

    return keras.ops.cast(value, layer.compute_dtype)


def _product(layer, x, kernel):
    import keras

    x, kernel = _computed(layer, x), _computed(layer, kernel)
    if isinstance(layer, keras.layers.EinsumDense):
        return keras.ops.einsum(layer.equation, x, kernel)
    return keras.ops.matmul(x, kernel)


def column_shard(layer, kernel, bias, x):
    """A column shard of a Dense or EinsumDense `layer`'s call: its product of x with a
    kernel shard, plus `bias` (a shard, or the whole bias when it has no split axis), then
    the activation."""
    return bias_and_activation(layer, _product(layer, x, kernel), bias)


def row_shard(layer, kernel, x):
    """A row shard's partial product: the layer's product of an input slice and a kernel
    shard."""
    return _product(layer, x, kernel)


def bias_and_activation(layer, y, bias=None):
    """y + bias (the layer's own by default), then the layer's activation."""
    import keras

    bias = layer.bias if bias is None else bias
    y = _computed(layer, y)
    if bias is not None:
        y = keras.ops.add(y, _computed(layer, bias))
    return layer.activation(y) if layer.activation is not None else y


def with_output_mask(layer, inputs, outputs, mask):
    """`outputs` with the mask Keras' `Layer.__call__` gives the output of `layer` called on
    an input carrying `mask` (a layer that supports masking passes its `compute_mask` on;
    one that does not drops it, as Keras does)."""
    if mask is not None and layer.supports_masking:
        internals.attr(layer, "_set_mask_metadata")(inputs, outputs, mask)
    return outputs


def refusal(layer):
    """Why a layer's call cannot be split (what Keras' `__call__` or `call` would do that a
    split call does not), or None."""
    if getattr(layer, "lora_enabled", False):
        return "it has LoRA enabled"
    if getattr(layer, "quantization_mode", None):
        return f"it is quantized ({layer.quantization_mode})"
    for what in ("kernel_constraint", "bias_constraint", "kernel_regularizer",
                 "bias_regularizer", "activity_regularizer"):
        if getattr(layer, what, None) is not None:
            return f"it has a {what}"
    return None


# Attention classes whose `call` runs head by head, by their source (Keras 3.10-3.15,
# keras-hub 0.2x-0.32): given query, key, value and output projections cut to a share of
# the heads, it computes those heads' share of the output projection's product, reading no
# count of heads after the projections (rotary positions and grouped key/value heads act
# per head). Named by module path: keras-hub need not be installed. Gemma's attention
# reads its head count in its core: it is not here (its projections are gathered instead).
# Each name maps to the attribute holding its dropout rate.
_HEAD_BY_HEAD = {
    "keras.src.layers.attention.multi_head_attention.MultiHeadAttention": "_dropout",
    "keras_hub.src.layers.modeling.cached_multi_head_attention.CachedMultiHeadAttention":
        "_dropout",
    "keras_hub.src.models.llama.llama_attention.LlamaAttention": "dropout",
}
PROJECTIONS = ("_query_dense", "_key_dense", "_value_dense", "_output_dense")


def attention_projections(layer):
    """(query, key, value, output) projection layers of an attention layer whose call can
    run on a share of its heads (`_HEAD_BY_HEAD`), or None: another class, a gated
    attention, or dropout on the attention (a share of the heads would draw another mask
    than the whole layer draws)."""
    cls = type(layer)
    dropout = _HEAD_BY_HEAD.get(f"{cls.__module__}.{cls.__qualname__}")
    if dropout is None:
        return None
    rate = internals.attr(layer, dropout) if dropout.startswith("_") else getattr(layer, dropout)
    import keras

    gated = (isinstance(layer, keras.layers.MultiHeadAttention)
             and internals.attr(layer, "_use_gate"))
    if gated or rate:
        return None
    return tuple(internals.attr(layer, name) for name in PROJECTIONS)


def head_by_head_arguments(kwargs):
    """Whether a call of an attention layer with `kwargs` can run head by head: not when
    it returns the scores or reads a cache (generation, not training)."""
    return not kwargs.get("return_attention_scores") and kwargs.get("cache") is None


# Blocks whose call, run on each of T devices with every split layer answering with its
# share (`tensor_parallel.replicated_call`), computes that device's share and nothing that
# needs a split layer's whole output (read in each class's source, Keras 3.10-3.15,
# keras-hub 0.2x-0.32): between a column and a row layer only elementwise code
# (activations, Llama's gated product) and attention run by heads.
_REPLICABLE = {
    "keras_hub.src.layers.modeling.transformer_decoder.TransformerDecoder",
    "keras_hub.src.layers.modeling.transformer_encoder.TransformerEncoder",
    "keras_hub.src.models.llama.llama_decoder.LlamaTransformerDecoder",
    *_HEAD_BY_HEAD,
}


def replication_refusal(composite):
    """Why `composite` (a layer of layers) cannot run replicated on a stage's T devices,
    or None: another class, randomness (each device would draw its own: dropout), state
    updated in the call (BatchNormalization's moving statistics, T times), or losses added
    in the call (T times)."""
    cls = type(composite)
    if f"{cls.__module__}.{cls.__qualname__}" not in _REPLICABLE:
        return f"{cls.__name__} is not a block known to run replicated"
    for layer in [composite, *sublayers(composite)]:
        if _is_attention(layer) and attention_projections(layer) is None:
            return f"attention layer {layer.name!r} cannot run by heads"
    return repeat_refusal(composite)


def repeat_refusal(layer):
    """Why `layer` (no split weights) cannot run again on each device that holds a copy of
    its input, or None: randomness, state updated in the call, or losses added in it."""
    import keras

    if not isinstance(layer, keras.layers.Layer):
        return None  # An op of the graph (keras.ops): no state.
    for sub in [layer, *sublayers(layer)]:
        if internals.attr(sub, "_seed_generators"):
            return f"layer {sub.name!r} draws random numbers"
        if getattr(sub, "activity_regularizer", None) is not None:
            return f"layer {sub.name!r} adds an activity regularization loss"
    if getattr(layer, "non_trainable_weights", None):
        return "it holds non-trainable state"
    return None


def _is_attention(layer):
    return all(hasattr(layer, name) for name in PROJECTIONS)


def own_call(layer):
    """The `call` of the layer's class, bound to it (not one set on the instance)."""
    return functools.partial(type(layer).call, layer)


def sublayers(layer):
    """The layers nested in `layer` (a composite such as a Transformer block), not itself."""
    return list(internals.attr(layer, "_flatten_layers")(include_self=False))


def run_node(layer, args, kwargs, training):
    """Calls `layer` as Keras' functional graph runs one node."""
    operation_fn = internals.symbol("keras.src.models.functional.operation_fn")
    return operation_fn(layer, training=training)(*args, **kwargs)


@contextlib.contextmanager
def _set_on_instances(values, name):
    """Sets attribute `name` of each object of `values` ({object: value}) for the block."""
    for obj, value in values.items():
        hooks.patch_object(obj, name, value)
    try:
        yield
    finally:
        for obj in values:
            hooks.unpatch_object(obj, name)


@contextlib.contextmanager
def calls_replaced(replacements):
    """While the block runs, each layer of `replacements` ({layer: call(inputs, **kwargs)})
    runs that call in place of its own whenever it is called (inside a composite layer's
    call, which tfpar cannot rewrite): Keras' `Layer.__call__` runs the layer's `call`
    attribute, which is set on the instance for the block."""
    _check_instance_calls()
    with _set_on_instances(replacements, "call"):
        yield


@contextlib.contextmanager
def input_specs_lifted(layers):
    """While the block runs, `layers` check no input spec: a row layer of a block run
    replicated is called on its device's slice, narrower than the whole input its spec
    names (Keras checks the spec in `__call__`, before the call tfpar gives it)."""
    for layer in layers:
        internals.attr(layer, "_input_spec")  # (Fails closed if Keras keeps it elsewhere.)
    with _set_on_instances({layer: None for layer in layers}, "_input_spec"):
        yield


@functools.lru_cache(maxsize=None)
def _check_instance_calls():
    """Fails closed unless a call set on a Keras layer instance is what `__call__` runs."""
    import keras

    probe = keras.layers.Identity()  # No variables: asked inside a step being traced.
    ran = []
    hooks.patch_object(probe, "call", lambda inputs, **kwargs: ran.append(1) or inputs)
    with tf.init_scope():
        probe(tf.zeros((1, 1)))
    hooks.unpatch_object(probe, "call")
    internals.check(ran == [1], "Keras' Layer.__call__ running the `call` of the layer "
                    "instance (tfpar sets it on the split layers inside a composite layer)")
