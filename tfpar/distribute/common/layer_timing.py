"""Timing a layer for balancing by time (`balance_by="time"`): model parallelism and
pipelines share it.

A layer is timed where no variable of the strategy's should be born: on a CPU that is
none of the strategy's devices (`timing_device`), its variables then moving once to
their device.
"""

import statistics
import time

import tensorflow as tf

from tfpar import devices as devices_lib
from tfpar.errors import PlacementError
from tfpar.keras import models


def timing_device(devices, alternatives):
    """A CPU that is none of `devices`, where layers are timed; `alternatives` (e.g.
    "balance_by='bytes' or 'params'") is what the error offers instead."""
    device = devices_lib.spare_cpu(devices)
    if device is None:
        raise PlacementError(
            f"balance_by='time' times each layer on a CPU that is not one of the strategy's "
            f"devices, but the strategy uses every CPU of this host ({len(devices)}). Leave "
            f"a CPU out of devices (tfpar.virtual_cpus(n + 1)), or use {alternatives}.")
    return device


def layer_seconds(layer, batch_size, device, input_gradient=False, repeats=3):
    """Median seconds of one forward and backward of `layer` on zeros of `batch_size`
    rows, on `device`. The backward takes the weights' gradients, and the input's when
    `input_gradient` (every pipeline stage but the first sends one back)."""
    arguments = models.call_arguments(layer)
    if arguments is None:
        raise PlacementError(
            f"Cannot time layer {layer.name!r}: its input shape is unknown. Use "
            f"balance_by='bytes' or 'params'.")
    args, kwargs = arguments

    def zeros(t):  # Inputs of the planned batch size; other arguments unchanged.
        if hasattr(t, "shape") and hasattr(t, "dtype"):
            return tf.zeros((batch_size,) + tuple(t.shape[1:]), t.dtype)
        return t

    with tf.init_scope(), tf.device(device):
        call_args, call_kwargs = models.map_structure(zeros, (tuple(args), dict(kwargs)))
        flat = tf.nest.flatten((call_args, call_kwargs))
        given = [i for i, t in enumerate(flat) if isinstance(t, tf.Tensor)]

        # The inputs are arguments, not captured constants, which grappler would fold
        # (with them a parameter-free layer measured as free).
        @tf.function
        def step(tensors):
            values = list(flat)
            for i, t in zip(given, tensors):
                values[i] = t
            args, kwargs = tf.nest.pack_sequence_as((call_args, call_kwargs), values)
            inputs = [t for t in tensors if input_gradient and t.dtype.is_floating]
            # The weights' values, read here: a strategy's (mirrored) variable has no
            # gradient outside its replica context.
            weights = [(w, tf.identity(w.value)) for w in layer.trainable_weights]
            with models.stateless_scope(state_mapping=weights):
                outputs = layer(*args, **kwargs)
                loss = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32))
                                 for o in tf.nest.flatten(outputs)])
            sources = [value for _, value in weights] + inputs
            # Symbolic gradients: tf.init_scope (around this call, to leave a step being
            # traced) stops every gradient tape, and a tape here recorded nothing: the
            # timings were forward passes only (measured: None gradients).
            grads = [g for g in (tf.gradients(loss, sources) if sources else [])
                     if g is not None]
            return grads or loss

        tensors = [flat[i] for i in given]
        step(tensors)  # Trace and warm up.
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            step(tensors)
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)
