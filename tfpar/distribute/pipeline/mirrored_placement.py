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

import tensorflow as tf

from tfpar.distribute.common.placed_call import canonical_device
from tfpar.keras import models
from tfpar.keras import tf_variables
from tfpar.keras import variable_birth


def distributed_value(variable):
    """The `tf.distribute` variable inside a Keras variable (or itself), or None."""
    distributed_variable = tf_variables.distributed_variable_class()
    if isinstance(variable, distributed_variable):
        return variable
    value = models.storage(variable)
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
    copies = tf_variables.copies(distributed)
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
            # Keras' TensorFlow optimizer keys its state by the primary's unique id.
            tf_variables.stand_in(new, old, distributed)
            moved.append(new)
            changed = True
    tf_variables.set_copies(distributed, moved)
    return changed


def plain_variable(device, **kwargs):
    """A resource variable on `device` (ResourceVariable's arguments), made in
    `tf.init_scope()`: the class itself, not tf.Variable, which would ask the strategy in
    scope for a distributed variable (also from a replica thread)."""
    with tf.init_scope(), tf.device(device):
        return tf_variables.resource_variable(**kwargs)


def devices_of(variable):
    """The devices of a distributed variable's copies, canonical."""
    distributed = distributed_value(variable)
    return tuple(canonical_device(v.device) for v in tf_variables.copies(distributed))
