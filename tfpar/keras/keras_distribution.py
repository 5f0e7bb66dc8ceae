"""Keras' distribution API (`keras.distribution`) on the TensorFlow backend: the Keras side.

On TensorFlow, Keras 3.15 leaves the API unfinished: its backend module says "DO NOT
USE", `distribute_value` is a TODO, and a `DataParallel` trains silently on one device.
`tfpar.use_keras_distribution()` completes it, on TensorFlow's own
SPMD runtime, DTensor (`tfpar.distribute.mesh.mesh_runtime`), which it hands to `install` here (the seam
imports no runtime):

- the backend functions Keras' frontend calls (devices, processes, meshes, layouts,
  `keras.distribution.distribute_tensor`);
- a Keras variable created while a distribution is set is laid out as the distribution
  says (`get_variable_layout`: the regex keys of a `LayoutMap`), its pieces made on their
  devices; optimizer state takes its variable's layout (Keras passes it);
- `fit`, `evaluate` and `predict` of a model on a mesh run Keras' own train, test and
  predict steps, compiled, over DTensor batches, and hand back whole values. Inside a step
  every value has one device's meaning (global view, as on JAX): losses, metrics and
  BatchNorm statistics are those of the whole batch.
"""

import contextlib
import functools
import threading

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar.contract import hooks_of
from tfpar.keras import hooks
from tfpar.keras import internals
from tfpar.keras import replicas

_BACKEND = "keras.src.backend.tensorflow.distribution_lib"

# The runtime `install` is given (the seam imports none): the DTensor mesh runtime (the
# module `tfpar.distribute.mesh.mesh_runtime`: `runtime_of`, `any_mesh`, `MeshVariable`, `mesh_devices`,
# `kernel_mode`, `embedding_mode`) and the strategy a `DataParallel` trains under (made
# from its devices).
_mesh = None
_data_parallel_strategy = None


def install(mesh_runtime, data_parallel_strategy):
    """Makes `keras.distribution` (DeviceMesh, LayoutMap, DataParallel, ModelParallel,
    set_distribution, distribute_tensor) work on the TensorFlow backend, on `mesh_runtime`
    (`tfpar.distribute.mesh.mesh_runtime`), a `DataParallel` under `data_parallel_strategy(devices)`.
    Idempotent. Programs call `tfpar.use_keras_distribution()`, which gives both."""
    import keras

    global _mesh, _data_parallel_strategy
    _mesh, _data_parallel_strategy = mesh_runtime, data_parallel_strategy

    if keras.backend.backend() != "tensorflow":
        raise ValueError("tfpar.use_keras_distribution() is for the TensorFlow backend; "
                         f"Keras runs on {keras.backend.backend()!r}, where Keras' own "
                         f"distribution API applies.")
    backend = internals.symbol(_BACKEND)
    for name, function in _backend_functions().items():
        if getattr(getattr(backend, name, None), "_tfpar_mesh", False):
            continue  # Installed already.
        function._tfpar_mesh = True
        # Keras' own private, replaced, must still be there; the rest its TensorFlow
        # backend lacks.
        hooks.replace_attribute(backend, name, function, private=name.startswith("_"))
    variable = internals.symbol("keras.src.backend.tensorflow.core.Variable")
    internals.attr(variable, "_initialize")
    hooks._wrap_once(variable, "_initialize", _laid_out, "_tfpar_mesh")
    trainer = internals.symbol("keras.src.backend.tensorflow.trainer.TensorFlowTrainer")
    for kind in ("train", "test", "predict"):
        hooks._wrap_once(trainer, f"make_{kind}_function",
                         functools.partial(_mesh_function, kind=kind), "_tfpar_mesh")
    for name in ("fit", "evaluate", "predict"):
        hooks._wrap_once(trainer, name, _in_the_models_distribution, "_tfpar_mesh")
    # (Model too: another tfpar hook may have given it a __call__ of its own already.)
    for owner in (keras.layers.Layer, keras.Model):
        hooks._wrap_once(owner, "__call__", _eager_on_the_mesh, "_tfpar_mesh")
    for module, name, wrap in (("numpy", "flip", _flip_by_gather),
                               ("random", "dropout", _dropout_drawn_whole)):
        internals.symbol(f"keras.src.backend.tensorflow.{module}.{name}")  # (Fails closed.)
        hooks._wrap_once(internals.symbol(f"keras.src.backend.tensorflow.{module}"), name,
                         wrap, "_tfpar_mesh")
    # `Distribution.scope()` calls its module's function; programs call the public one.
    for owner in (internals.symbol("keras.src.distribution.distribution_lib"),
                  keras.distribution):
        hooks._wrap_once(owner, "set_distribution", _following_strategy, "_tfpar_mesh")


def model_parallel(mesh, layout_map=None, batch_dim_name=None):
    """A `keras.distribution.ModelParallel` on `mesh` (a `keras.distribution.DeviceMesh`)
    with `layout_map` (None: every variable replicated), the batch split along
    `batch_dim_name` (default: the mesh's first axis).

    Examples:
      >>> import keras
      >>> mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"],
      ...                                      keras.distribution.list_devices()[:2])
      >>> model_parallel(mesh).batch_dim_name
      'batch'
    """
    import keras

    if not isinstance(mesh, keras.distribution.DeviceMesh):
        raise ValueError(f"mesh must be a keras.distribution.DeviceMesh. Received: {mesh!r}")
    if layout_map is None:
        layout_map = keras.distribution.LayoutMap(mesh)
    if layout_map.device_mesh is not mesh:
        raise ValueError("layout_map was made for another DeviceMesh than mesh.")
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name=batch_dim_name or mesh.axis_names[0])


# --- DataParallel: tfpar's DataParallelStrategy ---------------------------------------
# A `keras.distribution.DataParallel` (replicated variables, the batch split over the
# devices) trains under `tfpar.DataParallelStrategy` on those devices: one device's
# numbers (the conformance table, docs/conformance.md), NCCL on GPUs, everything that strategy supports
# (ZeRO sharding, accumulation, XLA) rather than DTensor's subset of it.

_strategies = {}  # id(DataParallel) -> (the distribution, its DataParallelStrategy)


def _strategy_for(distribution):
    import keras

    if not isinstance(distribution, keras.distribution.DataParallel):
        return None
    key = id(distribution)
    if key not in _strategies:
        strategy = _data_parallel_strategy(_mesh.mesh_devices(distribution.device_mesh))
        _strategies[key] = (distribution, strategy)
    return _strategies[key][1]


def _following_strategy(keras_set_distribution):
    """set_distribution: a DataParallel also sets its strategy (what models made next
    train under); any other value unsets it."""

    def set_distribution(value):
        keras_set_distribution(value)
        strategy = _strategy_for(value)
        if tf.distribute.has_strategy() and tf.distribute.get_strategy() is strategy:
            return
        if strategy is not None or hooks_of(tf.distribute.get_strategy())._tfpar_from_keras:
            if strategy is not None:
                strategy._tfpar_from_keras = True
            tf.distribute.experimental_set_strategy(strategy)

    return set_distribution


# --- The backend functions Keras' frontend calls ---------------------------------------

def _backend_functions():
    import keras

    def num_processes():
        return 1

    def process_id():
        return 0

    def get_device_count(device_type=None):
        return len(keras.distribution.list_devices(device_type))

    def initialize(job_addresses=None, num_processes=None, process_id=None):
        if (num_processes or 1) > 1:
            raise ValueError("keras.distribution on TensorFlow (tfpar) runs in one process: "
                             "one host's devices. Across hosts, use tfpar.DataParallelStrategy "
                             "with TF_CONFIG.")

    def _to_backend_mesh(device_mesh):
        return _mesh.runtime_of(device_mesh).mesh

    def _to_backend_layout(tensor_layout):
        return _mesh.runtime_of(_mesh_of(tensor_layout)).layout(tensor_layout.axes)

    def distribute_tensor(tensor, layout):
        # Inside a step, the value relaid as asked (a "<layer>/output" key of a LayoutMap,
        # as JAX's sharding constraint); outside, placed on the mesh piece by piece. In a
        # user's tf.function likewise relaid: DTensor runs a function on the mesh when an
        # input is on it. (Given only ordinary tensors the function runs off the mesh,
        # where TensorFlow has no Relayout kernel, and a trace cannot tell which: docs/guides/keras-distribution.md.)
        if layout is None:
            return tensor
        if not isinstance(layout, keras.distribution.TensorLayout):
            raise ValueError(f"Not a layout: {layout!r} (expected a "
                             f"keras.distribution.TensorLayout).")
        runtime = _mesh.runtime_of(_mesh_of(layout))
        if tf.executing_eagerly():
            return runtime.place(tensor, layout.axes)
        return runtime.relayout(tensor, layout.axes)

    def distribute_variable(value, layout):
        runtime = _mesh.runtime_of(layout.device_mesh)
        return runtime.variable(value, layout.axes, "distributed")

    return {"num_processes": num_processes, "process_id": process_id,
            "get_device_count": get_device_count, "initialize": initialize,
            "_to_backend_mesh": _to_backend_mesh, "_to_backend_layout": _to_backend_layout,
            "distribute_tensor": distribute_tensor, "distribute_value": distribute_tensor,
            "distribute_variable": distribute_variable}


def _mesh_of(tensor_layout):
    if tensor_layout.device_mesh is None:
        # (Keras' own text, which its distribution_lib tests check, then what to do.)
        raise ValueError("Cannot create sharding when device mesh is not set for "
                         "TensorLayout: make it with TensorLayout(axes, device_mesh).")
    return tensor_layout.device_mesh


# --- Variables ---------------------------------------------------------------------------

def _layout_of(variable, distribution):
    """The `TensorLayout` of a Keras variable being given storage: its own (optimizer state
    takes its variable's), else the distribution's."""
    import keras

    layout = internals.attr(variable, "_layout")
    if isinstance(layout, keras.distribution.TensorLayout) and layout.device_mesh is not None:
        return layout
    if distribution is None or _strategy_for(distribution) is not None:
        return None  # (A DataParallel's variables are its strategy's.)
    layout = distribution.get_variable_layout(variable)
    if layout.device_mesh is None:
        layout.device_mesh = distribution.device_mesh
    return layout


def _laid_out(keras_initialize):
    """Variable._initialize: under a distribution, storage laid out on its mesh."""

    def _initialize(self, value):
        import keras

        distribution = keras.distribution.distribution()
        if isinstance(value, tf.Variable) or (
                distribution is None and internals.attr(self, "_layout") is None):
            return keras_initialize(self, value)
        with tf.init_scope():  # (Optimizer state is made while a step is traced.)
            value = tf.convert_to_tensor(value() if callable(value) else value, self._dtype)
        if internals.attr(self, "_shape") is None:  # Made from a value: Keras sets it next.
            internals.set_attr(self, "_shape", tuple(value.shape))
        layout = _layout_of(self, distribution)
        if layout is None:
            return keras_initialize(self, value)
        internals.set_attr(self, "_layout", layout)
        internals.set_attr(self, "_value", _mesh.runtime_of(layout.device_mesh).variable(
            value, layout.axes, self.name, trainable=self.trainable), set_by=keras_initialize)
        self._value._tfpar_distribution = keras.distribution.distribution()
        return None

    return _initialize


def _mesh_variable(model):
    """A variable of `model` laid out on a mesh, or None."""
    for variable in model.weights:
        if isinstance(internals.attr(variable, "_value"), _mesh.MeshVariable):
            return internals.attr(variable, "_value")
    return None


def _refuse_partly_on_mesh(model):
    """A model whose weights are off the mesh cannot run with state on it (DTensor fails
    inside the step: "Could not find `tf._element_layouts`"): a layer made while a
    distribution was set (a Dropout's seed state) in a model made after it was unset."""
    owners = {}  # (Parents come first: the innermost layer holding a variable wins.)
    for layer in internals.attr(model, "_flatten_layers")(include_self=True):
        for variable in layer.variables:
            owners[id(variable)] = layer
    for variable in model.variables:
        if isinstance(internals.attr(variable, "_value"), _mesh.MeshVariable):
            layer = owners.get(id(variable), model)
            raise ValueError(
                f"Layer {layer.name!r} holds {variable.path!r} on a device mesh (it was "
                f"made while a keras.distribution was set), but the weights of model "
                f"{model.name!r} are not on a mesh: a model runs wholly on a mesh or wholly "
                f"off it. Make the layer after set_distribution(None) too, or build the "
                f"whole model under the distribution.")


def _split_axes(value):
    """The mesh axes a `MeshVariable` is split over (an axis of one device splits nothing)."""
    plan = value._tfpar_runtime.plan
    return tuple(a if a is not None and plan.axis_size(a) > 1 else None
                 for a in value._tfpar_axes)


def _ops_dtensor_cannot_lay_out():
    """(layer classes, whether a replicated layout works, DTensor's op and error)."""
    import keras

    layers = keras.layers
    return (
        ((layers.DepthwiseConv1D, layers.DepthwiseConv2D, layers.SeparableConv1D,
          layers.SeparableConv2D), False,
         "the depthwise convolution's gradient ('tf.DepthwiseConv2dNativeBackpropFilter' "
         "does not implement layout propagation)"),
        ((layers.RNN,), False,
         "the loop over time steps ('tf.EmptyTensorList' / 'tf.TensorListFromTensor' do "
         "not implement layout propagation)"),
        ((layers.Conv1D, layers.Conv2D, layers.Conv3D, layers.Conv1DTranspose,
          layers.Conv2DTranspose, layers.Conv3DTranspose), True,
         "the convolution ('Filter for convolution must have fully replicated layout')"),
    )


def _refuse_what_dtensor_cannot_run(model):
    """Before the first step, a clear error for a layer DTensor fails on inside the step
    (its MLIR error points into the user's file): convolutions with a split kernel, and
    depthwise convolutions and RNNs with any layout (measured on TF 2.21)."""
    rules = _ops_dtensor_cannot_lay_out()
    for layer in internals.attr(model, "_flatten_layers")(include_self=False):
        rule = next((r for r in rules if isinstance(layer, r[0])), None)
        if rule is None:
            continue
        _, replicated_works, op = rule
        laid = [(v.path, _split_axes(v.value)) for v in layer.weights
                if isinstance(internals.attr(v, "_value"), _mesh.MeshVariable)]
        split = [(path, axes) for path, axes in laid if any(axes)]
        if replicated_works and not split:
            continue
        if replicated_works:
            path, axes = split[0]
            raise ValueError(
                f"Layer {layer.name!r} ({type(layer).__name__}) cannot train with "
                f"{path!r} laid out {axes} on the mesh: DTensor cannot split {op}. Keep "
                f"this layer's weights replicated (no LayoutMap key matching them).")
        raise ValueError(
            f"Layer {layer.name!r} ({type(layer).__name__}) cannot run on a device mesh "
            f"with any layout of its weights: DTensor cannot compute {op}. Train this model "
            f"with keras.distribution.DataParallel (tfpar.DataParallelStrategy) or another "
            f"tfpar strategy.")


def _refuse_layouts_dtensor_cannot_run(model, distribution, error):
    """A clear error for DTensor's refusal, at the first step (which it stops before any
    update), of a layout map that splits weights over the data axis as well as the model
    axis (FSDP-style, as keras-hub's `LlamaBackbone.get_layout_map` does): DTensor cannot
    multiply an activation split over one axis by a kernel split over another along the
    axis they share (TF 2.21). Other errors pass as they are."""
    message = str(error)
    if "sharding dimension" not in message or "not supported" not in message:
        return
    data_axis = getattr(distribution, "batch_dim_name", None)
    over_data = [v.path for v in model.weights
                 if isinstance(internals.attr(v, "_value"), _mesh.MeshVariable)
                 and data_axis in _split_axes(v.value)]
    said = next((line.split("error: ", 1)[-1] for line in message.splitlines()
                 if "sharding dimension" in line), message.splitlines()[0])
    raise ValueError(
        f"DTensor cannot run {model.name!r}'s step with its layout map (nothing was "
        f"trained): {said.strip()} The map lays {len(over_data)} weight(s) over the data "
        f"axis {data_axis!r} too (e.g. {', '.join(over_data[:3])}), which DTensor does not "
        f"gather for a product whose other side is split over another axis. Lay weights over "
        f"the model axis only (Megatron's split: query/key/value kernels (None, 'model', None), "
        f"the attention output ('model', None, None), the MLP's (None, 'model') then "
        f"('model', None)); to divide weights over the data axis too, use "
        f"tfpar.PipelineStrategy(num_replicas=..., tensor_parallel=..., shard='parameters', "
        f"layout_map=...) (ZeRO-3 over the replicas).") from error


def _distribution_of(model):
    variable = _mesh_variable(model)
    return None if variable is None else variable._tfpar_distribution


@contextlib.contextmanager
def _scope(distribution):
    import keras

    if distribution is None or keras.distribution.distribution() is distribution:
        yield
    else:
        with distribution.scope():
            yield


def _in_the_models_distribution(method):
    """fit / evaluate / predict of a model made under a distribution run under it (its
    metrics and optimizer state are made there), even if called outside its scope."""

    def wrapper(self, *args, **kwargs):
        with _scope(_distribution_of(self)):
            return method(self, *args, **kwargs)
    return wrapper


# --- Ops whose DTensor form is not one device's -------------------------------------------
# While a mesh step is traced (or a model on a mesh is called eagerly), two backend ops are
# computed another way, with one device's numbers.

_tracing = threading.local()


def _on_the_mesh(runtime):
    return replicas.thread_setting(_tracing, "runtime", runtime)


def _flip_by_gather(keras_flip):
    """flip: DTensor cannot lay out tf.reverse ("'tf.ReverseV2' op does not implement
    layout propagation"; AUC's update uses it). A gather of the reversed indices is the
    same permutation, and DTensor lays it out."""

    def flip(x, axis=None):
        if getattr(_tracing, "runtime", None) is None:
            return keras_flip(x, axis)
        x = tf.convert_to_tensor(x)
        axes = (range(x.shape.rank) if axis is None
                else [axis] if isinstance(axis, int) else list(axis))
        for a in axes:
            x = tf.gather(x, tf.range(tf.shape(x)[a] - 1, -1, -1), axis=a)
        return x

    return flip


def _dropout_drawn_whole(keras_dropout):
    """dropout: DTensor draws a split tensor's random numbers device by device (its own
    seeds per piece), so a batch split over devices would get other masks than on one
    device. The mask is drawn whole, replicated, with one device's op and seed; each
    device multiplies its rows by its rows of it."""

    def dropout(inputs, rate, noise_shape=None, seed=None):
        runtime = getattr(_tracing, "runtime", None)
        if runtime is None or rate in (0.0, 1.0):
            return keras_dropout(inputs, rate, noise_shape=noise_shape, seed=seed)
        inputs = tf.convert_to_tensor(inputs)
        shape = tf.shape(inputs)
        if noise_shape is not None:
            shape = tf.stack([shape[i] if d is None else d for i, d in enumerate(noise_shape)])
        whole = runtime.relayout(tf.ones(shape, inputs.dtype), (None,) * inputs.shape.rank)
        mask = runtime.relayout(keras_dropout(whole, rate, seed=seed),
                                (None,) * inputs.shape.rank)
        return inputs * mask

    return dropout


# --- Steps -------------------------------------------------------------------------------


def _mesh_function(keras_make, kind):
    """make_{train,test,predict}_function: on a mesh, Keras' own step compiled over
    DTensors (each batch split along the data axis), whole values handed back."""

    def make(self, force=False):
        variable = _mesh_variable(self)
        if variable is None:
            if _mesh.any_mesh():
                _refuse_partly_on_mesh(self)
            return keras_make(self, force)
        attribute = f"{kind}_function"
        if getattr(self, attribute) is not None and not force:
            return getattr(self, attribute)
        if self.jit_compile is True:
            raise ValueError("jit_compile=True is not supported for a model on a device mesh "
                             "(tfpar.use_keras_distribution): compile with jit_compile=False.")
        _refuse_what_dtensor_cannot_run(self)
        runtime, distribution = variable._tfpar_runtime, variable._tfpar_distribution
        batch_axis = getattr(distribution, "batch_dim_name", None)
        if kind == "train" and self.optimizer is not None and not self.optimizer.built:
            # Built before its step is traced, as tf.distribute strategies build it: what
            # an optimizer's `build` sets (ScheduleFreeAdamW's momentum, a copy of the
            # weights) is set once, not recorded into the step and repeated every step; and
            # state it makes there (Nadam's `_u_product`) is made outside the step.
            with _scope(distribution), _on_the_mesh(runtime):
                self.optimizer.build(self.trainable_variables)
        step = tf.function(getattr(self, f"{kind}_step"), reduce_retracing=True)

        def run(data):
            # Rows split along the data axis; a partial batch that does not split
            # evenly runs whole on every device (`MeshRuntime.batch`).
            data = tf.nest.map_structure(
                lambda t: None if t is None else runtime.batch(t, batch_axis), data)
            with _scope(distribution), _on_the_mesh(runtime):
                try:
                    outputs = step(data)
                except tf.errors.UnknownError as error:
                    _refuse_layouts_dtensor_cannot_run(self, distribution, error)
                    raise
                return tf.nest.map_structure(runtime.whole, outputs)

        if kind == "predict":
            def function(batches):
                outputs = [run(data) for data in batches]
                return tf.nest.map_structure(lambda *o: tf.concat(o, axis=0), *outputs)
        else:
            def function(iterator):
                outputs = None
                for _, data in zip(range(self.steps_per_execution), iterator):
                    outputs = run(data)
                if outputs is None:
                    raise StopIteration
                return outputs

        setattr(self, attribute, function)
        return function

    return make


def _plain_batch(value):
    return (isinstance(value, (np.ndarray, tf.Tensor)) and len(value.shape) > 0
            and not dtensor.is_dtensor(value))


def _eager_on_the_mesh(keras_call):
    """Layer.__call__: a model (or layer) on a mesh called eagerly with ordinary arrays
    computes on the mesh, its inputs split as batches are, and hands back whole values
    (as `predict` does)."""

    def __call__(self, *args, **kwargs):
        if not tf.executing_eagerly() or not _mesh.any_mesh() or not any(
                _plain_batch(v) for v in tf.nest.flatten((args, kwargs))):
            return keras_call(self, *args, **kwargs)
        variable = _mesh_variable(self)
        if variable is None:
            return keras_call(self, *args, **kwargs)
        runtime, distribution = variable._tfpar_runtime, variable._tfpar_distribution
        batch_axis = getattr(distribution, "batch_dim_name", None)
        args, kwargs = tf.nest.map_structure(
            lambda v: runtime.batch(v, batch_axis) if _plain_batch(v) else v, (args, kwargs))
        with _scope(distribution), _on_the_mesh(runtime):
            outputs = keras_call(self, *args, **kwargs)
        return tf.nest.map_structure(
            lambda t: runtime.whole(t) if dtensor.is_dtensor(t) else t, outputs)

    return __call__


def layer_modes(model):
    """Per layer whose kernel (or embedding table) lies on a mesh: how it computes
    ("column", "row", "replicated", or "gathered": the weight is gathered before use)."""
    import keras

    modes = {}
    for layer in internals.attr(model, "_flatten_layers")(include_self=False):
        if isinstance(layer, keras.layers.Embedding):
            value = getattr(getattr(layer, "embeddings", None), "value", None)
            if isinstance(value, _mesh.MeshVariable):
                modes[layer.path] = _mesh.embedding_mode(_split_axes(value))
            continue
        kernel = getattr(layer, "kernel", None) if hasattr(type(layer), "kernel") else None
        value = getattr(kernel, "value", None)
        if not isinstance(value, _mesh.MeshVariable):
            continue
        equation = getattr(layer, "equation", None) or "...i,io->...o"
        modes[layer.path] = _mesh.kernel_mode(equation, _split_axes(value))
    return modes
