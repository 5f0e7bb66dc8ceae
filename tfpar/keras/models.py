"""Keras models, layers and variables as the runtime (`tfpar.distribute`) sees them.

What is a model, a layer, a Keras variable; which layers a model is placed by; the
shapes of a layer's inputs and outputs; a model built from shapes; Keras' stateless
scope and nests. The strategies ask here instead of importing Keras (a test checks
that only the seam, `tfpar.layers` and the programs import it).

Keras is imported inside the functions: importing this module imports no Keras.
"""

import contextlib
import math

import tensorflow as tf

from tfpar.keras import internals


def is_model(obj):
    """Whether `obj` is a Keras model (functional, Sequential or subclassed)."""
    import keras

    return isinstance(obj, keras.Model)


def is_variable(obj):
    """Whether `obj` is a Keras variable."""
    import keras

    return isinstance(obj, keras.Variable)


def stateless_scope(state_mapping=None, collect_losses=False):
    """Keras' `StatelessScope`: variables read their values from `state_mapping`, new
    ones get no storage until it ends, and (with `collect_losses`) losses are kept."""
    import keras

    return keras.StatelessScope(state_mapping=state_mapping, collect_losses=collect_losses)


@contextlib.contextmanager
def outside_stateless_scope():
    """Keras' `StatelessScope` suspended: a variable made here gets its storage at once (a
    shard of a weight split while Keras builds the model from shapes, before the model's
    first call)."""
    current = internals.symbol("keras.src.backend.common.stateless_scope.get_stateless_scope")
    set_attribute = internals.symbol(
        "keras.src.backend.common.global_state.set_global_attribute")
    scope = current()
    if scope is None:
        yield
        return
    set_attribute("stateless_scope", None)
    try:
        internals.check(current() is None,
                        "the StatelessScope kept as global attribute 'stateless_scope'")
        yield
    finally:
        set_attribute("stateless_scope", scope)


def map_structure(fn, *structures):
    """`fn` over the leaves of Keras nests (Keras' own nest rules: `keras.tree`)."""
    import keras

    return keras.tree.map_structure(fn, *structures)


def placement_units(model):
    """The layers a model is placed by, in model order: its layers, with the layers of
    the models inside it in their place (input layers left out, each layer once)."""
    import keras

    units, seen = [], set()

    def visit(container):
        for layer in container.layers:
            if id(layer) in seen or isinstance(layer, keras.layers.InputLayer):
                continue
            seen.add(id(layer))
            if is_model(layer):
                visit(layer)
            else:
                units.append(layer)

    visit(model)
    return units


def creating_layer(callers):
    """The layer (not a model) creating a variable, from the objects whose code is creating
    it (`callers`, innermost last), or None."""
    import keras

    layers = [c for c in callers if isinstance(c, keras.layers.Layer)]
    return next((layer for layer in layers if not isinstance(layer, keras.Model)), None)


def made_by_seed_generator(callers):
    """Whether the variable being created is a `keras.random.SeedGenerator`'s state (a
    layer's random state, made in its constructor)."""
    import keras

    return bool(callers) and isinstance(callers[-1], keras.random.SeedGenerator)


def held_inside(model):
    """The Keras objects inside `model`, not itself: every layer and model in it, and
    the functional model a Sequential runs through."""
    import keras

    inside = [internals.attr(model, "_functional")] if isinstance(model, keras.Sequential) else []
    return inside + [layer for layer in internals.attr(model, "_flatten_layers")()
                     if layer is not model]


def all_layers(layer):
    """`layer` and every layer inside it, outermost first (Keras' `_flatten_layers`)."""
    return list(internals.attr(layer, "_flatten_layers")())


def storage(variable):
    """The `tf.Variable` holding a Keras variable's value (None while it has none)."""
    return internals.attr(variable, "_value")


def tf_variable(variable):
    """The `tf.Variable` of a Keras variable; a TensorFlow variable itself."""
    return storage(variable) if hasattr(variable, "_value") else variable


def set_storage(variable, value):
    """Makes `value` (a `tf.Variable`) the storage of a Keras variable."""
    internals.set_attr(variable, "_value", value)


def call_takes_training(layer):
    """Whether a layer's `call` takes a `training` argument."""
    return internals.attr(layer, "_call_has_training_arg")


def call_takes_mask(layer):
    """Whether a layer's `call` takes a `mask` argument."""
    return internals.attr(layer, "_call_has_mask_arg")


def mask_of(x):
    """The Keras mask riding on tensor `x` (a layer's output mask), or None."""
    if not tf.is_tensor(x):
        return None
    return internals.symbol("keras.src.backend.common.masking.get_keras_mask")(x)


def set_mask(x, mask):
    """Makes `mask` the Keras mask riding on tensor `x`."""
    internals.symbol("keras.src.backend.common.masking.set_keras_mask")(x, mask)


def keep_mask(source, target):
    """Gives tensor `target` the Keras mask riding on tensor `source`, if it has one."""
    mask = mask_of(source)
    if mask is not None:
        set_mask(target, mask)


def in_symbolic_scope():
    """Whether Keras is inferring shapes (its symbolic scope: nothing runs)."""
    return internals.symbol("keras.src.backend.common.symbolic_scope.in_symbolic_scope")()


def in_stateless_scope():
    """Whether a Keras `StatelessScope` is active (a symbolic build: nothing runs)."""
    return internals.symbol("keras.src.backend.common.stateless_scope.in_stateless_scope")()


def any_symbolic_tensors(args=None, kwargs=None):
    """Whether a call's arguments hold Keras symbolic tensors (`KerasTensor`s)."""
    return internals.symbol("keras.src.backend.common.keras_tensor.any_symbolic_tensors")(
        args, kwargs)


def build_symbolically(model, args, kwargs):
    """Creates a model's variables from the shapes of a call's inputs, running nothing."""
    import keras

    def spec(x):
        if tf.is_tensor(x) or hasattr(x, "__array__"):
            return keras.KerasTensor(tuple(x.shape), keras.backend.standardize_dtype(x.dtype))
        return x

    compute_output_spec = internals.symbol("keras.src.backend.compute_output_spec")
    with tf.init_scope():
        compute_output_spec(model, *keras.tree.map_structure(spec, args),
                            **keras.tree.map_structure(spec, kwargs))


def call_arguments(layer):
    """The (args, kwargs) a layer was last called with in its model's graph (symbolic
    tensors), or a `tf.TensorSpec` of its one built input shape, or None when unknown."""
    nodes = internals.attr(layer, "_inbound_nodes")
    build_shapes = internals.attr(layer, "_build_shapes_dict")
    if nodes:
        return nodes[-1].arguments.args, nodes[-1].arguments.kwargs
    if build_shapes and len(build_shapes) == 1:
        shape = next(iter(build_shapes.values()))
        return (tf.TensorSpec((None,) + tuple(shape[1:]), layer.input_dtype),), {}
    return None


def output_elements(layer):
    """Elements per example of a layer's output(s): from its graph node, else its shape
    (0 when the layer cannot say)."""
    nodes = internals.attr(layer, "_inbound_nodes")
    if nodes:
        shapes = _shapes(nodes[-1].outputs)
    else:
        build_shapes = internals.attr(layer, "_build_shapes_dict")
        if not build_shapes or len(build_shapes) != 1:
            return 0
        try:
            shapes = _shapes(layer.compute_output_shape(next(iter(build_shapes.values()))))
        except Exception:  # Not every layer can say; its activations then count as 0.
            return 0
    return sum(math.prod(d or 1 for d in shape[1:]) for shape in shapes)


def _shapes(structure):
    """Flat list of shapes in a nest of shapes/tensors."""
    import keras

    if isinstance(structure, (tuple, list)) and all(
            d is None or isinstance(d, int) for d in structure):
        return [tuple(structure)]
    if hasattr(structure, "shape"):
        return [tuple(structure.shape)]
    if isinstance(structure, (tuple, list, dict)):
        values = structure.values() if isinstance(structure, dict) else structure
        return [s for v in values for s in _shapes(v)]
    return [tuple(t.shape) for t in keras.tree.flatten(structure) if hasattr(t, "shape")]
