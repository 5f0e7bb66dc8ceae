"""Pieces of Keras' TensorFlow train step that tfpar's own steps (the pipeline's, the
parameter servers') share, so that each does what Keras' does."""

import keras
import tensorflow as tf

from tfpar.keras import internals


def batch_size(x):
    """The number of examples in a batch of model inputs."""
    return tf.shape(next(i for i in keras.tree.flatten(x) if i is not None))[0]


def unpack_x_y_sample_weight(data):
    """A batch as Keras' train step takes it apart: (x, y, sample_weight)."""
    return keras.utils.unpack_x_y_sample_weight(data)


def track_loss(model, loss, x):
    """Updates the model's loss metric with a step's (replica-scaled) loss, as Keras does.

    Under tfpar's data-parallel replicas the seam makes the unscaling a sum over
    replicas, which is the global batch's loss (`tfpar.keras.replicas`).
    """
    unscale = internals.symbol("keras.src.losses.loss.unscale_loss_for_distribution")
    internals.attr(model, "_loss_tracker").update_state(unscale(loss), sample_weight=batch_size(x))


def is_keras_train_step(method):
    """Whether `method` is Keras' own train step, or tfpar's hook around it (which
    `tfpar.keras.hooks.install_train_step_hook` puts on `keras.Model`)."""
    trainer = internals.symbol("keras.src.backend.tensorflow.trainer.TensorFlowTrainer")
    while getattr(method, "_tfpar_train_step_hook", False):
        method = method.__wrapped__  # Set by functools.wraps in hooks._wrap_once.
    return method is trainer.train_step


_call_context_checked = []


def inside_a_layer_call():
    """Whether a Keras layer's call is running (Keras' call context, a global it keeps under
    "current_call_ctx"). Checked once against a probe layer: a Keras that renamed it would
    answer "no" for ever, silently."""
    get = internals.symbol("keras.src.backend.common.global_state.get_global_attribute")
    if not _call_context_checked:
        seen = []

        class Probe(keras.layers.Layer):
            def call(self, x):
                seen.append(get("current_call_ctx") is not None)
                return x

        before = get("current_call_ctx")  # (Set already if asked inside a layer's call.)
        Probe(name="tfpar_call_context_probe")(keras.Input((1,)))
        internals.check(seen == [True] and get("current_call_ctx") is before,
                        "Keras' call context of the layer being called (current_call_ctx)")
        _call_context_checked.append(True)
    return get("current_call_ctx") is not None


def compiled_loss(model):
    """The loss `compile` gave the model (Keras' `CompileLoss`), or None."""
    return internals.attr(model, "_compile_loss")


def compute_loss(model, **kwargs):
    """The model's `compute_loss` called as Keras' train step calls it (x, y, y_pred,
    sample_weight, training), whether or not the model overrides it."""
    return internals.attr(model, "_compute_loss")(**kwargs)


def aggregate_additional_loss(model, loss):
    """A loss added in `call` (or a regularizer's) reduced as Keras' train step does."""
    return internals.attr(model, "_aggregate_additional_loss")(loss)


def call_model(model, x, training):
    """`model(x)`, passing `training` when the model's call takes it."""
    if internals.attr(model, "_call_has_training_arg"):
        return model(x, training=training)
    return model(x)


class InTurn:
    """Runs calls one after another: each call's ops wait for what the previous call
    returned (tensors or ops, e.g. a read of the variable it updated). Optimizer updates of
    different variables are independent, so a step runs them all at once, each holding
    temporaries the size of its variable: in turn, it holds one's. Likewise collective
    receives, each of which holds its buffer from when it starts."""

    def __init__(self):
        self._done = []

    def __call__(self, fn, *args):
        if not tf.inside_function():
            return fn(*args)  # Eagerly each call has ended before the next begins.
        with tf.control_dependencies(self._done):
            result = fn(*args)
        self._done = [t.op if tf.is_tensor(t) else t for t in tf.nest.flatten(result)
                      if tf.is_tensor(t) or isinstance(t, tf.Operation)] or self._done
        return result


def at_once(fn, *args):
    """Calls `fn(*args)`, its ops in no imposed order (where `InTurn` is not used)."""
    return fn(*args)


def one_after_another(items, update):
    """Calls `update(item)` for each item in turn (`InTurn`)."""
    in_turn = InTurn()
    for item in items:
        in_turn(update, item)
