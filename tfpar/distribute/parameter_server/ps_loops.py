"""Keras' `fit`, `evaluate` and `predict` on a parameter-server cluster: the loops.

Keras 3 has no parameter-server path (its `fit` iterates a distributed dataset on the
chief, which a ParameterServerStrategy refuses). The strategy runs these loops instead
(its `_tfpar_run_loop` hook, called by the Keras seam's `fit`/`evaluate`/`predict`), with
Keras' own callbacks, data adapters, metrics and steps, reached through
`tfpar.keras.ps_adapters`.

- Training (async): each worker reads its own shard of the dataset, repeated (or, with
  a tf.data service, one pass per epoch shared by all); the chief schedules
  `steps_per_execution` steps per closure on whichever worker is free. Batch-level
  callbacks get logs read from the metrics on the ps, with at most `_LOG_WINDOW`
  closures per worker in flight (bounded staleness); epoch logs are exact.
- Training (sync): the chief reads each batch and splits it over the workers; each
  part's loss is its share of the batch's loss, its gradients are stored on the ps and
  summed there before one update (`ps_sync.SyncGradients`): one device on the combined
  batch. BatchNorm moves once per step (`tfpar.keras.ps_state`).
- evaluate / predict: the chief reads the batches and sends each to a free worker,
  so every example is seen exactly once and predictions come back in order.
"""

import collections
import functools

import tensorflow as tf

from tfpar.distribute.parameter_server.ps_sync import SYNC, SyncGradients
from tfpar.keras import ps_adapters as keras_model


def fit(model, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
        validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
        sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
        validation_batch_size=None, validation_freq=1):
    keras_model.assert_compiled(model, "fit")
    if validation_split and validation_data is None:
        (x, y, sample_weight), validation_data = keras_model.validation_split(
            (x, y, sample_weight), validation_split)
    data = keras_model.LoopInput(x, y, sample_weight, batch_size, steps_per_epoch, shuffle,
                                 class_weight)
    steps = data.steps(steps_per_epoch, "steps_per_epoch")
    keras_model.build(model, data.dataset)
    strategy = model.distribute_strategy
    epoch_runner = (_SyncEpochs if strategy.mode == SYNC else _AsyncEpochs)(model, data)
    callbacks = keras_model.callback_list(model, callbacks, verbose, epochs=epochs, steps=steps)

    model.stop_training = False
    callbacks.on_train_begin()
    initial_epoch = keras_model.initial_epoch(model, initial_epoch)
    logs = {}
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        callbacks.on_epoch_begin(epoch)
        epoch_runner.run(steps, callbacks)
        epoch_logs = keras_model.metric_logs(model)
        if validation_data is not None and keras_model.evaluates_at(model, epoch,
                                                                     validation_freq):
            val_x, val_y, val_sample_weight = keras_model.unpack(validation_data)
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
        self.step = keras_model.train_step(model)

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
                callbacks.on_train_batch_end(done + ran - 1, keras_model.metric_logs(self.model))
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
            callbacks.on_train_batch_end(first + count - 1, keras_model.metric_logs(self.model))
            if self.model.stop_training:
                break
        self.strategy.join()


_LOG_WINDOW = 4


class _SyncEpochs:
    """The chief splits each batch over the workers; one summed update per batch."""

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
        # Steps are cached on the model (like the gradient slots), so a second fit reuses
        # the traced functions instead of tracing new ones; a new compile makes new ones.
        self.gradients = keras_model.cached(model, ("sync", self.parts), lambda: (
            SyncGradients(self.strategy, model.trainable_weights, self.parts)))
        self._found = keras_model.cached(model, ("sync traced", self.parts), dict)
        self.batch_norm = keras_model.cached(model, ("sync batch norm", self.parts), lambda: (
            keras_model.batch_norm_parts(self.strategy, model, self.parts)))

    def _count_step(self, part):
        """Part `part`'s forward pass that only records its loss counts (nothing is updated)."""
        model, gradients, found = self.model, self.gradients, self._found

        def step(data, total):
            counts, dynamic = keras_model.loss_counts(model, data, _fraction(data, total))
            found["dynamic counts"] = dynamic  # Known once traced.
            gradients.store_counts(part, counts)
        return keras_model.cached(model, ("sync_count", self.parts, part), lambda: step)

    def _part_step(self, part, num_parts):
        model, gradients, batch_norm = self.model, self.gradients, self.batch_norm

        def step(data, total):
            with batch_norm.recording(part):
                part_gradients = keras_model.part_gradients(
                    model, data, _fraction(data, total), gradients.global_counts(num_parts))
            gradients.store(part, part_gradients)
        return keras_model.cached(model, ("sync_part", self.parts, part, num_parts),
                                  lambda: step)

    def _apply_step(self, num_parts):
        model, gradients, batch_norm = self.model, self.gradients, self.batch_norm

        def step():
            model.optimizer.apply(gradients.sum(num_parts), model.trainable_weights)
            batch_norm.apply(num_parts)
        return keras_model.cached(model, ("sync_apply", self.parts, num_parts), lambda: step)

    def run(self, steps, callbacks):
        for step in range(steps):
            callbacks.on_train_batch_begin(step)
            batch = next(self.iterator)
            size = keras_model.examples(batch)
            total = tf.constant(size, tf.float32)
            sizes = [s for s in _split_sizes(size, self.parts) if s]
            pieces = keras_model.split(batch, sizes)
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
            callbacks.on_train_batch_end(step, keras_model.metric_logs(self.model))
            if self.model.stop_training:
                break


def _fraction(data, total):
    """A part's share of its batch's `total` examples."""
    return tf.cast(keras_model.batch_size(data), tf.float32) / total


def _split_sizes(total, parts):
    """Sizes of `parts` nearly equal pieces of `total` examples, larger ones first."""
    return [total // parts + (1 if k < total % parts else 0) for k in range(parts)]


def evaluate(model, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
             steps=None, callbacks=None, return_dict=False, **kwargs):
    keras_model.assert_compiled(model, "evaluate")
    data = keras_model.LoopInput(x, y, sample_weight, batch_size, steps)
    steps = data.steps(steps, "steps")
    keras_model.build(model, data.dataset)
    strategy = model.distribute_strategy
    step = keras_model.cached(model, "test", lambda: model.test_step)
    callbacks = keras_model.callback_list(model, callbacks, verbose, epochs=1, steps=steps)
    model.reset_metrics()
    callbacks.on_test_begin()
    for index, batch in zip(range(steps), data.dataset):
        callbacks.on_test_batch_begin(index)
        strategy.schedule_on(step, batch)
        callbacks.on_test_batch_end(index, {})
    strategy.join()
    logs = keras_model.metric_logs(model)
    callbacks.on_test_end(logs)
    return logs if return_dict else keras_model.flatten_metrics(model, logs)


def predict(model, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    data = keras_model.LoopInput(x, batch_size=batch_size, steps=steps)
    steps = data.steps(steps, "steps")
    strategy = model.distribute_strategy
    step = keras_model.cached(model, "predict", lambda: model.predict_step)
    callbacks = keras_model.callback_list(model, callbacks, verbose, epochs=1, steps=steps)
    callbacks.on_predict_begin()
    results = []
    for index, batch in zip(range(steps), data.dataset):
        callbacks.on_predict_batch_begin(index)
        results.append(strategy.schedule_on(step, batch))
        callbacks.on_predict_batch_end(index, {})
    strategy.join()
    outputs = [r.fetch() for r in results]
    callbacks.on_predict_end()
    return keras_model.concat(outputs)


LOOPS = {"fit": fit, "evaluate": evaluate, "predict": predict}
