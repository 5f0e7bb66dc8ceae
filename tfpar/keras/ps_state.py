"""State updates that no worker loses under tfpar.ParameterServerStrategy.

Async workers update the same ps variables at once. Keras updates most state as
`v.assign(f(v, x))`: Precision, Recall, AUC, IoU, F-scores and R2 add to their counts
that way, BatchNorm moves its statistics that way, LossScaleOptimizer counts finite
steps and scales its loss that way. Two workers that read `v` before either writes
lose one update (a measured 1.3e-2 error in AUC after one evaluate).

Here each such update runs under a lock that lives on the ps (a TensorFlow mutex):
the read, the arithmetic and the write happen while no other worker updates the same
state, so the result is one device's applied in some order. Metric sums are then exact
up to float rounding; BatchNorm's moving statistics and the loss scale are one
device's updates, one step at a time, in the order the workers applied them.

Held only around the update itself (a metric's `update_state`, BatchNorm's training
call, the loss-scale optimizer's `apply`), not around the whole step.
"""

import contextlib
import functools
import threading
import weakref

import keras
import tensorflow as tf

from tfpar.contract import hooks_of
from tfpar.keras import internals

_MUTEXES = weakref.WeakKeyDictionary()
_RELEASED = weakref.WeakKeyDictionary()  # graph -> the release of its last lock


def uses_parameter_servers(strategy):
    """Whether `strategy` is a tfpar ParameterServerStrategy."""
    return hooks_of(strategy)._tfpar_parameter_server


def in_worker_step():
    """Whether this code is being traced into a step that workers of a tfpar
    ParameterServerStrategy run (not the chief's own eager reads and resets)."""
    if tf.executing_eagerly() or not tf.distribute.has_strategy():
        return False
    if not uses_parameter_servers(tf.distribute.get_strategy()):
        return False
    return not internals.symbol(
        "keras.src.backend.common.stateless_scope.in_stateless_scope")()


def exclusively(owner, state, update):
    """`update()`, holding `owner`'s lock while it reads and writes the variables `state()`.

    The lock (a mutex on the ps of the first variable) is taken, then each state variable
    is written once (adding zero): TensorFlow runs the ops of one variable in program
    order, so every read and write of the state in `update` comes after the lock. The
    lock is released after a last read of each. (`tf.CriticalSection` cannot be used:
    the loss-scale optimizer's `merge_call` inside it never returns.) Outside a worker
    step, or for an owner without state, `update()` just runs.
    """
    if not in_worker_step():
        return update()
    handles = [h for variable in state() for h in _handles(variable)]
    if not handles:
        return update()
    graph = tf.compat.v1.get_default_graph()
    device = handles[0].device  # The lock never leaves it (it cannot be sent).
    # One lock at a time in a step: a step that took a second lock before releasing
    # the first could wait for a worker that holds them the other way round.
    with tf.control_dependencies(_RELEASED.get(graph, [])), tf.device(device):
        lock = tf.raw_ops.MutexLock(mutex=_mutex(owner, device))
    with tf.control_dependencies([lock]):
        for handle in handles:
            handle.assign_add(tf.zeros(handle.shape, handle.dtype))
    result = update()
    reads = [handle.read_value() for handle in handles]
    with tf.control_dependencies(reads), tf.device(device):
        _RELEASED[graph] = [tf.raw_ops.ConsumeMutexLock(mutex_lock=lock)]
    return result


def _handles(variable):
    """The TensorFlow variables under a Keras variable (the shards of a sharded one)."""
    value = internals.attr(variable, "_value")
    sharded = internals.symbol("tensorflow.python.distribute.sharded_variable.ShardedVariable")
    return list(value.variables) if isinstance(value, sharded) else [value]


def _mutex(owner, device):
    if owner not in _MUTEXES:
        # Made eagerly (also while a step is traced), so every worker's step shares it.
        with tf.init_scope(), tf.device(device):
            _MUTEXES[owner] = tf.raw_ops.MutexV2(
                shared_name=f"tfpar_{type(owner).__name__}_{id(owner)}")
    return _MUTEXES[owner]


def exclusive_metric_updates(model):
    """Makes every metric of `model` update its state under its lock (idempotent)."""
    for metric in model.metrics:
        keras_update = metric.update_state
        if getattr(keras_update, "_tfpar_exclusive", False):
            continue

        @functools.wraps(keras_update)
        def update_state(*args, metric=metric, keras_update=keras_update, **kwargs):
            return exclusively(metric, lambda: metric.variables, lambda: keras_update(*args, **kwargs))

        update_state._tfpar_exclusive = True
        # On the instance: every metric class has its own update_state.
        object.__setattr__(metric, "update_state", update_state)


def patches():
    """(owner, attribute, wrap) for `tfpar.keras.hooks`: the class-level updates."""
    return [(keras.layers.BatchNormalization, "call", _exclusive_batch_norm),
            (keras.layers.BatchNormalization, "_moments", _recorded_moments),
            (keras.optimizers.LossScaleOptimizer, "apply", _exclusive_loss_scale)]


def _exclusive_batch_norm(keras_call):
    @functools.wraps(keras_call)
    def call(self, inputs, training=None, mask=None):
        if not (training and self.trainable):
            return keras_call(self, inputs, training=training, mask=mask)
        recorded = getattr(_sync_part, "moments", None)
        if recorded is not None:
            # A part of a sync step: its moments are kept, its own update dropped.
            moving = [self.moving_mean, self.moving_variance]
            with keras.StatelessScope(state_mapping=[(v, tf.convert_to_tensor(v))
                                                     for v in moving]):
                return keras_call(self, inputs, training=training, mask=mask)
        return exclusively(self, lambda: self.non_trainable_variables,
                           lambda: keras_call(self, inputs, training=training, mask=mask))
    return call


def _recorded_moments(keras_moments):
    @functools.wraps(keras_moments)
    def moments(self, inputs, mask):
        mean, variance = keras_moments(self, inputs, mask)
        recorded = getattr(_sync_part, "moments", None)
        if recorded is not None:
            weights = tf.ones(()) if mask is None else tf.cast(mask, tf.float32)
            count = (tf.reduce_sum(weights) * tf.cast(tf.size(inputs), tf.float32)
                     / tf.cast(tf.size(weights) * tf.size(mean), tf.float32))
            recorded[id(self)] = (tf.reshape(tf.cast(mean, tf.float32), [-1]),
                                  tf.reshape(tf.cast(variance, tf.float32), [-1]), count)
        return mean, variance
    return moments


_sync_part = threading.local()


class BatchNormParts:
    """BatchNorm in a sync step split over workers: each part keeps its batch moments
    on the ps, and the apply step moves the statistics once, by the whole batch's:

        parts with n_k examples, means m_k, variances v_k; n = sum n_k
        mean = sum n_k m_k / n,  variance = sum n_k (v_k + m_k^2) / n - mean^2
    """

    def __init__(self, strategy, model, num_parts):
        import keras

        self.layers = [layer for layer in internals.attr(model, "_flatten_layers")()
                       if isinstance(layer, keras.layers.BatchNormalization)]
        renorm = [layer.name for layer in self.layers if layer.renorm]
        if renorm:
            raise ValueError(f"BatchNormalization with renorm=True cannot be split over "
                             f"workers in sync mode ({', '.join(renorm)}); use mode='async' "
                             f"or renorm=False.")
        with strategy.scope():
            self.slots = {id(layer): [
                [tf.Variable(tf.zeros(size), trainable=False, name=f"sync_moments_{k}")
                 for size in (layer.moving_mean.shape, layer.moving_mean.shape, ())]
                for k in range(num_parts)] for layer in self.layers}

    @contextlib.contextmanager
    def recording(self, part):
        """Meanwhile (in this thread), BatchNorm keeps part `part`'s moments."""
        _sync_part.moments = {}
        try:
            yield
            for layer_id, (mean, variance, count) in _sync_part.moments.items():
                for slot, value in zip(self.slots[layer_id][part], (mean, variance, count)):
                    slot.assign(tf.reshape(value, slot.shape))
        finally:
            _sync_part.moments = None

    def apply(self, num_parts):
        """Moves each BatchNorm's statistics once, by the moments of parts 0..num_parts-1."""
        for layer in self.layers:
            parts = self.slots[id(layer)][:num_parts]
            counts = [tf.convert_to_tensor(c) for _, _, c in parts]
            total = tf.add_n(counts)
            mean = tf.add_n([n * tf.convert_to_tensor(m) for (m, _, _), n in zip(parts, counts)])
            mean = mean / total
            second = tf.add_n([n * (tf.convert_to_tensor(v) + tf.square(tf.convert_to_tensor(m)))
                               for (m, v, _), n in zip(parts, counts)]) / total
            variance = second - tf.square(mean)
            for moving, batch in ((layer.moving_mean, mean), (layer.moving_variance, variance)):
                batch = tf.reshape(tf.cast(batch, moving.dtype), moving.shape)
                moving.assign(moving * layer.momentum + batch * (1.0 - layer.momentum))


def _exclusive_loss_scale(keras_apply):
    @functools.wraps(keras_apply)
    def apply(self, grads, trainable_variables=None):
        return exclusively(self, lambda: [self.step_counter, self.dynamic_scale],
                           lambda: keras_apply(self, grads, trainable_variables))
    return apply
