"""`jit_compile=True` under a strategy: each replica's model call (its forward pass, and with
it the backward pass) compiled by XLA on the replica's device, as a pure function of the
variables' values (data parallelism), or each placed layer's call on its device (model
parallelism, `layer_call`); the reductions across replicas, the transfers between devices,
the optimizer's update, the loss and the metrics stay outside the compiled programs, where
TensorFlow's collectives run.

Keras compiles its whole distributed step as one XLA program when `jit_compile=True`
(`TensorFlowTrainer._make_function`), which XLA cannot place on several devices ("Trying to
access resource ... located in device CPU:1"; keras#20763 for MirroredStrategy). Keras itself
compiles `predict` per replica; this does the same for `fit` and `evaluate`:

- the strategy's step function is built by Keras without XLA (`building_plain_step`);
- the model's outermost call in a replica (`call`) reads every variable outside XLA (a
  replica's own copy, or ZeRO-3's read from the owner) and passes the values into a
  `tf.function(jit_compile=True)` that runs the model inside a `keras.StatelessScope`;
  state the call writes (BatchNorm's moving statistics, dropout's seed) comes back as
  outputs and is assigned outside, as the layer would have, in replica context;
- the gradient of the compiled call is XLA's too (TensorFlow compiles the backward function
  of a must-compile function).

The call's losses (`add_loss`) leave XLA as outputs and are added to the model outside it.
Refused at the first trace with a clear error: layers whose call communicates across
replicas (synchronized BatchNorm: a collective inside XLA, which TensorFlow's distribution
cannot enter).
"""

import contextlib
import threading

import tensorflow as tf

from tfpar.contract import hooks_of
from tfpar.keras import internals
from tfpar.keras import models

# A model's (or placed layer's) attribute: {key: (tf.function, written indices, variables)}.
_COMPILED = "_tfpar_compiled_per_replica"
_state = threading.local()  # .inside: a compiled call is being traced (inner models run plain).


def building_plain_step(model):
    """A context in which Keras builds `model`'s step function without XLA, the model's own
    calls then compiled per replica (`call`)."""
    return _PlainStep(model)


class _PlainStep:
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        if not isinstance(getattr(self.model, _COMPILED, None), dict):
            object.__setattr__(self.model, _COMPILED, {})  # (Not tracked by Keras.)
        # Keras' own setter (public): read when Keras makes its tf.function.
        self.model.jit_compile = False

    def __exit__(self, *exc):
        self.model.jit_compile = True
        return False


def applies(model):
    """Whether this call of `model` is a replica's outermost call in a compiled step."""
    return (isinstance(getattr(model, _COMPILED, None), dict) and model.jit_compile
            and not getattr(_state, "inside", False) and tf.inside_function()
            and not tf.distribute.in_cross_replica_context())


def call(model, model_call, args, kwargs):
    """`model_call(model, *args, **kwargs)` compiled by XLA on this replica's device, as a
    function of the variables' values (read here, outside XLA). Under a strategy whose
    replica spans devices (`_tfpar_xla_unit == "layer"`: model parallelism), the model runs
    as it is and each placed layer's call is compiled on its device (`layer_call`)."""
    _refuse_communicating_layers(model)
    strategy = internals.attr(model, "_distribute_strategy")
    if hooks_of(strategy)._tfpar_xla_unit == "layer":
        previous = getattr(_state, "layers", False)
        _state.layers = True
        try:
            return model_call(model, *args, **kwargs)
        finally:
            _state.layers = previous
    return _run_compiled(model, lambda *a, **k: model_call(model, *a, **k), args, kwargs,
                         _replica())


def _replica():
    """This replica's index among all replicas in sync (a Python int)."""
    value = tf.distribute.get_replica_context().replica_id_in_sync_group
    return value if isinstance(value, int) else int(tf.get_static_value(value))


def compiling_layers():
    """Whether placed layers' calls are compiled one by one (`layer_call`) here."""
    return getattr(_state, "layers", False) and not getattr(_state, "inside", False)


def layer_call(layer, call, args, kwargs):
    """`call(*args, **kwargs)`, a placed layer's own call, compiled by XLA where it runs, as
    a function of the layer's variables' values (read outside XLA)."""
    return _run_compiled(layer, call, args, kwargs, "layer")


def _run_compiled(owner, fn, args, kwargs, key):
    """`fn(*args, **kwargs)` (the call of Keras layer or model `owner`) through its compiled
    function for `key` (a replica's index, or "layer"): the variables' values read here,
    the state it writes assigned back, its masks and call losses carried out."""
    trainable = list(owner.trainable_variables)
    state = list(owner.non_trainable_variables)
    # Reads through the variables themselves: a replica's copy, ZeRO-3's owner read; the
    # gradient tape sees them as reads of the watched variables.
    values = [tf.convert_to_tensor(v.value) for v in trainable]
    state_values = [tf.convert_to_tensor(v.value) for v in state]
    compiled, changed = _compiled(owner, fn, trainable, state, key)
    outputs, masks, written, losses = compiled(values, state_values, args, kwargs)
    # A tensor leaving a tf.function loses the Keras mask riding on it (padding masks, which
    # the loss and metrics read): put back.
    for output, mask in zip(tf.nest.flatten(outputs), masks):
        if mask is not None:
            models.set_mask(output, mask)
    # The call's losses (add_loss) leave XLA as outputs and become the owner's, as an
    # outermost call leaves them (its earlier ones cleared first).
    internals.attr(owner, "_clear_losses")()
    for loss in losses:
        owner.add_loss(loss)
    for index, value in zip(changed(), written):
        state[index].assign(value)
    return outputs


def _compiled(owner, fn, trainable, state, key):
    """The compiled call of `owner` for `key` (a replica's own tf.function: each replica's
    trace reads its own device's values), and a function giving the indices of the
    state variables it writes (known once traced)."""
    import keras

    functions = getattr(owner, _COMPILED, None)
    if not isinstance(functions, dict):
        functions = {}
        object.__setattr__(owner, _COMPILED, functions)  # (Not tracked by Keras.)
    # Made again when other variables are trainable: a layer frozen and the model compiled
    # again (a stale function mapped a kernel to another variable's value).
    variables = (tuple(id(v) for v in trainable), tuple(id(v) for v in state))
    if key in functions and functions[key][2] == variables:
        return functions[key][:2]
    written_indices = []

    def pure(values, state_values, args, kwargs):
        mapping = list(zip(trainable, values)) + list(zip(state, state_values))
        _state.inside = True
        try:
            with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope, \
                    _without_remat(owner):
                outputs = fn(*args, **kwargs)
                losses = list(scope.losses)
            current = [scope.get_current_value(v) for v in state]
        finally:
            _state.inside = False
        written_indices[:] = [i for i, (new, old) in enumerate(zip(current, state_values))
                              if new is not None and new is not old]
        masks = [models.mask_of(x) for x in tf.nest.flatten(outputs)]
        return outputs, masks, [current[i] for i in written_indices], losses

    compiled = tf.function(pure, jit_compile=True, reduce_retracing=True)
    functions[key] = (compiled, lambda: list(written_indices), variables)
    return functions[key][:2]


@contextlib.contextmanager
def _without_remat(model):
    """Layers under a RematScope (ZeRO-3's regathering, or the user's) run plain inside the
    compiled call: their recomputation (`tf.recompute_grad`) differentiates the variables
    it watches, and a stateless call reads none (its gradients would be None). XLA keeps
    what its own schedule needs; the values are the same."""
    saved = [(layer, internals.attr(layer, "_remat_mode"))
             for layer in internals.attr(model, "_flatten_layers")(include_self=True)]
    saved = [(layer, mode) for layer, mode in saved if mode is not None]
    for layer, _ in saved:
        internals.set_attr(layer, "_remat_mode", None)
    try:
        yield
    finally:
        for layer, mode in saved:
            internals.set_attr(layer, "_remat_mode", mode)


def _refuse_communicating_layers(model):
    import keras

    synchronized = [layer.name for layer in internals.attr(model, "_flatten_layers")()
                    if isinstance(layer, keras.layers.BatchNormalization)
                    and getattr(layer, "synchronized", False)]
    if synchronized:
        raise ValueError(
            f"{model.name!r} cannot be trained with jit_compile=True under a strategy: its "
            f"layers {synchronized} are BatchNormalization(synchronized=True), whose call sums "
            f"statistics across replicas, a collective that cannot run inside the replica's "
            f"compiled call. Compile with jit_compile=False, or use synchronized=False (each "
            f"replica's own statistics).")
