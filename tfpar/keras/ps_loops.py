"""Keras 3 `fit`, `evaluate` and `predict` on tfpar.ParameterServerStrategy.

Keras 3 has no parameter-server path: its `fit` iterates a distributed dataset on
the chief, which a ParameterServerStrategy refuses. Under a tfpar
ParameterServerStrategy the model's `fit`/`evaluate`/`predict` run the loops
below instead, with Keras' own callbacks, data adapters, metrics and steps.

- Training (async): each worker reads its own shard of the dataset, repeated (or, with
  a tf.data service, one pass per epoch shared by all); the chief schedules
  `steps_per_execution` steps per closure on whichever worker is free. Batch-level
  callbacks get logs read from the metrics on the ps, with at most `_LOG_WINDOW`
  closures per worker in flight (bounded staleness); epoch logs are exact.
- Training (sync): the chief reads each batch and splits it over the workers; each
  part's loss is its share of the batch's loss (`tfpar.keras.replicas.batch_part`), its
  gradients are stored on the ps and summed there before one update (the strategy's
  `_tfpar_sync_gradients`, `tfpar.distribute.parameter_server.ps_sync.SyncGradients`):
  one device on the combined batch. BatchNorm moves once per step (`ps_state`).
- evaluate / predict: the chief reads the batches and sends each to a free worker,
  so every example is seen exactly once and predictions come back in order.

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

import collections
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

def patches():
    """What tfpar replaces in Keras for parameter servers: (owner, attribute, wrap).

    `wrap(original)` returns the replacement; `tfpar.keras.hooks` applies each one once.
    """
    trainer = internals.symbol("keras.src.backend.tensorflow.trainer.TensorFlowTrainer")
    variable = internals.symbol("keras.src.backend.tensorflow.core.Variable")
    optimizer = internals.symbol("keras.src.backend.tensorflow.optimizer.TFOptimizer")
    return [
        *[(trainer, name, functools.partial(_dispatch, loop=loop))
          for name, loop in (("fit", fit), ("evaluate", evaluate), ("predict", predict))],
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
        *ps_state.patches(),
    ]


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


def _overrides_train_step(model):
    """Whether the model's class has its own train_step (not Keras', nor tfpar's hook).

    tfpar's train-step hook (installed by PipelineStrategy) replaces `keras.Model.train_step`
    with a wrapper of Keras' own; that wrapper is not the user's.
    """
    return not steps.is_keras_train_step(type(model).train_step)


# -- data ---------------------------------------------------------------------

class _Input:
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


def _build(model, dataset):
    with model.distribute_strategy.scope():
        internals.attr(model, "_symbolic_build")(data_batch=dataset.element_spec)
    ps_state.exclusive_metric_updates(model)


def _numbers(logs):
    return {k: float(np.asarray(v)) if np.asarray(v).size == 1 else np.asarray(v)
            for k, v in logs.items()}


def _callback_list(model, callbacks, verbose, **params):
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    return keras.callbacks.CallbackList(callbacks, add_history=True, add_progbar=verbose != 0,
                                         verbose=verbose, model=model, **params)


def _compiled_state(model):
    """What a traced step captures from `compile` and trainability: a new compile (optimizer,
    loss, metrics) or a changed set of trainable weights needs new steps."""
    return (model.optimizer, internals.attr(model, "_compile_loss"),
            internals.attr(model, "_compile_metrics"), *model.trainable_weights)


def _cached(model, key, make):
    """Steps traced for `model`, made again after `compile` or a change of trainability."""
    state = _compiled_state(model)
    cache = model.__dict__.get("_tfpar_ps_steps")
    known = cache.get("compiled state") if cache else None
    if known is None or len(known) != len(state) or any(a is not b for a, b in zip(known, state)):
        cache = model.__dict__["_tfpar_ps_steps"] = {"compiled state": state}
    if key not in cache:
        cache[key] = make()
    return cache[key]


# -- the loops ----------------------------------------------------------------

def fit(model, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
        validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
        sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
        validation_batch_size=None, validation_freq=1):
    internals.attr(model, "_assert_compile_called")("fit")
    if validation_split and validation_data is None:
        split = internals.symbol(
            "keras.src.trainers.data_adapters.array_slicing.train_validation_split")
        (x, y, sample_weight), validation_data = split(
            (x, y, sample_weight), validation_split=validation_split)
    data = _Input(x, y, sample_weight, batch_size, steps_per_epoch, shuffle, class_weight)
    steps = data.steps(steps_per_epoch, "steps_per_epoch")
    _build(model, data.dataset)
    strategy = model.distribute_strategy
    epoch_runner = (_SyncEpochs if hooks_of(strategy)._tfpar_synchronous
                    else _AsyncEpochs)(model, data)
    callbacks = _callback_list(model, callbacks, verbose, epochs=epochs, steps=steps)

    model.stop_training = False
    callbacks.on_train_begin()
    initial_epoch = internals.attr(model, "_initial_epoch") or initial_epoch
    logs = {}
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        callbacks.on_epoch_begin(epoch)
        epoch_runner.run(steps, callbacks)
        epoch_logs = _numbers(model.get_metrics_result())
        if validation_data is not None and internals.attr(model, "_should_eval")(
                epoch, validation_freq):
            val_x, val_y, val_sample_weight = keras.utils.unpack_x_y_sample_weight(
                validation_data)
            val_logs = evaluate(model, val_x, val_y, sample_weight=val_sample_weight,
                                batch_size=validation_batch_size or batch_size,
                                steps=validation_steps, callbacks=callbacks, return_dict=True)
            epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
        callbacks.on_epoch_end(epoch, epoch_logs)
        logs = epoch_logs
        if model.stop_training:
            break
    callbacks.on_train_end(logs=logs)
    return model.history


class _AsyncEpochs:
    """Each worker reads its own data and applies its own updates."""

    def __init__(self, model, data):
        self.model = model
        self.strategy = model.distribute_strategy
        self.data = data
        # Through a tf.data service, each epoch is one pass that hands every batch to one
        # worker (a job per epoch); otherwise each worker repeats its own shard.
        self.per_epoch = self.strategy.data_service is not None
        if not self.per_epoch:
            self.iterator = self.strategy.per_worker_iterator(data.per_worker(), repeat=True)
        if _overrides_train_step(model):
            self.step = model.train_step
        else:
            self.step = _cached(model, "train", lambda: functools.partial(_train_step, model))

    def run(self, steps, callbacks):
        if not self.per_epoch:
            self._schedule(0, steps, callbacks)
            return
        # The epoch's pass is read by every worker's iterator, each fetching batches ahead.
        # A closure (on whichever worker is free) ends early only once the pass has run out
        # for its worker; the batches left then are those other workers fetched ahead, which
        # only their own iterators give out. So each worker in turn runs a closure pinned to
        # it that reads its iterator to the end (or to the epoch's steps): every batch of
        # the pass is read once. (Without catch-up, epochs of 20 steps ran 16 to 19 under CPU
        # load; unpinned catch-up closures could all land on a worker with nothing left while
        # another held 10 batches: measured, an epoch ended 10 short.)
        self.iterator = self.strategy.per_worker_iterator(self.data.per_worker())
        start = int(self.strategy.steps_run.numpy())
        self._schedule(0, steps, callbacks)
        done = int(self.strategy.steps_run.numpy()) - start
        for worker in range(self.strategy.num_workers):
            if done >= steps or self.model.stop_training:
                break
            pinned = self.strategy.schedule_steps_on(worker, self.step, self.iterator,
                                                     steps - done)
            try:
                self.strategy.fetch(pinned)
            except tf.errors.CancelledError:
                pass  # The worker is lost, and the batches it held with it.
            del pinned  # A value kept would make the coordinator rerun it on recovery.
            ran = int(self.strategy.steps_run.numpy()) - start - done
            if ran:
                callbacks.on_train_batch_begin(done)
                callbacks.on_train_batch_end(done + ran - 1,
                                             _numbers(self.model.get_metrics_result()))
            done += ran

    def _schedule(self, begin, steps, callbacks):
        """Schedules `steps` steps in closures of steps_per_execution; waits for them.

        Waiting for a closure fetches its value, None: nothing to copy from a worker that
        has gone since."""
        per_call = max(1, int(self.model.steps_per_execution))
        # Batch logs are read from the metrics on the ps after each closure. At most
        # `_LOG_WINDOW` closures per worker are in flight, so they miss at most those
        # steps (the documented staleness); a worker never waits for the chief.
        in_flight = collections.deque()
        for first in range(begin, begin + steps, per_call):
            count = min(per_call, begin + steps - first)
            callbacks.on_train_batch_begin(first)
            in_flight.append(self.strategy.schedule_steps(self.step, self.iterator, count))
            if len(in_flight) > _LOG_WINDOW * self.strategy.num_workers:
                self.strategy.fetch(in_flight.popleft())
            callbacks.on_train_batch_end(first + count - 1,
                                         _numbers(self.model.get_metrics_result()))
            if self.model.stop_training:
                break
        self.strategy.join()


_LOG_WINDOW = 4


class _SyncEpochs:
    """The chief splits each batch over the workers; one averaged update per batch."""

    def __init__(self, model, data):
        if int(model.steps_per_execution) != 1:
            raise ValueError(
                f"steps_per_execution={model.steps_per_execution} cannot be honoured in "
                f"sync mode: the chief splits each batch over the workers and waits for "
                f"them, one step at a time. Compile with steps_per_execution=1, or use "
                f"mode='async' (where it sets the steps of one closure).")
        self.model = model
        self.strategy = model.distribute_strategy
        self.parts = self.strategy.num_workers
        self.iterator = iter(data.dataset.repeat())
        self.gradients = _cached(model, ("sync", self.parts), lambda: hooks_of(
            self.strategy)._tfpar_sync_gradients(model.trainable_weights, self.parts))
        self._found = _cached(model, ("sync traced", self.parts), dict)
        self.batch_norm = _cached(model, ("sync batch norm", self.parts), lambda: (
            ps_state.BatchNormParts(self.strategy, model, self.parts)))

    # Steps are cached on the model (like the gradient slots), so a second fit reuses
    # the traced functions instead of tracing new ones.
    def _count_step(self, part):
        """Part `part`'s forward pass that only records its loss counts (nothing is updated)."""
        model, gradients, found = self.model, self.gradients, self._found

        def step(data, total):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            # Stateless: what the forward pass would update (BatchNorm, metrics) is dropped.
            current = [(v, tf.convert_to_tensor(v)) for v in model.variables]
            with replicas.batch_part(_fraction(x, total)) as counting, \
                    keras.StatelessScope(state_mapping=current):
                y_pred = steps.call_model(model, x, training=True)
                internals.attr(model, "_compute_loss")(
                    x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
            found["dynamic counts"] = counting.dynamic  # Known once traced.
            gradients.store_counts(part, counting.counts)
        return _cached(model, ("sync_count", self.parts, part), lambda: step)

    def _part_step(self, part, num_parts):
        model, gradients, batch_norm = self.model, self.gradients, self.batch_norm
        custom = losses.has_custom_compute_loss(model)

        def step(data, total):
            fraction = _fraction(data, total)
            with batch_norm.recording(part):
                if custom:  # Its loss is the part's own: weighed by the part's examples.
                    part_gradients = [g * tf.cast(fraction, g.dtype)
                                      for g in _forward_backward(model, data)]
                else:
                    with replicas.batch_part(fraction, gradients.global_counts(num_parts)):
                        part_gradients = _forward_backward(model, data)
            gradients.store(part, part_gradients)
        return _cached(model, ("sync_part", self.parts, part, num_parts), lambda: step)

    def _apply_step(self, num_parts):
        model, gradients, batch_norm = self.model, self.gradients, self.batch_norm

        def step():
            model.optimizer.apply(gradients.sum(num_parts), model.trainable_weights)
            batch_norm.apply(num_parts)
        return _cached(model, ("sync_apply", self.parts, num_parts), lambda: step)

    def run(self, steps, callbacks):
        for step in range(steps):
            callbacks.on_train_batch_begin(step)
            batch = next(self.iterator)
            size = int(keras.tree.flatten(batch)[0].shape[0])
            total = tf.constant(size, tf.float32)
            sizes = [s for s in _split_sizes(size, self.parts) if s]
            pieces = _split(batch, sizes)
            # Masked losses and sample-weighted means are divided by the whole batch's
            # count, which the parts count first (a forward pass each); a model without
            # them skips this after its first step.
            if self._found.get("dynamic counts", True):
                for part, piece in enumerate(pieces):
                    self.strategy.schedule_on(self._count_step(part), piece, total)
                self.strategy.join()
            for part, piece in enumerate(pieces):
                self.strategy.schedule_on(self._part_step(part, len(pieces)), piece, total)
            self.strategy.join()
            self.strategy.schedule_on(self._apply_step(len(pieces)))
            self.strategy.join()
            callbacks.on_train_batch_end(step, _numbers(self.model.get_metrics_result()))
            if self.model.stop_training:
                break


def _fraction(data, total):
    """A part's share of its batch's `total` examples."""
    return tf.cast(steps.batch_size(data), tf.float32) / total


def _split(batch, sizes):
    """`batch` cut along its first axis into pieces of `sizes` examples."""
    leaves = [tf.split(t, sizes) for t in keras.tree.flatten(batch)]
    return [keras.tree.pack_sequence_as(batch, [leaf[k] for leaf in leaves]) for k in range(len(sizes))]


def _concat(outputs):
    """Per-batch output structures joined along the first axis."""
    leaves = [keras.tree.flatten(o) for o in outputs]
    return keras.tree.pack_sequence_as(
        outputs[0], [np.concatenate([np.asarray(o[i]) for o in leaves]) for i in range(len(leaves[0]))])


def _split_sizes(total, parts):
    """Sizes of `parts` nearly equal pieces of `total` examples, larger ones first."""
    return [total // parts + (1 if k < total % parts else 0) for k in range(parts)]


def evaluate(model, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
             steps=None, callbacks=None, return_dict=False, **kwargs):
    internals.attr(model, "_assert_compile_called")("evaluate")
    data = _Input(x, y, sample_weight, batch_size, steps)
    steps = data.steps(steps, "steps")
    _build(model, data.dataset)
    strategy = model.distribute_strategy
    step = _cached(model, "test", lambda: model.test_step)
    callbacks = _callback_list(model, callbacks, verbose, epochs=1, steps=steps)
    model.reset_metrics()
    callbacks.on_test_begin()
    for index, batch in zip(range(steps), data.dataset):
        callbacks.on_test_batch_begin(index)
        strategy.schedule_on(step, batch)
        callbacks.on_test_batch_end(index, {})
    strategy.join()
    logs = _numbers(model.get_metrics_result())
    callbacks.on_test_end(logs)
    return logs if return_dict else internals.attr(model, "_flatten_metrics_in_order")(logs)


def predict(model, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    data = _Input(x, batch_size=batch_size, steps=steps)
    steps = data.steps(steps, "steps")
    strategy = model.distribute_strategy
    step = _cached(model, "predict", lambda: model.predict_step)
    callbacks = _callback_list(model, callbacks, verbose, epochs=1, steps=steps)
    callbacks.on_predict_begin()
    results = []
    for index, batch in zip(range(steps), data.dataset):
        callbacks.on_predict_batch_begin(index)
        results.append(strategy.schedule_on(step, batch))
        callbacks.on_predict_batch_end(index, {})
    strategy.join()
    outputs = [r.fetch() for r in results]
    callbacks.on_predict_end()
    return _concat(outputs)
