"""Keras' training math made exact for replicas that share one global batch.

Under a tfpar mirrored strategy (`DataParallelStrategy`, one host or several workers)
Keras computes each replica's loss on its own part of the batch. Three Keras habits
would make N replicas differ from one device on the same global batch; here each
is replaced, only inside a replica context of a tfpar strategy:

- *Mean losses.* Keras divides each replica's loss by its own count (examples,
  valid mask entries, or sum of sample weights), then by N. That is the global
  mean only when every replica has the same count: not for a global batch that
  does not divide by N, an epoch's last partial batch, masks, or sample weights.
  Here a replica's loss is its sum divided by the *global* count (one all-reduce
  of a scalar per loss), so the all-reduced gradient is one device's exactly:

      replicas with 3 and 1 valid tokens, token losses a, b, c | d:
      Keras:  (a+b+c)/3/2 + d/1/2       tfpar: (a+b+c)/4 + d/4 = mean of all 4

  The loss Keras reports is then the sum over replicas (one more all-reduce).
- *BatchNorm moving statistics.* Keras creates them with aggregation NONE, so each
  replica kept its own copy and `model.save` wrote replica 0's. Here they are
  created with aggregation MEAN: every replica holds the mean of the replicas'
  updates (identical copies; what is used is what is saved). With
  `synchronized=True` the batch statistics are global, so they equal one device's.
- *Losses added in call.* A layer keeps the losses of its last call (activity
  regularizers, `add_loss`) in one Python list, shared by the replicas, whose step
  functions TensorFlow traces in turns: once a replica waits for the others (the
  all-reduce above, or synchronized BatchNorm), the next one's forward replaces the list
  and the first then reads the other replica's losses. Here each replica has its own.
- *Activity regularizers before Keras 3.14.* Keras 3.14 divides a layer's activity
  regularizer loss by its batch size, a mean like every other loss added in call; before,
  it is the regularizer of the whole output, a sum over the examples. A sum over a part
  of the batch is its share of the batch's sum as it is: Keras' 1/replicas scaling (and
  tfpar's weighing of batch parts) would divide it. Here, on those releases, the losses
  an activity regularizer adds are marked as sums (`is_batch_sum`) and added unscaled.
- *Gradient accumulation.* Keras' optimizer all-reduces inside a `cond`, which
  TensorFlow refuses (a merge call in control flow). Here each replica accumulates its
  own gradients, the sum over replicas of accumulator plus gradient is all-reduced every
  step before the `cond`, and the accumulate-or-apply choice runs in cross-replica
  context.
- *Clipping and loss scaling.* Keras clips each replica's gradients before their sum, and
  its LossScaleOptimizer reads replica 0's finiteness: `gradient_clipping` clips the sum,
  and skips a step every replica when any overflows.
"""

import contextlib
import functools
import threading
import weakref

import tensorflow as tf

from tfpar import errors as tfpar_errors
from tfpar.contract import hooks_of
from tfpar.keras.replica_context import replica_context
from tfpar.keras import compression
from tfpar.keras import local_steps
from tfpar.keras import gradient_clipping
from tfpar.keras import look_ahead
from tfpar.keras import internals
from tfpar.keras import context_layers
from tfpar.keras import models
from tfpar.keras import ps_state
from tfpar.keras import steps
from tfpar.keras import zero_optimizers
from tfpar.keras import xla_calls

_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")
_local = threading.local()
# First Keras release whose activity-regularizer losses are means over the batch (Layer.__call__
# divides them by the batch size); before, they are sums over it.
ACTIVITY_MEANS_SINCE = "3.14.0"
_BATCH_SUM = "_tfpar_batch_sum"
_batch_sums = {}  # id -> True, for tensors that take no attribute (dropped with the tensor).


def replica_id():
    """The current replica's index among this worker's replicas (0 outside replica
    threads)."""
    return internals.symbol(
        "tensorflow.python.distribute.values_util.get_current_replica_id_as_int")() or 0


def replica_in_sync():
    """The current replica's index among all replicas of all workers, as a Python int
    (in replica context)."""
    value = tf.distribute.get_replica_context().replica_id_in_sync_group
    return value if isinstance(value, int) else int(tf.get_static_value(value))


@contextlib.contextmanager
def thread_setting(local, name, value):
    """`local.<name>` (a `threading.local`) is `value` meanwhile, in this thread."""
    previous = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield value
    finally:
        setattr(local, name, previous)


def own_loss_normalization():
    """Keras' own loss reduction meanwhile, in this replica's thread: a step that weighs
    its parts itself (the pipeline's micro-batches) asks for it."""
    return thread_setting(_local, "suspended", True)


class _ReplicaSums:
    """Global counts and losses of replicas in sync: all-reduced sums (data parallelism)."""

    def __init__(self, context):
        self._context = context

    def global_count(self, count, dynamic):
        return self._context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(count, tf.float32))

    def reported(self, value):
        return self._context.all_reduce(tf.distribute.ReduceOp.SUM, value)


class _BatchPart:
    """One part of a batch whose parts run apart, their gradients summed afterwards
    (parameter-server sync mode); `fraction` is the part's share of the examples.

    Counting (`global_counts` None), it records the count of each mean-reduced loss.
    Training, a loss with a *dynamic* count (masked, or weighted by sample weights) is
    divided by `global_counts[i]`, the sum of the parts' recorded counts; any other count
    is proportional to the examples, so the global one is `count / fraction`.
    """

    def __init__(self, fraction, global_counts):
        self.fraction = fraction
        self.global_counts = global_counts
        self.counts = []
        self.dynamic = False

    def global_count(self, count, dynamic):
        index = len(self.counts)
        self.counts.append(tf.cast(count, tf.float32))
        self.dynamic = self.dynamic or dynamic
        if self.global_counts is None:
            return count
        if dynamic:
            return self.global_counts[index]
        return tf.cast(count, tf.float32) / tf.cast(self.fraction, tf.float32)

    def reported(self, value):
        # The loss tracker weighs each part by its examples: share / fraction, weighted
        # by the examples, adds up to the sum of the shares, the batch's loss.
        return value / tf.cast(self.fraction, value.dtype)

    def additional(self, value):
        # Losses added in call or by regularizers: each part adds its own, weighed by its
        # share of the examples (their mean over the parts, as across replicas).
        return value * tf.cast(self.fraction, value.dtype)


def batch_part(fraction, global_counts=None):
    """Losses computed meanwhile, in this thread, are one part's share of its batch's loss
    (see `_BatchPart`); yields the part, whose `counts` a counting pass stores."""
    return thread_setting(_local, "part", _BatchPart(fraction, global_counts))


def _normalizing_context():
    """What tfpar normalizes losses globally with: a batch part, or the replicas; None
    outside them (also while a step weighs its parts itself: `own_loss_normalization`)."""
    if getattr(_local, "suspended", False):
        return None
    part = getattr(_local, "part", None)
    if part is not None:
        return part
    context = replica_context()
    return None if context is None else _ReplicaSums(context)


def call_losses(layer):
    """The losses `layer` added in its last call (this replica's, under tfpar replicas)."""
    if _per_replica():
        return list(_own_losses(layer))
    return list(internals.attr(layer, "_losses"))


def set_call_losses(layer, losses):
    """Replaces the losses `layer` added in its last call (see `call_losses`)."""
    target = _own_losses(layer) if _per_replica() else internals.attr(layer, "_losses")
    target[:] = losses


def activity_losses_are_sums():
    """Whether the installed Keras adds activity-regularizer losses as sums over the batch
    (before 3.14) rather than means."""
    return internals.installed("keras") < internals.release(ACTIVITY_MEANS_SINCE)


def mark_batch_sum(loss):
    """Marks `loss` (a loss added in call) as a sum over its batch's examples."""
    try:
        setattr(loss, _BATCH_SUM, True)
    except AttributeError:
        _batch_sums[id(loss)] = True
        weakref.finalize(loss, _batch_sums.pop, id(loss), None)
    return loss


def is_batch_sum(loss):
    """Whether `loss` (a loss added in call) is a sum over its batch's examples (an activity
    regularizer's before Keras 3.14), not a mean."""
    return bool(getattr(loss, _BATCH_SUM, False) or _batch_sums.get(id(loss), False))


def call_loss_share(loss, share):
    """The weight of a part's loss added in call in its batch's loss: `share` (the part's
    share of the examples) for a mean over the part, 1 for a sum over it."""
    return 1.0 if is_batch_sum(loss) else share


def batch_call_loss(parts, shares):
    """One loss added in call for a batch, from its parts' (one per part, with their shares):
    means weighted by the shares, sums added (and marked a sum)."""
    total = tf.add_n([tf.cast(loss * tf.cast(call_loss_share(loss, share), loss.dtype),
                              loss.dtype) for loss, share in zip(parts, shares)])
    return mark_batch_sum(total) if all(is_batch_sum(loss) for loss in parts) else total


def _under_tfpar():
    """Whether a tfpar strategy that splits batches (replicas, micro-batches, parameter-server
    parts) is in scope."""
    if not tf.distribute.has_strategy():
        return False
    hooks = hooks_of(tf.distribute.get_strategy())
    return bool(hooks._tfpar_exact_replicas or hooks._tfpar_parameter_server)


def _activity_sums_marked(keras_call):
    """Layer.__call__ before Keras 3.14: the losses its activity regularizer adds (one per
    output tensor, the last losses the call adds) are marked as sums over the batch."""

    @functools.wraps(keras_call)
    def __call__(self, *args, **kwargs):
        outputs = keras_call(self, *args, **kwargs)
        if self.activity_regularizer is None:
            return outputs
        import keras

        count = sum(1 for t in keras.tree.flatten(outputs) if keras.ops.is_tensor(t))
        if count:  # This replica's losses, or a StatelessScope's (a pipeline's remat rerun).
            for loss in internals.attr(self, "_get_own_losses")()[-count:]:
                mark_batch_sum(loss)
        return outputs

    return __call__


def _batch_sums_unscaled(keras_aggregate):
    """TensorFlowTrainer._aggregate_additional_loss: a loss that is a sum over the batch
    (`is_batch_sum`) is not scaled by 1/replicas under tfpar: the replicas' (or parts')
    sums add up to the batch's."""

    @functools.wraps(keras_aggregate)
    def _aggregate_additional_loss(self, loss):
        if not (is_batch_sum(loss) and _under_tfpar()):
            return keras_aggregate(self, loss)
        trainer = internals.symbol("keras.src.trainers.trainer.Trainer")
        total = internals.attr(trainer, "_aggregate_additional_loss")(self, loss)
        share = getattr(_local, "share", None)
        return total if share is None else total / tf.cast(share, total.dtype)

    return _aggregate_additional_loss


def weighed_as_part(share):
    """Meanwhile, in this thread, a loss being computed is one part's (a micro-batch's under
    a custom `compute_loss`), which its caller multiplies by `share`: the sums over the
    part's examples it adds through `_aggregate_additional_loss` are divided by `share`
    here, so that they count once."""
    return thread_setting(_local, "share", share)


def _global_mean(keras_reduce):
    """Replaces Keras' `reduce_weighted_values` (losses) with global normalization."""

    @functools.wraps(keras_reduce)
    def reduce_weighted_values(values, sample_weight=None, mask=None,
                               reduction="sum_over_batch_size", dtype=None):
        context = _normalizing_context()
        if context is None or reduction not in _MEAN_REDUCTIONS:
            return keras_reduce(values, sample_weight, mask, reduction, dtype)
        values = tf.convert_to_tensor(values, dtype=dtype)
        if values.shape.rank == 0:  # Keras leaves a scalar loss as it is.
            return keras_reduce(values, sample_weight, mask, reduction, dtype)
        # Keras' own "sum" path weights by mask x sample weight without rescaling.
        weights = internals.symbol("keras.src.losses.loss.apply_mask")(
            None if sample_weight is None else tf.cast(sample_weight, values.dtype),
            None if mask is None else tf.cast(mask, values.dtype),
            dtype=values.dtype, reduction="sum")
        squeeze = internals.symbol("keras.src.losses.loss.squeeze_or_expand_to_same_rank")
        if weights is not None:  # Already in values' dtype (apply_mask casts to it).
            values, weights = squeeze(values, weights)
            values = values * weights
        total = tf.reduce_sum(values)
        if reduction == "mean_with_sample_weight" and weights is not None:
            count, dynamic = tf.reduce_sum(weights), True
        elif mask is not None:
            mask = tf.cast(mask, values.dtype)
            count = tf.reduce_sum(mask) * tf.cast(tf.size(values), values.dtype) / tf.cast(
                tf.size(mask), values.dtype)
            dynamic = True
        else:
            count, dynamic = tf.cast(tf.size(values), values.dtype), False
        count = context.global_count(count, dynamic)
        return tf.math.divide_no_nan(total, tf.cast(count, total.dtype))

    return reduce_weighted_values


def _own_losses(layer):
    """This replica's call losses of `layer` (a list kept on the layer, per replica)."""
    store = layer.__dict__.setdefault("_tfpar_replica_losses", {})
    return store.setdefault(replica_id(), [])


def _per_replica():
    return replica_context() is not None and not internals.symbol(
        "keras.src.backend.common.stateless_scope.in_stateless_scope")()


def _add_loss_per_replica(keras_add_loss):
    @functools.wraps(keras_add_loss)
    def add_loss(self, loss):
        if not _per_replica():
            return keras_add_loss(self, loss)
        shared = internals.attr(self, "_losses")
        before = len(shared)
        keras_add_loss(self, loss)  # Validates, and appends to the shared list;
        added = shared[before:]  # replicas are traced in turns, so these are ours.
        del shared[before:]
        _own_losses(self).extend(added)
    return add_loss


def _own_losses_per_replica(keras_get_own_losses):
    @functools.wraps(keras_get_own_losses)
    def get_own_losses(self):
        if not _per_replica():
            return keras_get_own_losses(self)
        return list(_own_losses(self))
    return get_own_losses


def _clear_losses_per_replica(keras_clear_losses):
    @functools.wraps(keras_clear_losses)
    def clear_losses(self):
        keras_clear_losses(self)
        if _per_replica():
            _own_losses(self).clear()
    return clear_losses


def _summed_over_replicas(keras_unscale):
    """The reported loss: the sum of the replicas' shares, which is the global loss."""

    @functools.wraps(keras_unscale)
    def unscale_loss_for_distribution(value):
        context = _normalizing_context()
        if context is None:
            return keras_unscale(value)
        return context.reported(value)

    return unscale_loss_for_distribution


def _part_of_additional_losses(keras_scale):
    """`scale_loss_for_distribution` of losses added in call, for a batch part."""

    @functools.wraps(keras_scale)
    def scale_loss_for_distribution(value):
        part = _normalizing_context()
        if not isinstance(part, _BatchPart):
            return keras_scale(value)
        return part.additional(value)

    return scale_loss_for_distribution


def _mean_aggregated_statistics(build):
    """BatchNormalization.build: non-trainable weights aggregate by MEAN across replicas."""

    @functools.wraps(build)
    def wrapper(self, *args, **kwargs):
        if not hooks_of(tf.distribute.get_strategy())._tfpar_exact_replicas:
            return build(self, *args, **kwargs)
        add_weight = self.add_weight

        def add_mean_weight(*a, **kw):
            if not kw.get("trainable", True) and kw.get("aggregation", "none") == "none":
                kw["aggregation"] = "mean"
            return add_weight(*a, **kw)

        object.__setattr__(self, "add_weight", add_mean_weight)
        try:
            return build(self, *args, **kwargs)
        finally:
            object.__delattr__(self, "add_weight")

    return wrapper


def _own_tensors(grads, where_made=False):
    """Each replica's gradients as tensors of its own.

    TensorFlow regroups one tensor object that every replica passes (one made outside
    `strategy.run` and captured) into a single value, and its all-reduce then returns it
    unsummed: Keras' sum over replicas would count it once. Keras' own accumulation
    escapes this by accumulating per replica first (tested in Keras'
    `optimizer_distribute_test.py::test_gradient_accumulation`).

    `where_made` (a replica spanning devices: pipelines): each copy is made where its
    gradient is. Under the replica's device scope a pipeline's later stages' gradients went
    to the replica's device (measured across 4 worker processes, R=2 x K=2: every gradient
    went to the chief and back, 2x the bytes).
    """
    if not where_made:
        return [g if g is None else tf.identity(g) for g in grads]
    copies = []
    for g in grads:
        if g is None:
            copies.append(None)
            continue
        made = g.values if isinstance(g, tf.IndexedSlices) else g
        with tf.device(made.device):
            copies.append(tf.identity(g))
    return copies


def _accumulation_outside_cond(keras_apply):
    """TFOptimizer._backend_apply_gradients under replicas: gradient accumulation outside
    the `cond`, clipping of the global gradient (`gradient_clipping`), and under ZeRO or
    replicas spanning devices each replica's gradients its own tensors (`_own_tensors`).

    A gradient tensor made outside `strategy.run`, which every replica passes, is counted
    once in a plain step, as Keras defines it under a mirrored strategy (its
    `optimizer_distribute_test.py::test_ema`: one device's step), and summed over the
    replicas by accumulation (`test_gradient_accumulation`: Keras accumulates per replica)
    and under ZeRO (each owner's sum)."""

    @functools.wraps(keras_apply)
    def apply(self, grads, trainable_variables):
        context = replica_context("_tfpar_mirrored", min_replicas=1)
        if local_steps.every(context):
            return local_steps.apply_alone(self, keras_apply, context, grads,
                                           trainable_variables)
        hooks = hooks_of(context.strategy if context is not None else None)
        if context is not None and context.num_replicas_in_sync > 1 and (
                hooks._tfpar_shard_stage or hooks._tfpar_replica_spans_devices):
            grads = _own_tensors(grads, hooks._tfpar_replica_spans_devices)
        steps = self.gradient_accumulation_steps
        if not steps and gradient_clipping.needs_global_clipping(
                self, context, trainable_variables):
            return gradient_clipping.apply_clipped_once(self, keras_apply, context, grads,
                                                        trainable_variables)
        if context is None or not steps:
            return keras_apply(self, grads, trainable_variables)
        _accumulate(self, context, grads, trainable_variables)
        _moving_averages(self)

    return apply


def _moving_averages(optimizer):
    """The end of Keras' `_backend_apply_gradients` (`use_ema`), after an accumulation step
    that tfpar ran in its place: the averages follow the weights every step, and overwrite
    them every `ema_overwrite_frequency` steps."""
    if not optimizer.use_ema:
        return
    variables = internals.attr(optimizer, "_trainable_variables")
    internals.attr(optimizer, "_update_model_variables_moving_average")(variables)
    if optimizer.ema_overwrite_frequency:
        overwrite = internals.attr(optimizer, "_overwrite_model_variables_with_average_value")

        def overwritten():
            overwrite(variables)
            return tf.constant(True)

        tf.cond((tf.convert_to_tensor(optimizer.iterations) + 1)
                % optimizer.ema_overwrite_frequency == 0,
                overwritten, lambda: tf.constant(False))


def _accumulate(self, context, grads, trainable_variables):
    """Gradient accumulation in replica `context`, outside Keras' `cond` (see
    `_accumulation_outside_cond`)."""
    steps = self.gradient_accumulation_steps
    index = internals.attr(self, "_get_variable_index")
    accumulators = [internals.attr(self, "_accumulated_gradients")[index(v)]
                    for v in trainable_variables]
    if hooks_of(context.strategy)._tfpar_shard_stage:
        # Sharded state: each owner accumulates its own reduced gradients.
        return zero_optimizers.accumulate_sharded(self, context.strategy, grads,
                                                  trainable_variables, accumulators)
    # Each replica accumulates its own gradients (as Keras does: its accumulators hold
    # a replica's, not the sum); the sum over replicas of accumulator plus gradient is
    # taken every step, before the cond, where TensorFlow allows it.
    sums = [g + tf.convert_to_tensor(a) for g, a in zip(grads, accumulators)]
    totals = context.all_reduce(tf.distribute.ReduceOp.SUM, sums)
    # Identical on every replica, so clipping here is clipping once.
    updates = gradient_clipping.clip(
        self, [t / steps for t in totals],
        gradient_clipping.clip_groups(context.strategy, trainable_variables))
    variables = [v.value for v in trainable_variables]

    def in_cross_replica_context(strategy, sums, updates):
        extended = strategy.extended
        iterations = internals.attr(self, "_iterations")
        is_update_step = (tf.convert_to_tensor(iterations) + 1) % steps == 0

        def assign(variable, value):
            extended.update(variable, lambda v, t: v.assign(t), args=(value,), group=False)

        def update():
            _apply_weight_decay(self, strategy, variables)
            internals.attr(self, "_distributed_tf_update_step")(
                strategy, list(zip(updates, variables)), self.learning_rate)
            for accumulator in accumulators:
                assign(accumulator.value, tf.zeros(accumulator.shape, accumulator.dtype))
            return tf.constant(True)

        def accumulate():
            for accumulator, value in zip(accumulators, sums):
                assign(accumulator.value, value)
            return tf.constant(False)

        return tf.cond(is_update_step, update, accumulate)

    context.merge_call(in_cross_replica_context, args=(sums, updates))


def _ema_overwritten_per_replica(keras_overwrite):
    """TFOptimizer._overwrite_model_variables_with_average_value under a tfpar mirrored
    strategy, in replica context: Keras calls it inside a `cond`
    (`ema_overwrite_frequency`), where its `extended.update` (a merge call) fails ("merge_call
    called while defining a new graph", stock MirroredStrategy too). The averages are the
    same on every replica, so each replica writes its own copies. (Under shard=..., the
    owners already did in their step; under parameter servers each variable has one copy,
    written directly.)"""

    @functools.wraps(keras_overwrite)
    def overwrite(self, trainable_variables):
        if zero_optimizers.done_by_owners(self):
            return None
        averages = internals.attr(self, "_model_variables_moving_average")
        if tf.distribute.has_strategy() and ps_state.uses_parameter_servers(
                tf.distribute.get_strategy()):
            # One copy of each variable, on the parameter servers (sharded ones too): a
            # worker's step writes it, as it writes the update.
            for variable, average in zip(trainable_variables, averages):
                variable.assign(average)
            return None
        context = replica_context("_tfpar_mirrored", min_replicas=1)
        if context is None:
            return keras_overwrite(self, trainable_variables)
        strategy, me = context.strategy, replica_id()
        for variable, average in zip(trainable_variables, averages):
            local = [strategy.experimental_local_results(models.tf_variable(v))[me]
                     for v in (variable, average)]
            local[0].assign(local[1])
        return None

    return overwrite


def _reduced_where_they_are(keras_all_reduce):
    """TFOptimizer._all_reduce_sum_gradients: in the wire type of a strategy's
    `compression` (`tfpar.keras.compression`); under a strategy whose replica spans devices
    (`_tfpar_replica_spans_devices`: pipelines, model parallelism). `ReplicaContext.all_reduce`
    wraps its merge_call in `tf.custom_gradient`, whose IdentityN over every gradient runs
    on the replica's device: every other device's gradients were copied there. Measured:
    stage 0 of a 2-process pipeline of 24 2048 x 2048 layers also held stage 1's
    gradients, 192 MiB above its plan. Nothing differentiates this sum, so it is the
    merge_call alone; each gradient is reduced to where it is."""

    @functools.wraps(keras_all_reduce)
    def all_reduce_sum(self, grads_and_vars):
        if gradient_clipping.already_summed():
            return list(grads_and_vars)  # Summed (and clipped) before Keras' update.
        compressed = replica_context("_tfpar_compression")
        if compressed is not None and tf.inside_function():
            return compression.all_reduce_sum(
                compressed, hooks_of(compressed.strategy)._tfpar_compression,
                grads_and_vars, keras_all_reduce, self)
        context = replica_context("_tfpar_replica_spans_devices", min_replicas=1)
        if context is None or not tf.inside_function():
            return keras_all_reduce(self, grads_and_vars)
        grads_and_vars = list(grads_and_vars)
        present = [i for i, (g, _) in enumerate(grads_and_vars) if g is not None]
        if not present:
            return keras_all_reduce(self, grads_and_vars)
        if context.num_replicas_in_sync == 1:
            return grads_and_vars  # A sum over one replica.

        def reduce(strategy, *grads):
            return strategy.extended.batch_reduce_to(
                tf.distribute.ReduceOp.SUM,
                [(g, g if isinstance(g, tf.distribute.DistributedValues) else g.device)
                 for g in grads])

        reduced = context.merge_call(
            reduce, args=tuple(grads_and_vars[i][0] for i in present))
        for i, grad in zip(present, reduced):
            grads_and_vars[i] = (grad, grads_and_vars[i][1])
        return grads_and_vars

    return all_reduce_sum


def _updates_in_turn(keras_update_step):
    """TFOptimizer._distributed_tf_update_step under a strategy that asks for it
    (`_tfpar_updates_in_turn`: data parallelism across workers, pipelines, model
    parallelism): each
    variable's update waits for the previous one's (`steps.one_after_another`). A pipeline
    stage of 12 2048 x 2048 layers with SGD momentum peaked 384 MiB above its state, every
    update's temporaries at once."""

    @functools.wraps(keras_update_step)
    def update_step(self, distribution, grads_and_vars, learning_rate):
        if not (hooks_of(distribution)._tfpar_updates_in_turn
                and tf.inside_function()):
            return keras_update_step(self, distribution, grads_and_vars, learning_rate)

        def apply(variable, grad, learning_rate):
            self.update_step(grad, variable, learning_rate)
            return variable.read_value()  # Ordered after the update (the same resource).

        def update(pair):
            grad, variable = pair
            return distribution.experimental_local_results(distribution.extended.update(
                variable, apply, args=(grad, learning_rate), group=False))

        steps.one_after_another(grads_and_vars, update)

    return update_step


def _batch_specs(epoch_iterator):
    """The (TensorSpec) structure of a batch of `epoch_iterator`'s dataset, or None.

    Keras' symbolic build needs shapes only. Taking them from the dataset's element_spec
    makes no distributed iterator just to read one batch and drop it: each costs up to a
    second on 4 replicas, and TensorFlow 2.21 has crashed (a segmentation fault) destroying
    such an iterator right after its first batch (Keras' `epoch_iterator.reset`).
    """
    adapter = getattr(epoch_iterator, "data_adapter", None)
    try:
        specs = adapter.get_tf_dataset().element_spec
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return None
    if not all(isinstance(s, tf.TensorSpec) for s in tf.nest.flatten(specs)):
        return None  # Sparse or ragged inputs: read a batch, as Keras does.
    return specs


def _build_optimizer_for_its_variables(model):
    """Builds a built model's optimizer for the variables its strategy trains in place of
    the model's own (`_tfpar_optimizer_variables`: a tensor-parallel pipeline's shards),
    before Keras' symbolic build would build it for the model's own."""
    strategy = internals.attr(model, "_distribute_strategy")
    substitute = hooks_of(strategy)._tfpar_optimizer_variables
    optimizer = getattr(model, "optimizer", None)
    if substitute is None or optimizer is None or optimizer.built or not model.built:
        return
    variables = list(model.trainable_variables)
    trained = substitute(variables)
    if [id(v) for v in trained] != [id(v) for v in variables]:
        with strategy.scope():
            optimizer.build(trained)


def _build_from_one_replica(keras_build):
    """TensorFlowTrainer._maybe_symbolic_build: shapes from replica 0's part of the batch.

    Keras averages the first batch over replicas just to learn its shapes, which fails
    when the replicas' parts differ in size (a batch that does not divide by N).
    """

    @functools.wraps(keras_build)
    def build(self, iterator=None, data_batch=None):
        try:
            _build_optimizer_for_its_variables(self)
            return build_from_one_replica(self, iterator, data_batch)
        except RuntimeError as error:
            # Keras before 3.15 wraps any error of its symbolic build in a RuntimeError
            # ("Unable to automatically build the model"): tfpar's refusals (a PlacementError
            # for a subclassed model in a pipeline, ...) surface as themselves, as on 3.15.
            wrapped = error.__cause__ or error.__context__  # (3.10 raises inside except.)
            if type(wrapped).__module__ == tfpar_errors.__name__:
                raise wrapped from error
            raise

    def build_from_one_replica(self, iterator, data_batch):
        strategy = internals.attr(self, "_distribute_strategy")
        if iterator is None or not hooks_of(strategy)._tfpar_mirrored:
            return keras_build(self, iterator=iterator, data_batch=data_batch)
        specs = _batch_specs(iterator)
        if specs is not None:
            return keras_build(self, iterator=None, data_batch=specs)
        for _, _, it in iterator:
            batch = next(it)
            data_batch = tf.nest.map_structure(
                lambda x: strategy.experimental_local_results(x)[0]
                if isinstance(x, tf.distribute.DistributedValues) else x, batch)
            break
        return keras_build(self, iterator=None, data_batch=data_batch)

    return build


def _refused_before_the_first_step(keras_make_function):
    """TensorFlowTrainer._make_function: what a strategy cannot run, it says before any step.

    - `jit_compile=True`: Keras compiles the whole distributed step (every replica or
      stage, and the all-reduce) as one XLA program, which XLA cannot place on several
      devices: the run failed with "Trying to access resource ... located in device
      CPU:1". A tfpar strategy that spans devices refuses it (`_tfpar_xla_refusal`).
    - A step the strategy cannot build as asked (`_tfpar_step_refusal`; the pipeline's
      for a model that overrides `train_step`).
    """

    @functools.wraps(keras_make_function)
    def make_function(self, step_function):
        strategy = internals.attr(self, "_distribute_strategy")
        refusal = hooks_of(strategy)._tfpar_xla_refusal
        message = refusal(self) if refusal is not None and self.jit_compile else None
        if message and not self.run_eagerly:
            raise ValueError(message)
        refusal = hooks_of(strategy)._tfpar_step_refusal
        message = refusal(self, step_function) if refusal is not None else None
        if message:
            raise ValueError(message)
        if getattr(step_function, "__name__", "") == "train_step" and self.optimizer:
            message = optimizer_refusal(strategy, self, self.optimizer)
            if message:
                raise ValueError(message)
        if _compiles_per_replica(self):
            with xla_calls.building_plain_step(self):
                return keras_make_function(self, step_function)
        return keras_make_function(self, step_function)

    return make_function


def _compiles_per_replica(model):
    """Whether `jit_compile=True` compiles each replica's model call (not Keras' whole step)
    under the model's strategy (`tfpar.keras.xla_calls`; the model-call hook that runs the
    compiled calls is installed with these patches, `hooks.install_exact_replicas`)."""
    strategy = internals.attr(model, "_distribute_strategy")
    return bool(model.jit_compile and not model.run_eagerly
                and hooks_of(strategy)._tfpar_xla_unit)


def _predict_compiled_per_replica(keras_make_predict_function):
    """TensorFlowTrainer.make_predict_function: with jit_compile=True Keras compiles each
    replica's whole predict step, whose reads of a variable held on another device (ZeRO-3)
    XLA cannot make; under a strategy that compiles per replica, the model's call is compiled
    as in fit and evaluate (its variables read outside XLA)."""

    @functools.wraps(keras_make_predict_function)
    def make_predict_function(self, force=False):
        if _compiles_per_replica(self):
            with xla_calls.building_plain_step(self):
                return keras_make_predict_function(self, force=force)
        return keras_make_predict_function(self, force=force)

    return make_predict_function


# Optimizers whose update looks at a whole variable (LAMB's trust ratio, Muon's
# orthogonalized matrix, Adafactor's row and column moments): a tensor-parallel shard is not
# one.
_WHOLE_VARIABLE_OPTIMIZERS = ("Lamb", "Muon", "Adafactor")
# First Keras release whose Muon finds a variable's state by its index: before, its update
# read `variable.path`, which the copy a tf.distribute strategy updates (a TensorFlow
# variable) lacks: "AttributeError: 'ResourceVariable' object has no attribute 'path'" at the
# first step under any strategy, stock MirroredStrategy too (measured on Keras 3.10; read in
# the 3.11-3.14 sources).
MUON_BY_INDEX_SINCE = "3.13.0"


def optimizer_refusal(strategy, model, optimizer):
    """Why `strategy` cannot train `model` with `optimizer` as one device would, or None."""
    import keras

    inner = getattr(optimizer, "inner_optimizer", optimizer)  # (A LossScaleOptimizer's.)
    name = type(inner).__name__
    if getattr(strategy, "tensor_parallel", 1) > 1:
        if any(isinstance(inner, getattr(keras.optimizers, n, ())) for n in
               _WHOLE_VARIABLE_OPTIMIZERS):
            return (f"{type(strategy).__name__} with tensor parallelism cannot train "
                    f"{model.name!r} with {name}: its update looks at a whole variable, and "
                    f"each device holds a shard of the split ones. Use Adam, AdamW, SGD, "
                    f"Lion, ... (an update per element), or tensor_parallel=1.")
        if isinstance(inner, getattr(keras.optimizers, "MultiOptimizer", ())):
            return (f"{type(strategy).__name__} with tensor parallelism cannot train "
                    f"{model.name!r} with MultiOptimizer yet: it maps the model's variables "
                    f"to optimizers, and tensor parallelism trains the split ones' shards. "
                    f"Use one optimizer, or tensor_parallel=1.")
        if inner.use_ema:
            return (f"{type(strategy).__name__} with tensor parallelism cannot keep "
                    f"{name}(use_ema=True)'s averages of split variables yet. Drop use_ema "
                    f"(or average with a callback), or use tensor_parallel=1.")
    if isinstance(inner, getattr(keras.optimizers, "Muon", ())) and (
            internals.installed("keras") < internals.release(MUON_BY_INDEX_SINCE)):
        return (f"{type(strategy).__name__} cannot train {model.name!r} with Muon on Keras "
                f"{keras.__version__}: its update reads variable.path, which the copy a "
                f"tf.distribute strategy updates lacks (AttributeError at the first step "
                f"under any strategy, stock too). Keras >= {MUON_BY_INDEX_SINCE} fixes it: "
                f"upgrade Keras, or use AdamW.")
    return None


def xla_refusal(model, strategy_name, what_runs, num_devices):
    """Why `jit_compile=True` cannot train `model` on `num_devices` devices, or None."""
    if num_devices < 2:
        return None
    return (f"{strategy_name} cannot train {model.name!r} with jit_compile=True: "
            f"{what_runs} on {num_devices} devices, and XLA compiles Keras' whole step "
            f"(computation and communication) into one program for one device. Compile "
            f"with jit_compile=False (Keras' default under tf.distribute strategies).")


def _apply_weight_decay(optimizer, strategy, variables):
    if optimizer.weight_decay is None:
        return
    use = internals.attr(optimizer, "_use_weight_decay")
    for variable in variables:
        if use(variable):
            def decay(v):
                lr = tf.cast(optimizer.learning_rate, v.dtype)
                return v.assign_sub(v * tf.cast(optimizer.weight_decay, v.dtype) * lr)
            strategy.extended.update(variable, decay, group=False)


def patches():
    """What tfpar replaces in Keras for exact replicas: (owner, attribute, wrap)."""
    import keras

    loss_module = internals.symbol("keras.src.losses.loss")
    optimizer = internals.symbol("keras.src.backend.tensorflow.optimizer.TFOptimizer")
    trainer = internals.symbol("keras.src.backend.tensorflow.trainer.TensorFlowTrainer")
    before_activity_means = [
        (keras.layers.Layer, "__call__", _activity_sums_marked),
        (trainer, "_aggregate_additional_loss", _batch_sums_unscaled),
    ] if activity_losses_are_sums() else []
    return before_activity_means + [
        (trainer, "_maybe_symbolic_build", _build_from_one_replica),
        (trainer, "_make_function", _refused_before_the_first_step),
        (trainer, "make_predict_function", _predict_compiled_per_replica),
        (loss_module, "reduce_weighted_values", _global_mean),
        (loss_module, "unscale_loss_for_distribution", _summed_over_replicas),
        (loss_module, "scale_loss_for_distribution", _part_of_additional_losses),
        (keras.layers.BatchNormalization, "build", _mean_aggregated_statistics),
        (keras.layers.Layer, "add_loss", _add_loss_per_replica),
        (keras.layers.Layer, "_get_own_losses", _own_losses_per_replica),
        (keras.layers.Layer, "_clear_losses", _clear_losses_per_replica),
        (optimizer, "_backend_apply_gradients", _accumulation_outside_cond),
        (optimizer, "_distributed_tf_update_step", _updates_in_turn),
        (optimizer, "_all_reduce_sum_gradients", _reduced_where_they_are),
        (optimizer, "_overwrite_model_variables_with_average_value",
         _ema_overwritten_per_replica),
    ] + (gradient_clipping.patches() + look_ahead.patches() + local_steps.patches()
         + context_layers.patches())
