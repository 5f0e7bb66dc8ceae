"""ZeRO stage 3's reads: a variable held by its owner alone read, where a layer uses it,
as its full value from the owner, its gradient going back to the owner."""

import functools
import threading

import tensorflow as tf

from tfpar.distribute.common import owner_values
from tfpar.keras import hooks as keras_hooks
from tfpar.keras import internals
from tfpar.keras import tf_variables
from tfpar.keras import variable_birth
from tfpar.keras import zero_optimizers as keras_sharded
from tfpar.keras.replicas import replica_in_sync


_update = threading.local()  # .running: this thread applies an owner's update.


def _read_from_owner(variable, strategy, shape):
    """Makes every read of `variable` (a tensor conversion, `numpy()`) return the full
    value held by its owner (`read_parameter`), and a write to an empty stand-in a no-op.

    The variable becomes an instance of a subclass of its own class, so that what reads
    it (Keras layers, Keras' operators, TensorFlow ops) needs no change: the subclass
    only overrides how the variable turns into a tensor.
    """
    base = type(variable)
    # Fails closed before the class changes.
    tf_variables.check_converts_through_dense_var_to_tensor(base)
    owner = strategy._tfpar_shard_owners.owner_of(variable)
    stand_in = id(variable) in strategy._tfpar_shard_owners.remote
    read = functools.partial(read_parameter, strategy, variable, owner, shape)

    @internals.overrides
    class ReadFromOwner(base):
        def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
            # The owner's own update step reads its variable in place, and so does
            # tf.custom_gradient recording what a rematerialized layer read.
            if (as_ref or getattr(_update, "running", False)
                    or keras_sharded.recording_a_remat_call()):
                return super()._dense_var_to_tensor(dtype=dtype, name=name, as_ref=as_ref)
            if variable_birth.tracing_shapes():  # Keras traces shapes: any value will do.
                return tf.zeros(shape, self.dtype)
            return read()

        def numpy(self):
            return self._dense_var_to_tensor().numpy()

        def assign(self, value, use_locking=None, name=None, read_value=True):
            # (load_weights on every worker: only the owner keeps the value.)
            if stand_in:
                return None
            return super().assign(value, use_locking=use_locking, name=name,
                                  read_value=read_value)

    keras_hooks.patch_object(variable, "__class__", ReadFromOwner)


def read_parameter(strategy, variable, owner, shape):
    """The full value of a stage-3 variable held by replica `owner`, on any worker.

    In a replica of `strategy` (a step): the owner's value, broadcast from the owner; its
    gradient is reduced to the owner (`ShardCollectives.reduce_to_owner`): the parameter
    is gathered layer by layer where Keras reads it, and its gradient reduced there too
    (as FSDP does). Elsewhere (saving, `get_weights`): fetched from the owner,
    a collective that every worker makes in the same order.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.strategy is not strategy:
        if tf.inside_function():
            raise ValueError(
                "A shard='parameters' variable across workers was read inside a tf.function "
                "outside strategy.run: its value is on its owner's worker. Read it inside "
                "strategy.run, or eagerly (every worker together, as for saving).")
        return owner_values.values_of_owners(strategy, [(shape, variable.dtype)], [owner],
                                             lambda _: variable.read_value())[0]
    mine = replica_in_sync() == owner
    tag = strategy._tfpar_shard_owners.ordinal_of(variable)
    if mine:
        local = variable.read_value()
    else:
        # An empty read keeps this replica's gradient for the variable (zeros) connected
        # to it, so that every replica applies gradients to the same variables.
        with tf.device(variable.device):
            local = tf.reshape(variable.read_value(), [-1])[:0]

    @tf.custom_gradient
    def from_owner(local):
        full = strategy._tfpar_shard_collectives.broadcast(
            ctx, local if mine else None, shape, local.dtype, tag)

        def gradient(upstream):
            return strategy._tfpar_shard_collectives.reduce_to_owner(
                ctx, upstream, owner, tf.zeros_like(local), tag)

        return full, gradient

    return from_owner(local)
