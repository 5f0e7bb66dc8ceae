"""Keras under tfpar.ParameterServerStrategy: what the strategy's loops need of Keras.

Keras 3 has no parameter-server path; the strategy runs `fit`, `evaluate` and `predict`
loops of its own (`tfpar.distribute.parameter_server.ps_loops`, its `_tfpar_run_loop`
hook), which reach Keras' callbacks, data adapters, steps and metrics through the functions
here. `patches()` routes the model's methods to those loops and adapts Keras' variables:

Exact state. Keras' `Variable.assign_add` is `assign(value + delta)`, a read-modify-write
that loses increments when workers update at once (100 steps left `optimizer.iterations`
at 73 here); under these strategies it becomes the variable's own atomic `assign_add`.
Other read-modify-writes (metrics, BatchNorm, the loss scale) run under a lock on the ps
(`tfpar.keras.ps_state`).

Variables split over ps tasks (`variable_partitioner`) are `ShardedVariable`s,
which Keras' `train_step` cannot differentiate (it asks for one handle): the
default step here takes gradients of each shard and joins them. A model that
overrides `train_step` keeps its own step (in async mode).
"""

import functools

import numpy as np
import keras
import tensorflow as tf

from tfpar.contract import hooks_of
from tfpar.data import dataset_from_function
from tfpar.keras import internals
from tfpar.keras import losses
from tfpar.keras import ps_state
from tfpar.keras import replicas
from tfpar.keras import steps
from tfpar.keras import zero_optimizers


def patches():
    """What tfpar replaces in Keras for parameter servers: (owner, attribute, wrap).

    `wrap(original)` returns the replacement; `tfpar.keras.hooks` applies each one once.
    """
    trainer = internals.symbol("keras.src.backend.tensorflow.trainer.TensorFlowTrainer")
    variable = internals.symbol("keras.src.backend.tensorflow.core.Variable")
    optimizer = internals.symbol("keras.src.backend.tensorflow.optimizer.TFOptimizer")
    return [
        *[(trainer, name, functools.partial(_dispatch, loop=functools.partial(_run_loop, name)))
          for name in ("fit", "evaluate", "predict")],
        *[(trainer, name, functools.partial(_dispatch, loop=functools.partial(
            _refuse_on_batch, name=name, instead=instead)))
          for name, instead in (("train_on_batch", "fit(x, y, batch_size=len(x), epochs=1)"),
                                ("test_on_batch", "evaluate(x, y, batch_size=len(x))"),
                                ("predict_on_batch", "predict(x, batch_size=len(x))"))],
        (variable, "assign_add", functools.partial(_atomic, name="assign_add")),
        (variable, "assign_sub", functools.partial(_atomic, name="assign_sub")),
        (optimizer, "add_variable_from_reference", _uncolocated_for_shards),
        (variable, "__array__", _sharded_as_array),
        (optimizer, "_distributed_tf_update_step", _sharded_updates_direct),
        (optimizer, "_apply_weight_decay", _sharded_weight_decay_direct),
        *ps_state.patches(),
    ]


def _run_loop(name, model, *args, **kwargs):
    if getattr(model, "jit_compile", False) is True:
        # (The workers' steps are tfpar's own functions: it would be silently dropped.)
        raise ValueError(
            f"tfpar.ParameterServerStrategy cannot run {name} of {model.name!r} with "
            f"jit_compile=True yet: each worker's step reads its variables from the ps "
            f"tasks, and tfpar does not compile the model's call apart from those reads "
            f"here (as DataParallelStrategy does). Compile with jit_compile=False.")
    return hooks_of(model.distribute_strategy)._tfpar_run_loop(name, model, *args, **kwargs)


def _refuse_on_batch(model, *args, name, instead, **kwargs):
    # Keras would run these on the chief, reading and writing every ps variable from
    # there (TensorFlow only warns): not parameter-server training.
    raise ValueError(
        f"{name} runs one step on the chief, which does not train under "
        f"tfpar.ParameterServerStrategy (workers run the steps). Use model.{instead}: one "
        f"batch, run on a worker.")


def _dispatch(keras_method, loop):
    @functools.wraps(keras_method)
    def method(self, *args, **kwargs):
        if ps_state.uses_parameter_servers(self.distribute_strategy):
            # The chief also reads and resets ps variables itself (metrics, steps).
            with self.distribute_strategy.ps_failures_explained():
                return loop(self, *args, **kwargs)
        return keras_method(self, *args, **kwargs)
    return method


def _atomic(keras_method, name):
    in_stateless_scope = internals.symbol(
        "keras.src.backend.common.stateless_scope.in_stateless_scope")

    @functools.wraps(keras_method)
    def method(self, value):
        if (not in_stateless_scope() and tf.distribute.has_strategy()
                and ps_state.uses_parameter_servers(tf.distribute.get_strategy())):
            return getattr(self._value, name)(tf.cast(value, self._value.dtype))
        return keras_method(self, value)
    return method


def _uncolocated_for_shards(keras_method):
    # Slots of a sharded variable cannot be colocated with it (it has no single
    # device); made without colocation they are sharded the same way instead.
    base_optimizer = internals.symbol("keras.src.optimizers.base_optimizer.BaseOptimizer")

    @functools.wraps(keras_method)
    def method(self, reference_variable, name=None, initializer="zeros"):
        if _is_sharded(getattr(reference_variable, "value", None)):
            return base_optimizer.add_variable_from_reference(
                self, reference_variable, name=name, initializer=initializer)
        return keras_method(self, reference_variable, name=name, initializer=initializer)
    return method


def _sharded_updates_direct(keras_method):
    # `extended.update` colocates the update with its variable, which a sharded
    # variable cannot be; its assign/assign_add/assign_sub place each shard's part.
    @functools.wraps(keras_method)
    def method(self, distribution, grads_and_vars, learning_rate):
        sharded = [(g, v) for g, v in grads_and_vars if _is_sharded(v)]
        keras_method(self, distribution, [(g, v) for g, v in grads_and_vars
                                          if not _is_sharded(v)], learning_rate)
        for gradient, variable in sharded:
            self.update_step(gradient, variable, learning_rate)
    return method


def _sharded_weight_decay_direct(keras_method):
    # Keras decays each variable inside an `extended.update`, which colocates the decay with
    # its variable: a sharded one cannot be ("ShardedVariable doesn't support being used as
    # a reference": AdamW with a partitioned embedding failed in sync mode). Its assign_sub
    # places each shard's part.
    @functools.wraps(keras_method)
    def method(self, variables):
        sharded = [v for v in variables if _is_sharded(getattr(v, "value", v))]
        keras_method(self, [v for v in variables if not _is_sharded(getattr(v, "value", v))])
        for variable in sharded:
            zero_optimizers.decay(self, variable)
    return method


def _sharded_as_array(keras_method):
    # Saving weights reads variables through __array__, which ShardedVariable lacks.
    @functools.wraps(keras_method)
    def method(self, dtype=None, **kwargs):
        if _is_sharded(internals.attr(self, "_value")):
            return np.asarray(self._value.numpy(), dtype=dtype)
        return keras_method(self, dtype, **kwargs)
    return method


def _is_sharded(variable):
    return isinstance(variable, internals.symbol(
        "tensorflow.python.distribute.sharded_variable.ShardedVariable"))


# -- steps run on the workers -------------------------------------------------

def _gradients(tape, loss, variables):
    """Gradients of `loss` for Keras variables, sharded ones included."""
    targets, sizes = [], []
    for variable in variables:
        value = variable.value
        shards = value.variables if _is_sharded(value) else [value]
        targets.extend(shards)
        sizes.append(len(shards))
    flat = tape.gradient(loss, targets)
    gradients, i = [], 0
    for size in sizes:
        parts = flat[i:i + size]
        i += size
        if size == 1:
            gradients.append(parts[0])
        else:
            gradients.append(tf.concat([tf.convert_to_tensor(p) for p in parts], axis=0))
    return gradients


def _forward_backward(model, data):
    """Keras' TensorFlow train step up to the gradients; updates the metrics."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    with tf.GradientTape() as tape:
        y_pred = steps.call_model(model, x, training=True)
        loss = internals.attr(model, "_compute_loss")(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
        steps.track_loss(model, loss, x)
        if model.optimizer is not None:
            loss = model.optimizer.scale_loss(loss)
    gradients = _gradients(tape, loss, model.trainable_weights)
    model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    return gradients


def _train_step(model, data):
    gradients = _forward_backward(model, data)
    model.optimizer.apply(gradients, model.trainable_weights)


def overrides_train_step(model):
    """Whether the model's class has its own train_step (not Keras', nor tfpar's hook).

    tfpar's train-step hook (installed by PipelineStrategy) replaces `keras.Model.train_step`
    with a wrapper of Keras' own; that wrapper is not the user's.
    """
    return not steps.is_keras_train_step(type(model).train_step)


def train_step(model):
    """The step a worker runs on a batch: the model's own `train_step` if it overrides
    Keras', else Keras' step with the gradients of sharded variables joined."""
    if overrides_train_step(model):
        return model.train_step
    return cached(model, "train", lambda: functools.partial(_train_step, model))


def loss_counts(model, data, fraction):
    """A part's forward pass that only counts what the batch's loss is divided by (masked
    and sample-weighted examples): (counts, whether they depend on the data). Stateless:
    what the pass would update (BatchNorm, metrics) is dropped."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    current = [(v, tf.convert_to_tensor(v)) for v in model.variables]
    with replicas.batch_part(fraction) as counting, keras.StatelessScope(state_mapping=current):
        y_pred = steps.call_model(model, x, training=True)
        internals.attr(model, "_compute_loss")(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
    return counting.counts, counting.dynamic


def part_gradients(model, data, fraction, global_counts):
    """The gradients of a part (`fraction` of its batch) of one synchronous step: its loss
    is its share of the whole batch's, divided by the batch's `global_counts`. A model's own
    `compute_loss` gives the part's loss, weighed here by the part's examples."""
    if losses.has_custom_compute_loss(model):
        return [g * tf.cast(fraction, g.dtype) for g in _forward_backward(model, data)]
    with replicas.batch_part(fraction, global_counts):
        return _forward_backward(model, data)


def batch_norm_parts(strategy, model, num_parts):
    """BatchNorm statistics of a synchronous step's parts, moved once (`ps_state`)."""
    return ps_state.BatchNormParts(strategy, model, num_parts)


# -- data ---------------------------------------------------------------------

class LoopInput:
    """A dataset for the loops, from anything Keras' fit takes, or a dataset function."""

    def __init__(self, x, y=None, sample_weight=None, batch_size=None, steps=None,
                 shuffle=False, class_weight=None):
        get_data_adapter = internals.symbol("keras.src.trainers.data_adapters.get_data_adapter")
        if callable(x) and not isinstance(x, tf.data.Dataset):
            given = [n for n, v in (("y", y), ("sample_weight", sample_weight)) if v is not None]
            if given:
                raise ValueError(
                    f"{' and '.join(given)} cannot be passed with a dataset function: the "
                    f"function's dataset must yield them, as (x, y) or (x, y, sample_weight) "
                    f"elements. Received a dataset function and {', '.join(given)}.")
            self.dataset_fn = x
            self.dataset = dataset_from_function(x, tf.distribute.InputContext())
            cardinality = int(self.dataset.cardinality())
            self.num_batches = cardinality if cardinality >= 0 else None
        else:
            self.dataset_fn = None
            adapter = get_data_adapter(
                x=x, y=y, sample_weight=sample_weight, batch_size=batch_size,
                steps_per_epoch=steps, shuffle=shuffle and not isinstance(x, tf.data.Dataset),
                class_weight=class_weight)
            self.dataset = adapter.get_tf_dataset()
            self.num_batches = adapter.num_batches

    def steps(self, steps, argument):
        """The number of steps to run: `steps`, else the dataset's size when known."""
        if steps is not None:
            if not isinstance(steps, int) or steps < 1:
                raise ValueError(f"{argument} must be an integer >= 1. Received: {steps!r}")
            return steps
        if self.num_batches is None:
            raise ValueError(
                f"{argument} is required with tfpar.ParameterServerStrategy when the dataset "
                f"is infinite or of unknown size (workers read their own shards, so the "
                f"chief cannot see it end). Pass {argument}=N.")
        return self.num_batches

    def per_worker(self):
        """What the workers read: the dataset function, else the dataset (split by batch)."""
        return self.dataset if self.dataset_fn is None else self.dataset_fn


def build(model, dataset):
    """Builds the model (and its metrics, updated under a lock on the ps) for `dataset`."""
    with model.distribute_strategy.scope():
        internals.attr(model, "_symbolic_build")(data_batch=dataset.element_spec)
    ps_state.exclusive_metric_updates(model)


def metric_logs(model):
    """The model's metric results as numbers (read from the ps)."""
    return {k: float(np.asarray(v)) if np.asarray(v).size == 1 else np.asarray(v)
            for k, v in model.get_metrics_result().items()}


def callback_list(model, callbacks, verbose, **params):
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    return keras.callbacks.CallbackList(callbacks, add_history=True, add_progbar=verbose != 0,
                                         verbose=verbose, model=model, **params)


def _compiled_state(model):
    """What a traced step captures from `compile` and trainability: a new compile (optimizer,
    loss, metrics) or a changed set of trainable weights needs new steps."""
    return (model.optimizer, internals.attr(model, "_compile_loss"),
            internals.attr(model, "_compile_metrics"), *model.trainable_weights)


def cached(model, key, make):
    """Steps traced for `model`, made again after `compile` or a change of trainability."""
    state = _compiled_state(model)
    cache = model.__dict__.get("_tfpar_ps_steps")
    known = cache.get("compiled state") if cache else None
    if known is None or len(known) != len(state) or any(a is not b for a, b in zip(known, state)):
        cache = model.__dict__["_tfpar_ps_steps"] = {"compiled state": state}
    if key not in cache:
        cache[key] = make()
    return cache[key]


def assert_compiled(model, method):
    internals.attr(model, "_assert_compile_called")(method)


def validation_split(arrays, fraction):
    """Keras' split of `fit`'s arrays into training and validation data."""
    split = internals.symbol(
        "keras.src.trainers.data_adapters.array_slicing.train_validation_split")
    return split(arrays, validation_split=fraction)


def initial_epoch(model, given):
    """The epoch `fit` starts from: a restored backup's, else `given`."""
    return internals.attr(model, "_initial_epoch") or given


def evaluates_at(model, epoch, validation_freq):
    return internals.attr(model, "_should_eval")(epoch, validation_freq)


def flatten_metrics(model, logs):
    """`evaluate`'s list of results, in Keras' order."""
    return internals.attr(model, "_flatten_metrics_in_order")(logs)


def unpack(data):
    return keras.utils.unpack_x_y_sample_weight(data)


def examples(batch):
    """The number of examples in `batch` (its first leaf's first dimension)."""
    return int(keras.tree.flatten(batch)[0].shape[0])


def batch_size(data):
    """The examples in `data`, a tensor inside a traced step."""
    return steps.batch_size(data)


def split(batch, sizes):
    """`batch` cut along its first axis into pieces of `sizes` examples."""
    leaves = [tf.split(t, sizes) for t in keras.tree.flatten(batch)]
    return [keras.tree.pack_sequence_as(batch, [leaf[k] for leaf in leaves])
            for k in range(len(sizes))]


def concat(outputs):
    """Per-batch output structures joined along the first axis."""
    leaves = [keras.tree.flatten(o) for o in outputs]
    return keras.tree.pack_sequence_as(
        outputs[0], [np.concatenate([np.asarray(o[i]) for o in leaves])
                     for i in range(len(leaves[0]))])
