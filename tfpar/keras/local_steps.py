"""Keras' optimizer step under periodic averaging (`DataParallelStrategy(sync_every=n)`,
`tfpar.distribute.data_parallel.local_sgd`): each replica applies its own gradient, and the
replicas' weights are averaged every n optimizer steps and when `fit` returns.

Under a strategy each replica's gradient is its part of the global loss's (Keras' losses
are scaled for a sum over replicas), so a replica stepping alone takes N times it: with a
mean loss, the gradient of its own examples' mean loss. Keras' own clipping, weight decay
and update then run on it as on one device, with neither tfpar's global clipping nor the
sum over replicas.
"""

import functools

import tensorflow as tf

from tfpar.contract import hooks_of
from tfpar.keras import gradient_clipping, internals, models


def _steps_between_averagings(strategy):
    """n when `strategy`'s replicas step alone (sync_every n > 1 over several replicas),
    else 0."""
    n = hooks_of(strategy)._tfpar_sync_every
    return n if n > 1 and strategy.num_replicas_in_sync > 1 else 0


def every(context):
    """The optimizer steps between averagings when `context`'s replicas step alone, else
    0. `context`: a replica context, or None."""
    return 0 if context is None else _steps_between_averagings(context.strategy)


def averaged_variables(strategy, optimizer, variables):
    """The `tf.Variable`s an averaging sets: `variables` (the trained weights), and the
    optimizer's variables when `strategy` averages its state too (the averaging leaves
    the integer ones, such as the step count)."""
    chosen = [models.tf_variable(v) for v in variables]
    if optimizer is not None and hooks_of(strategy)._tfpar_sync_optimizer_state:
        chosen += [models.tf_variable(v) for v in optimizer.variables]
    return chosen


def apply_alone(optimizer, keras_apply, context, grads, trainable_variables):
    """Keras' `_backend_apply_gradients` in replica `context` of a strategy whose replicas
    step alone: the replica's own gradient (N x its part), Keras' clipping and update,
    then the weights averaged when the optimizer's step count reaches a multiple of n."""
    n = every(context)
    if optimizer.gradient_accumulation_steps:
        raise ValueError(
            f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps} is not "
            f"supported with sync_every={n}: both trade steps for fewer reductions. Drop one "
            f"(sync_every={n} already sums nothing between averagings).")
    replicas = context.num_replicas_in_sync
    grads = [None if g is None
             else tf.IndexedSlices(g.values * replicas, g.indices, g.dense_shape)
             if isinstance(g, tf.IndexedSlices) else g * tf.cast(replicas, g.dtype)
             for g in grads]
    with gradient_clipping.as_summed():  # Keras' sum over replicas leaves them as they are.
        result = keras_apply(optimizer, grads, trainable_variables)
    variables = averaged_variables(context.strategy, optimizer, trainable_variables)
    average = hooks_of(context.strategy)._tfpar_average_replicas
    iterations = optimizer.iterations

    def in_cross_replica_context(strategy):
        # (Keras' `apply` counts the step after this; the weights are read after their
        # update, which writes them.)
        due = (tf.convert_to_tensor(iterations) + 1) % n == 0
        return tf.cond(due, lambda: average(variables), lambda: tf.constant(False))

    context.merge_call(in_cross_replica_context)
    return result


def average_now(model, optimizer=None):
    """Sets the replicas' copies of `model`'s trainable weights (and, where the strategy
    averages it, `optimizer`'s state; default: the compiled one) to their mean, in
    cross-replica context: after `fit`, or at the end of a custom loop."""
    strategy = internals.attr(model, "_distribute_strategy")
    if strategy is None or not _steps_between_averagings(strategy):
        return
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    with strategy.scope():
        hooks_of(strategy)._tfpar_average_replicas(
            averaged_variables(strategy, optimizer, model.trainable_variables))


def _averaged_after_fit(keras_fit):
    """TensorFlowTrainer.fit: under periodic averaging, the replicas' weights averaged when
    it returns, so that what is saved, evaluated or predicted next is one model whatever
    the step count. (A fit that raised leaves them: a lost worker would fail it again.)"""

    @functools.wraps(keras_fit)
    def fit(self, *args, **kwargs):
        history = keras_fit(self, *args, **kwargs)
        average_now(self)
        return history

    return fit


def patches():
    """What tfpar replaces in Keras for periodic averaging: (owner, attribute, wrap)."""
    trainer = internals.symbol("keras.src.backend.tensorflow.trainer.TensorFlowTrainer")
    return [(trainer, "fit", _averaged_after_fit)]
