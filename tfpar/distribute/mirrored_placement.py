"""Moving the copies of a mirrored variable to other devices, in place.

A `tf.distribute` mirrored variable keeps one `tf.Variable` per replica, on the
replica's device. In a pipeline, replica r's copy of a stage's variable must live
on the device that runs that stage for replica r, not on the replica's first
device. `move_copies` replaces the copies by new ones on the given devices,
keeping their values and the distributed variable object itself (layers,
optimizers, checkpoints and Keras variables refer to it). Like
`placement.move_variable`, it must run before a `tf.function` captures the
variable.
"""

# Glue over Keras' and TensorFlow's internals (and tfpar's own private attributes).
# pylint: disable=protected-access

import weakref

import tensorflow as tf

from tfpar.distribute.placement import canonical_device
from tfpar.keras import internals
from tfpar.keras import models
from tfpar.keras import variable_birth


def distributed_value(variable):
    """The `tf.distribute` variable inside a Keras variable (or itself), or None."""
    distributed_variable = internals.symbol(
        "tensorflow.python.distribute.values.DistributedVariable")
    if isinstance(variable, distributed_variable):
        return variable
    value = internals.attr(variable, "_value")
    return value if isinstance(value, distributed_variable) else None


def move_copies(variable, devices):
    """Moves copy i of a mirrored (Keras or TF) variable to `devices[i]`.

    Returns True if any copy moved. Variables that are not distributed are left
    alone (returns False). A Keras variable without storage yet
    (`variable_birth.has_no_storage`) gets its copies on `devices`: nothing moves.
    """
    if models.is_variable(variable) and variable_birth.has_no_storage(variable):
        variable_birth.materialize(variable, devices)
        return False
    distributed = distributed_value(variable)
    if distributed is None:
        return False
    copies = internals.attr(distributed, "_values")
    if len(copies) != len(devices):
        raise ValueError(
            f"Variable {distributed.name} has {len(copies)} copies but {len(devices)} devices "
            f"were given for them.")
    moved, changed = [], False
    with tf.init_scope():
        for old, device in zip(copies, devices):
            if canonical_device(old.device) == canonical_device(device):
                moved.append(old)
                continue
            new = plain_variable(
                device, initial_value=old.read_value(), trainable=old.trainable,
                name=old.name.split(":")[0], dtype=old.dtype, shape=old.shape,
                aggregation=old.aggregation, synchronization=old.synchronization)
            # Keras' TensorFlow optimizer keys its state by the primary's _unique_id.
            internals.set_attr(new, "_unique_id", internals.attr(old, "_unique_id"))
            internals.set_attr(new.handle, "_distributed_container", weakref.ref(distributed),
                               like=old.handle)
            moved.append(new)
            changed = True
    internals.set_attr(distributed, "_values", tuple(moved))
    return changed


def plain_variable(device, **kwargs):
    """A resource variable on `device` (ResourceVariable's arguments), made in
    `tf.init_scope()`: the class itself, not tf.Variable, which would ask the strategy in
    scope for a distributed variable (also from a replica thread)."""
    with tf.init_scope(), tf.device(device):
        return internals.symbol(
            "tensorflow.python.ops.resource_variable_ops.ResourceVariable")(**kwargs)


def devices_of(variable):
    """The devices of a distributed variable's copies, canonical."""
    distributed = distributed_value(variable)
    return tuple(canonical_device(v.device) for v in internals.attr(distributed, "_values"))
