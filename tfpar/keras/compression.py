"""Gradients compressed for the wire: the replicas' sum of Keras' gradients in float16 or
bfloat16 (`DataParallelStrategy(compression=...)`), as PyTorch DDP's `fp16_compress_hook`
and `bf16_compress_hook` do.

Each replica casts its float gradients to the wire's type (float16: divided by the number
of replicas first, so that the sum stays in range), the strategy sums them in that type,
and each replica casts the sum back (float16: times the number of replicas). Sparse
gradients (`IndexedSlices`) and non-float ones are summed as they are.

    >>> import tfpar
    >>> strategy = tfpar.DataParallelStrategy(["/cpu:0"], compression="bf16")
    >>> strategy.compression
    'bf16'
"""

import tensorflow as tf

WIRE = {"fp16": tf.float16, "bf16": tf.bfloat16}


def _compressible(grad):
    return (grad is not None and not isinstance(grad, tf.IndexedSlices)
            and grad.dtype in (tf.float32, tf.float64))


def compressible(grad):
    """Whether a gradient goes to the wire in the compressed type (dense floats)."""
    return _compressible(grad)


def to_wire(grad, compression, num_replicas):
    """A replica's gradient as it goes on the wire (float16: divided by the replicas first,
    so that their sum stays in range)."""
    scaled = grad / num_replicas if compression == "fp16" else grad
    return tf.cast(scaled, WIRE[compression])


def from_wire(total, dtype, compression, num_replicas):
    """The replicas' sum in the wire type, back in `dtype` (float16: times the replicas)."""
    total = tf.cast(total, dtype)
    return total * num_replicas if compression == "fp16" else total


def all_reduce_sum(context, compression, grads_and_vars, keras_all_reduce, optimizer):
    """Keras' `_all_reduce_sum_gradients` of `grads_and_vars` in replica `context`, the
    float gradients summed in the wire type of `compression`; the others by Keras."""
    n = context.num_replicas_in_sync
    out = list(grads_and_vars)
    chosen = [i for i, (g, _) in enumerate(out) if _compressible(g)]
    rest = [i for i, (g, _) in enumerate(out) if g is not None and i not in chosen]
    if chosen:
        sent = [to_wire(out[i][0], compression, n) for i in chosen]
        for i, total in zip(chosen, context.all_reduce(tf.distribute.ReduceOp.SUM, sent)):
            grad, variable = out[i]
            out[i] = (from_wire(total, grad.dtype, compression, n), variable)
    if rest:  # (Keras refuses a list without any gradient.)
        for i, pair in zip(rest, keras_all_reduce(optimizer, [out[i] for i in rest])):
            out[i] = pair
    return out
