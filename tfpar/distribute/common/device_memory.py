"""Memory a strategy's training actually holds per device, read from its variables.

Weights and optimizer state: the bytes of every variable (each copy of a mirrored one)
resident on each device. Gradients: the gradient tensors a step keeps on a replica
(all of them without sharding and at stage 1; the replica's reduce-scattered shard,
as the last traced step allocated it, at stages 2 and 3). Gather buffer (stage 3):
the largest variable a replica reads from another owner, the least a step must hold
at once. Activations are not measured (0): `tfpar.plan.estimate_memory` estimates them.
"""

import collections
import math

import tensorflow as tf

from tfpar.keras import models
from tfpar.plan import memory as plan


def _copies(strategy, variable):
    # The tf.Variables holding a keras.Variable's value: one per replica when mirrored.
    value = models.tf_variable(variable)
    return strategy.experimental_local_results(value)


def num_bytes(variable):
    """Bytes of a keras.Variable or tf.Variable."""
    return math.prod(variable.shape) * tf.as_dtype(variable.dtype).size


def resident_bytes(strategy, variables, devices):
    """Bytes of `variables` held on each of `devices` (canonical names)."""
    held = collections.Counter()
    for variable in variables:
        for copy in _copies(strategy, variable):
            held[copy.device] += num_bytes(copy)
    return [held[d] for d in devices]


def measure(strategy, model, optimizer, config, devices, gradient_bytes, gather_bytes):
    """A `tfpar.plan.MemoryEstimate` of what `model` and `optimizer` hold under `strategy`
    now. `gradient_bytes` and `gather_bytes`: per device, from the strategy."""
    state = optimizer.variables if optimizer is not None else []
    weights = resident_bytes(strategy, model.weights, devices)
    optimizer_bytes = resident_bytes(strategy, state, devices)
    records = tuple(plan.DeviceMemory(w, g, o, 0, b) for w, g, o, b in zip(
        weights, gradient_bytes, optimizer_bytes, gather_bytes))
    num_params = sum(math.prod(v.shape) for v in model.trainable_weights)
    return plan.MemoryEstimate(config, num_params, records)

