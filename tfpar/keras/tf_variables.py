"""TensorFlow variables as tfpar's placing strategies handle them: the copies of a
`tf.distribute` variable, a copy made to stand for another, a variable's conversion to a
tensor.

Every private is read or written through `internals` (listed in its manifest, failing
closed with the versions named); the runtime (`tfpar.distribute`) calls these functions
instead of naming a private. A Keras variable's own storage is `tfpar.keras.models`'.
"""

import weakref

from tfpar.keras import internals


def distributed_variable_class():
    """TensorFlow's `DistributedVariable` (mirrored and sync-on-read variables)."""
    return internals.symbol("tensorflow.python.distribute.values.DistributedVariable")


def copies(distributed):
    """The per-replica `tf.Variable`s of a `DistributedVariable`, in replica order."""
    return internals.attr(distributed, "_values")


def set_copies(distributed, variables):
    """Makes `variables` the per-replica copies of a `DistributedVariable`."""
    internals.set_attr(distributed, "_values", tuple(variables))


def stand_in(new, old, distributed=None):
    """Makes `new` (a copy of variable `old` made elsewhere) stand for it: Keras' TensorFlow
    optimizer keys its state by `_unique_id`, which `new` takes from `old`; with
    `distributed`, `new`'s handle names that `DistributedVariable` as its container, as
    `old`'s did."""
    internals.set_attr(new, "_unique_id", internals.attr(old, "_unique_id"))
    if distributed is not None:
        internals.set_attr(new.handle, "_distributed_container", weakref.ref(distributed),
                           like=old.handle)


def resource_variable(**kwargs):
    """A `ResourceVariable` (its arguments): the class itself, not `tf.Variable`, which
    would ask the strategy in scope for a distributed variable."""
    return internals.symbol("tensorflow.python.ops.resource_variable_ops.ResourceVariable")(
        **kwargs)


class _Colocation:
    """Stands for a variable to colocate with: its copies' devices (`_devices`, as
    `MirroredExtended._create_variable` reads them from `colocate_with`)."""

    def __init__(self, devices):
        self._devices = tuple(devices)


def colocate_with_devices(devices):
    """A `colocate_with` for `MirroredExtended._create_variable` that makes a mirrored
    variable's copies on `devices` (one per replica); check what it made with
    `check_copies_on`."""
    return _Colocation(devices)


def check_copies_on(made, devices):
    """Fails closed unless the copies made under `colocate_with_devices(devices)` are on
    `devices` (`made`: their devices): TensorFlow read the stand-in as it reads a
    variable."""
    internals.check(tuple(made) == tuple(devices),
                    "MirroredExtended._create_variable making copies on colocate_with._devices")


def check_converts_through_dense_var_to_tensor(variable_class):
    """Fails closed unless `variable_class` turns into a tensor through
    `_dense_var_to_tensor` (what a subclass overrides to change every read)."""
    internals.attr(variable_class, "_dense_var_to_tensor")
