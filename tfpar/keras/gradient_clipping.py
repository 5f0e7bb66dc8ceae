"""Keras' gradient clipping and loss-scale check on the global gradient, as one device does.

Keras clips in `BaseOptimizer._backend_apply_gradients`, before `_backend_update_step` sums
the gradients over replicas, so under N replicas each clips its own part: measured on 2
replicas, `global_clipnorm=0.1` ended 9.6e-4 off one device, `clipnorm=0.1` 1e-2 (stock
`MirroredStrategy` too). A ZeRO owner and a tensor-parallel shard hold part of the
gradient, whose norm is neither the model's nor the variable's. And `LossScaleOptimizer`
reads "all finite" from replica 0's own gradients. Here, under a tfpar strategy:

- replicas that each hold every summed gradient (data parallelism, pipeline replicas) sum
  first, clip once, identically on each, and run Keras' update with neither its clipping nor
  its sum (`apply_clipped_once`);
- ZeRO owners clip their own summed gradients, the global norm from an all-reduce of their
  squared sums (`clip(..., sum_over_holders=...)`, asked by the sharded update);
- a variable held as shards (tensor parallelism) is clipped by the norm over its shards
  (`clip(..., groups=...)`, from the strategy's `_tfpar_clip_groups`);
- a replica's gradients are poisoned with NaN when any replica's are not finite, so every
  replica (and Keras' check on replica 0) skips the step and lowers the scale, as one device
  does when part of its batch overflows (`_finite_everywhere`).
"""

import contextlib
import functools
import threading

import tensorflow as tf

from tfpar.contract import hooks_of
from tfpar.keras.replica_context import replica_context
from tfpar.keras import internals

_local = threading.local()


def clips(optimizer):
    """Whether `optimizer` clips its gradients (clipnorm, global_clipnorm or clipvalue)."""
    return any(value and value > 0 for value in (
        optimizer.clipnorm, optimizer.global_clipnorm, optimizer.clipvalue))


@contextlib.contextmanager
def _flag(name, value=True):
    previous = getattr(_local, name, False)
    setattr(_local, name, value)
    try:
        yield
    finally:
        setattr(_local, name, previous)


def already_summed():
    """True while Keras' update runs on gradients tfpar already summed over replicas: its
    `_all_reduce_sum_gradients` returns them as they are (`replicas._reduced_where_they_are`)."""
    return getattr(_local, "summed", False)


def as_summed():
    """Meanwhile, in this thread, Keras' sum over replicas returns the gradients as they
    are (`already_summed`): tfpar summed them, or they are a replica's own."""
    return _flag("summed")


def _clipping_deferred():
    return getattr(_local, "deferred", False)


def deferred():
    """Keras' own clipping returns the gradients as they are meanwhile, in this thread:
    they are clipped by tfpar (before, or by their ZeRO owners after the sum)."""
    return _flag("deferred")


def _dense(grad):
    return tf.convert_to_tensor(grad) if isinstance(grad, tf.IndexedSlices) else grad


def _squared_sum(grads):
    # As Keras' `global_norm` and `_clip_by_norm` square an IndexedSlices: its values, a
    # repeated row counted apart (not summed first, as a dense gradient would have it).
    return tf.add_n([tf.reduce_sum(tf.square(tf.cast(
        g.values if isinstance(g, tf.IndexedSlices) else g, tf.float32))) for g in grads])


def clip(optimizer, grads, groups=None, sum_over_holders=None):
    """`grads` clipped as Keras clips one device's whole gradient. `grads` are summed over
    replicas already. `groups`: lists of indices into `grads` that are shards of one variable
    (`clipnorm` takes their joint norm). `sum_over_holders(x)`: the sum of a float32 scalar
    over the processes that hold the other parts of the gradient (ZeRO owners), for
    `global_clipnorm`; None when `grads` is the whole gradient."""
    joint = [g for g in (groups or ()) if len(g) > 1]
    if optimizer.clipnorm and optimizer.clipnorm > 0 and joint:
        clipped = list(_keras_clip(optimizer, grads))
        for group in joint:
            present = [i for i in group if grads[i] is not None]
            if not present:
                continue
            l2sum = _squared_sum([grads[i] for i in present])
            # Keras' `_clip_by_norm`: a zero norm leaves the gradient as it is.
            norm = tf.where(l2sum > 0, tf.sqrt(tf.where(l2sum > 0, l2sum, 1.0)), l2sum)
            for i in present:
                value = _dense(grads[i])
                bound = tf.cast(optimizer.clipnorm, value.dtype)
                clipped[i] = value * bound / tf.maximum(tf.cast(norm, value.dtype), bound)
        return clipped
    if optimizer.global_clipnorm and optimizer.global_clipnorm > 0 \
            and sum_over_holders is not None:
        present = [g for g in grads if g is not None]
        local = _squared_sum(present) if present else tf.constant(0.0)
        norm = tf.sqrt(sum_over_holders(local))
        bound = optimizer.global_clipnorm
        # As Keras' clip_by_global_norm: a norm that is not finite makes the scale NaN.
        scale = bound * tf.minimum(1.0 / norm, 1.0 / bound) + (norm - norm)
        return [g if g is None else _dense(g) * tf.cast(scale, g.dtype) for g in grads]
    return _keras_clip(optimizer, grads)


def _keras_clip(optimizer, grads):
    """The optimizer's own `_clip_gradients` (a subclass's override included), not deferred."""
    with _flag("deferred", False):
        return list(internals.attr(optimizer, "_clip_gradients")(list(grads)))


def apply_clipped_once(optimizer, keras_apply, context, grads, trainable_variables):
    """Keras' `_backend_apply_gradients` of a clipping optimizer under `context`'s strategy
    (replica context): the gradients summed over the replicas (by Keras' own sum, which
    tfpar's strategies route), clipped once, then Keras' update without its clipping or its
    sum. Under ZeRO the owners clip after their sum (`deferred` only)."""
    strategy = context.strategy
    hooks = hooks_of(strategy)
    if hooks._tfpar_shard_stage:
        with deferred():
            return keras_apply(optimizer, grads, trainable_variables)
    grads = list(grads)
    if context.num_replicas_in_sync > 1:
        summed = internals.attr(optimizer, "_all_reduce_sum_gradients")(
            list(zip(grads, trainable_variables)))
        grads = [g for g, _ in summed]
    grads = clip(optimizer, grads, clip_groups(strategy, trainable_variables))
    with deferred(), as_summed():
        return keras_apply(optimizer, grads, trainable_variables)


def clip_groups(strategy, variables):
    """Lists of indices into `variables` that are shards of one variable, or None."""
    groups = hooks_of(strategy)._tfpar_clip_groups
    return None if groups is None else groups(list(variables))


def needs_global_clipping(optimizer, context, variables):
    """Whether Keras' own clipping would clip part of the gradient under `context` (a tfpar
    replica context): several replicas, ZeRO owners, or variables held as shards."""
    if context is None or not clips(optimizer):
        return False
    return bool(context.num_replicas_in_sync > 1
                or hooks_of(context.strategy)._tfpar_shard_stage
                or clip_groups(context.strategy, variables))


def _deferrable(keras_clip_gradients):
    """BaseOptimizer._clip_gradients: as it is, unless tfpar clips these gradients itself
    (`deferred`)."""

    @functools.wraps(keras_clip_gradients)
    def clip_gradients(self, grads):
        if _clipping_deferred():
            return grads
        return keras_clip_gradients(self, grads)

    return clip_gradients


def _poisoned(grads, bad):
    """`grads` plus NaN where `bad` (a float32 scalar) > 0, else plus 0 (exact)."""
    poison = tf.where(bad > 0, tf.constant(float("nan")), tf.constant(0.0))
    out = []
    for g in grads:
        if g is None:
            out.append(g)
        elif isinstance(g, tf.IndexedSlices):
            out.append(tf.IndexedSlices(g.values + tf.cast(poison, g.values.dtype), g.indices,
                                        g.dense_shape))
        else:
            out.append(g + tf.cast(poison, g.dtype))
    return out


def _finite_everywhere(keras_tf_apply):
    """LossScaleOptimizer._tf_apply: a step is skipped (and the scale lowered) on every
    replica when any replica's gradients are not finite, as one device skips a batch part
    of which overflowed. Keras takes replica 0's answer ("each replica computed the same
    `finite` value, since `grads` is all-reduced"): they are not summed yet there."""

    @functools.wraps(keras_tf_apply)
    def tf_apply(self, grads, trainable_variables=None):
        context = replica_context("_tfpar_mirrored")
        if context is None:
            return keras_tf_apply(self, grads, trainable_variables)
        grads = list(grads)
        finite = self.check_finite(grads)
        bad = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                 tf.cast(tf.logical_not(finite), tf.float32))
        return keras_tf_apply(self, _poisoned(grads, bad), trainable_variables)

    return tf_apply


def patches():
    """What tfpar replaces in Keras for clipping and loss scaling over the global gradient:
    (owner, attribute, wrap)."""
    base = internals.symbol("keras.src.optimizers.base_optimizer.BaseOptimizer")
    import keras

    loss_scale = keras.optimizers.LossScaleOptimizer
    return [(base, "_clip_gradients", _deferrable),
            (loss_scale, "_tf_apply", _finite_everywhere)]
