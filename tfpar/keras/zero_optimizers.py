"""Keras optimizers under `DataParallelStrategy(shard=...)` (ZeRO): the Keras side.

Keras builds an optimizer's state with `add_variable_from_reference`, which the
strategy places on the variable's owner (`tfpar.distribute.zero.zero_owners`), and applies
gradients through `TFOptimizer._backend_update_step`, which tfpar replaces under a
sharding strategy by the sharded step. What ZeRO cannot shard is refused when the
optimizer is built, before any step runs.
"""

import contextlib
import functools
import threading

import tensorflow as tf

from tfpar.contract import hooks_of
from tfpar.keras import gradient_clipping
from tfpar.keras import internals
from tfpar.keras import owner_saving


class OwnerStep:
    """An owner's step on the variables it owns, as Keras' step would be on one device:
    the gradient clipped as a whole (`clip`: Keras' clipping, the global norm summed over
    every owner's share by `sum_over_owners`), the variable decayed (AdamW's
    `weight_decay`, which Keras applies to every replica's copy through the strategy: under
    stage 3 the owner's variable has one copy, which TensorFlow's mirrored update refuses),
    then updated, then its moving average (`use_ema`, optimizer state kept on the owner)
    updated, and the variable overwritten by it every `ema_overwrite_frequency` steps.
    What the sharded update (`tfpar.distribute.zero.zero_update`) calls."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.clips = gradient_clipping.clips(optimizer)

    def clip(self, grads, sum_over_owners):
        return gradient_clipping.clip(self.optimizer, grads, sum_over_holders=sum_over_owners)

    def update_step(self, grad, variable, learning_rate):
        decay(self.optimizer, variable)
        self.optimizer.update_step(grad, variable, learning_rate)

    def after_step(self, variable):
        """Keras' `_update_model_variables_moving_average` and
        `_overwrite_model_variables_with_average_value` of one owned variable."""
        optimizer = self.optimizer
        if not optimizer.use_ema:
            return
        average = _average_of(optimizer, variable)
        iterations = tf.convert_to_tensor(optimizer.iterations)
        momentum = tf.cast(tf.not_equal(iterations, 0), variable.dtype) * tf.cast(
            optimizer.ema_momentum, variable.dtype)
        optimizer.assign(average, momentum * average + (1 - momentum) * variable)
        if optimizer.ema_overwrite_frequency:
            # Local operations only: a cond may hold them.
            tf.cond((iterations + 1) % optimizer.ema_overwrite_frequency == 0,
                    lambda: variable.assign(tf.convert_to_tensor(average)).op,
                    tf.no_op)


def _average_of(optimizer, variable):
    averages = internals.attr(optimizer, "_model_variables_moving_average")
    return averages[internals.attr(optimizer, "_get_variable_index")(variable)]


def done_by_owners(optimizer):
    """True when, under a sharding strategy in replica context, the owners do in their step
    (`OwnerStep`) what Keras would do here to every variable: weight decay, the moving
    averages and their overwrite of the weights."""
    stage, _ = _shard_stage(optimizer)
    return bool(stage) and not tf.distribute.in_cross_replica_context()


def _finalized_by_owners(keras_finalize):
    """BaseOptimizer.finalize_variable_values (the end of `fit`) under a sharding strategy
    with `use_ema`: every weight takes its average, which lives on the weight's owner.
    A stage-3 weight is its owner's, next to its average; a mirrored weight (stages 1-2)
    takes the owner's average on every copy, fetched from a worker that owns it (every
    worker runs `fit`'s end, so the fetch is a collective they all join)."""

    @functools.wraps(keras_finalize)
    def finalize(self, var_list):
        stage, strategy = _shard_stage(self)
        if not stage or not self.use_ema:
            return keras_finalize(self, var_list)
        averages = internals.attr(self, "_model_variables_moving_average")
        mirrored = [isinstance(internals.attr(v, "_value"), tf.distribute.DistributedValues)
                    for v in var_list]
        across_workers = _remote_state(self) is not None
        fetched = iter(strategy._tfpar_full_optimizer_state(
            [a for a, m in zip(averages, mirrored) if m]) if across_workers else ())
        remote = strategy._tfpar_shard_owners.remote
        for variable, average, is_mirrored in zip(var_list, averages, mirrored):
            target = internals.attr(variable, "_value")
            if is_mirrored:
                value = next(fetched) if across_workers else tf.convert_to_tensor(average)
                for copy in strategy.experimental_local_results(target):
                    with tf.device(copy.device):
                        copy.assign(tf.identity(value))
            elif id(target) not in remote:
                target.assign(tf.convert_to_tensor(average))
        return None

    return finalize


def decay(optimizer, variable):
    """Keras' weight decay of `variable` (TFOptimizer._apply_weight_decay), here: under ZeRO
    on its owner, under parameter servers on a sharded variable's shards."""
    if optimizer.weight_decay is None or not internals.attr(
            optimizer, "_use_weight_decay")(variable):
        return
    learning_rate = tf.cast(optimizer.learning_rate, variable.dtype)
    decay = tf.cast(optimizer.weight_decay, variable.dtype)
    variable.assign_sub(variable * decay * learning_rate)


def _left_to_owners(keras_method):
    """A Keras optimizer method of every variable (`TFOptimizer._apply_weight_decay`,
    `BaseOptimizer._update_model_variables_moving_average`) that does nothing where the
    owners do it for what they own (`done_by_owners`)."""

    @functools.wraps(keras_method)
    def method(self, variables):
        if done_by_owners(self):
            return None
        return keras_method(self, variables)

    return method


def _shard_stage(optimizer):
    strategy = internals.attr(optimizer, "_distribution_strategy")
    return hooks_of(strategy)._tfpar_shard_stage, strategy


def _name(strategy):
    """The strategy's class as a user names it (DataParallelStrategy across workers too)."""
    return type(strategy).__name__.replace("MultiWorker", "")


def _refusal(optimizer, strategy):
    shard = strategy.shard
    what = None
    if type(optimizer).__name__ == "Muon":
        # Measured: ZeRO-3 on 2 replicas 0.03 off one device's weights after one epoch.
        return (f"{_name(strategy)}(shard={shard!r}) cannot shard Muon yet: its update "
                f"under ZeRO differs from one device's. Use AdamW, Lion, ... with shard, "
                f"or Muon with shard=None.")
    elif optimizer.gradient_accumulation_steps and optimizer.global_clipnorm:
        what = "gradient_accumulation_steps with global_clipnorm"
    if what is None:
        return None
    return (f"{_name(strategy)}(shard={shard!r}) cannot shard {type(optimizer).__name__} "
            f"with {what}: that state is not sharded yet. Drop {what}, or train with "
            f"shard=None.")


def accumulate_sharded(optimizer, strategy, grads, trainable_variables, accumulators):
    """Gradient accumulation under shard=..., in replica context: every step reduces the
    gradients to their owners (as a step without accumulation does), each owner adds its
    own to its accumulators (optimizer state, kept on the owner), and every
    `gradient_accumulation_steps`-th step applies their mean."""
    steps = optimizer.gradient_accumulation_steps
    iterations = internals.attr(optimizer, "_iterations")
    accumulation = strategy._tfpar_accumulation(
        [internals.attr(a, "_value") for a in accumulators], steps,
        (tf.convert_to_tensor(iterations) + 1) % steps == 0,
        internals.attr(optimizer, "_clip_gradients"))
    variables = [internals.attr(v, "_value") for v in trainable_variables]
    _check_state_follows_variables(optimizer, strategy)
    return strategy._tfpar_sharded_update(OwnerStep(optimizer), list(grads), variables,
                                          optimizer.learning_rate, accumulation)


def _built_for_shards(keras_build):
    """BaseOptimizer.build: refuses what cannot be sharded, before any state is made."""

    @functools.wraps(keras_build)
    def build(self, variables):
        stage, strategy = _shard_stage(self)
        if stage and not self.built:
            message = _refusal(self, strategy)
            if message:
                raise ValueError(message)
        return keras_build(self, variables)

    return build


def _check_state_follows_variables(optimizer, strategy):
    """Refuses an optimizer with state that is neither a scalar nor made next to its
    variable: mirrored on every replica, it would be updated on its owner only. (Asked
    when the first step is traced: subclasses make their state after BaseOptimizer.build.)"""
    # Scalars (step counters, the learning rate, a loss scale) are one value that every
    # replica updates alike.
    mirrored = [v.path for v in optimizer.variables if len(v.shape)
                and isinstance(internals.attr(v, "_value"), tf.distribute.DistributedValues)]
    # A trainable variable an optimizer makes itself (not through add_variable), such as
    # Nadam's `_u_product`, looks like a model weight to stage 3, which places it on one
    # owner: every replica would then update that one copy (measured: Nadam 0.006 off).
    owners = strategy._tfpar_shard_owners
    placed = [v.path for v in optimizer.variables
              if owners.known(internals.attr(v, "_value"))
              and id(internals.attr(v, "_value")) not in owners.slots]
    if placed:
        raise ValueError(
            f"{_name(strategy)}(shard={strategy.shard!r}) cannot shard "
            f"{type(optimizer).__name__}: it makes state as a trainable variable "
            f"({', '.join(placed[:3])}), which shard='parameters' places on one owner like a "
            f"model weight. Use shard='gradients' (weights mirrored), or another optimizer.")
    if mirrored:
        raise ValueError(
            f"{_name(strategy)}(shard={strategy.shard!r}) cannot shard "
            f"{type(optimizer).__name__}: it keeps state that is not one copy per variable "
            f"({', '.join(mirrored[:3])}). Use an optimizer whose state follows its "
            f"variables (SGD, Adam, AdamW, RMSprop, Adagrad, Adamax, Nadam, Lion, ...), "
            f"or shard=None.")


def _check_clipping(optimizer, strategy, trainable_variables):
    """Refuses `clipnorm` over a split variable's shards owned apart (tensor parallelism
    with ZeRO): each owner would clip its shard by the shard's own norm."""
    if optimizer.clipnorm and gradient_clipping.clip_groups(strategy, trainable_variables):
        raise ValueError(
            f"{_name(strategy)}(shard={strategy.shard!r}) with tensor parallelism cannot "
            f"apply {type(optimizer).__name__}(clipnorm={optimizer.clipnorm}) yet: a split "
            f"variable's shards have owners of their own, and clipnorm needs the whole "
            f"variable's norm. Use global_clipnorm (the norm over every owner's share), or "
            f"drop shard.")


def _sharded_update_step(keras_update_step):
    """TFOptimizer._backend_update_step under a sharding strategy, in replica context."""

    @functools.wraps(keras_update_step)
    def update_step(self, grads, trainable_variables, learning_rate):
        stage, strategy = _shard_stage(self)
        if not stage or tf.distribute.in_cross_replica_context():
            return keras_update_step(self, grads, trainable_variables, learning_rate)
        _check_state_follows_variables(self, strategy)
        _check_clipping(self, strategy, trainable_variables)
        variables = [internals.attr(v, "_value") if hasattr(v, "_value") else v
                     for v in trainable_variables]
        return strategy._tfpar_sharded_update(OwnerStep(self), list(grads), variables,
                                              learning_rate)

    return update_step


def _remote_state(optimizer):
    """The strategy when some of the optimizer's state lives on other workers, else None."""
    stage, strategy = _shard_stage(optimizer)
    return strategy if stage and strategy._tfpar_shard_owners.remote else None


def _saved_whole(keras_save):
    """BaseOptimizer.save_own_variables: state owned on other workers is fetched from its
    owners one variable at a time, each written before the next is fetched, so a
    checkpoint holds what one device would and saving holds one variable more. Every
    worker saves together
    (tfpar's callbacks see to it; a program's own save must run on every worker)."""

    @functools.wraps(keras_save)
    def save_own_variables(self, store):
        if owner_saving.is_owners_store(store):  # Each worker writes the state it owns.
            for i, variable in enumerate(self.variables):
                store[str(i)] = variable
            return
        strategy = _remote_state(self)
        if strategy is None:
            return keras_save(self, store)
        for i, value in enumerate(strategy._tfpar_full_optimizer_state(self.variables)):
            store[str(i)] = value

    return save_own_variables


def _loaded_where_owned(keras_load):
    """BaseOptimizer.load_own_variables: each worker keeps the state it owns."""

    @functools.wraps(keras_load)
    def load_own_variables(self, store):
        strategy = _remote_state(self)
        if strategy is None or len(store.keys()) != len(self.variables):
            return keras_load(self, store)  # (Keras warns about a count that differs.)
        remote = strategy._tfpar_shard_owners.remote
        for i, variable in enumerate(self.variables):
            if id(internals.attr(variable, "_value")) not in remote:
                variable.assign(store[str(i)])

    return load_own_variables


# Layers whose call reads its weights and computes, nothing else: recomputing one gives
# the same values and gradients (measured in the conformance table). Others (masks consumed,
# recurrent cells in loops, BatchNorm's statistics, random draws) keep their reads.
_RECOMPUTABLE = ("Dense", "EinsumDense", "Conv1D", "Conv2D", "Conv3D")


def regather_in_backward(model):
    """Under shard="parameters" with reshard_after_forward (FSDP's default): each
    recomputable layer (`_RECOMPUTABLE`, computing in its variables' dtype, called without
    a mask) is recomputed for its backward pass, as under `keras.RematScope(mode="full")`.
    Its weights are then read from their owners again there, and no read of the forward
    pass is held until the backward pass: one layer's gathered weights at a time instead
    of every layer's. Layers a user already put under a RematScope keep it. Returns the
    number of layers changed (0 the second time)."""
    import keras

    changed = 0
    for layer in internals.attr(model, "_flatten_layers")(include_self=False):
        policy = layer.dtype_policy
        if (type(layer).__name__ in _RECOMPUTABLE
                and isinstance(layer, getattr(keras.layers, type(layer).__name__))
                and policy.compute_dtype == policy.variable_dtype
                and not layer.non_trainable_weights
                and getattr(internals.attr(layer, "_remat_mode"), "mode", None) is None):
            internals.set_attr(layer, "_remat_mode", keras.RematScope(mode="full"))
            layer._tfpar_regathered = True
            changed += 1
    return changed


def _differentiable(value):
    return tf.is_tensor(value) and value.dtype.is_floating


# What runs inside a rematerialized call: True for the layer's own function, False for
# what tf.custom_gradient does around it (innermost last).
_remat_frames = threading.local()


def _frames():
    if not hasattr(_remat_frames, "stack"):
        _remat_frames.stack = []
    return _remat_frames.stack


@contextlib.contextmanager
def _frame(computing):
    _frames().append(computing)
    try:
        yield
    finally:
        _frames().pop()


def recording_a_remat_call():
    """True while `tf.custom_gradient`, around a rematerialized layer call, turns the
    variables the layer read into tensors to record them (after the layer ran): a stage-3
    variable must then stand for itself, not be read from its owner again (that read's
    gradient would be reduced to the owner a second time)."""
    frames = _frames()
    return bool(frames) and not frames[-1]


def _recomputed(function):
    """`function` (of tensors) recomputed for its backward pass, as `tf.recompute_grad`
    does, with what tf.custom_gradient records around it marked (`recording_a_remat_call`)
    and the backward pass made of one custom gradient, not two: TensorFlow's nests a second
    one, whose bookkeeping reads every variable again during the backward pass (across
    workers, one more collective per stage-3 variable read, which left steps waiting)."""

    @tf.custom_gradient
    def call(*args):
        # The layer's reads (a broadcast from the owner, which needs no input) wait for
        # its input: begun when the step starts, every layer's gathered weights would be
        # held from then on.
        with internals.symbol("tensorflow.python.eager.record.stop_recording")(), \
                _frame(True), tf.control_dependencies([a for a in args if tf.is_tensor(a)]):
            result = function(*args)

        def gradient(*upstream, variables=None):
            variables = list(variables or [])
            # Recomputed, its weights read again, once the gradient arrives.
            with tf.control_dependencies(upstream):
                inputs = [tf.identity(a) for a in args]
                with tf.GradientTape() as tape:
                    tape.watch(inputs)
                    tape.watch(variables)
                    with _frame(True):
                        recomputed = function(*inputs)
            grads = tape.gradient(recomputed, inputs + variables, output_gradients=upstream,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return grads[:len(inputs)], grads[len(inputs):]

        return result, gradient

    return call


def _gathers_parameters():
    strategy = tf.distribute.get_strategy()
    return bool(hooks_of(strategy)._tfpar_gathers_parameters)


def _remat_with_keyword_arguments(keras_remat):
    """Keras' remat (what `keras.RematScope` wraps each layer call in) is
    `tf.recompute_grad` on TensorFlow, whose custom gradient takes no keyword arguments in
    a tf.function: `model.fit` of a model built under a RematScope fails ("The
    custom_gradient decorator currently supports keywords arguments only when eager
    execution is enabled", keras-team/keras#21207). Keyword arguments that carry no
    gradient (the training flag, masks) are bound before the call; others keep Keras'
    behavior. Under a strategy whose replicas read stage-3 variables from other workers,
    the call is recomputed by `_recomputed` (remat is how their gathered weights are
    freed per layer)."""

    def remat(function):
        def computed(*args, **kwargs):
            with _frame(True):
                return function(*args, **kwargs)

        def call(*args, **kwargs):
            if kwargs.get("mask") is not None and getattr(
                    getattr(function, "__self__", None), "_tfpar_regathered", False):
                return computed(*args, **kwargs)  # tfpar's choice, not the user's: no mask.
            bind = kwargs and not any(_differentiable(v) for v in tf.nest.flatten(kwargs))
            if _gathers_parameters() and (bind or not kwargs) and tf.inside_function():
                with _frame(False):
                    return _recomputed(functools.partial(function, **kwargs))(*args)
            if not bind:
                return keras_remat(computed)(*args, **kwargs)
            return keras_remat(functools.partial(computed, **kwargs))(*args)
        return call

    return remat


def patches():
    """What tfpar replaces in Keras for sharded optimizers (and remat, which stage 3 uses):
    (owner, attribute, wrap)."""
    base = internals.symbol("keras.src.optimizers.base_optimizer.BaseOptimizer")
    optimizer = internals.symbol("keras.src.backend.tensorflow.optimizer.TFOptimizer")
    remat = internals.symbol("keras.src.backend.common.remat")
    saving_lib = internals.symbol("keras.src.saving.saving_lib")
    internals.check(callable(getattr(remat, "remat", None)), "keras.src.backend.common.remat.remat")
    return [(remat, "remat", _remat_with_keyword_arguments),
            (base, "build", _built_for_shards),
            (base, "_update_model_variables_moving_average", _left_to_owners),
            (base, "finalize_variable_values", _finalized_by_owners),
            (base, "save_own_variables", _saved_whole),
            (saving_lib, "save_weights_only", owner_saving.written_by_owners),
            (saving_lib, "load_weights_only", owner_saving.read_by_owners),
            (base, "load_own_variables", _loaded_where_owned),
            (optimizer, "_backend_update_step", _sharded_update_step),
            (optimizer, "_apply_weight_decay", _left_to_owners)]
