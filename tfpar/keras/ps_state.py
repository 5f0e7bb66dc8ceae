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

import functools
import weakref

import tensorflow as tf

from tfpar.keras import internals

_MUTEXES = weakref.WeakKeyDictionary()
_RELEASED = weakref.WeakKeyDictionary()  # graph -> the release of its last lock


def in_worker_step():
    """Whether this code is being traced into a step that workers of a tfpar
    ParameterServerStrategy run (not the chief's own eager reads and resets)."""
    if tf.executing_eagerly() or not tf.distribute.has_strategy():
        return False
    if not getattr(tf.distribute.get_strategy(), "_tfpar_parameter_server", False):
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
    import keras

    return [(keras.layers.BatchNormalization, "call", _exclusive_batch_norm),
            (keras.optimizers.LossScaleOptimizer, "apply", _exclusive_loss_scale)]


def _exclusive_batch_norm(keras_call):
    @functools.wraps(keras_call)
    def call(self, inputs, training=None, mask=None):
        if not (training and self.trainable):
            return keras_call(self, inputs, training=training, mask=mask)
        return exclusively(self, lambda: self.non_trainable_variables,
                           lambda: keras_call(self, inputs, training=training, mask=mask))
    return call


def _exclusive_loss_scale(keras_apply):
    @functools.wraps(keras_apply)
    def apply(self, grads, trainable_variables=None):
        return exclusively(self, lambda: [self.step_counter, self.dynamic_scale],
                           lambda: keras_apply(self, grads, trainable_variables))
    return apply
