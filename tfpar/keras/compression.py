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


def all_reduce_sum(context, compression, grads_and_vars, keras_all_reduce, optimizer):
    """Keras' `_all_reduce_sum_gradients` of `grads_and_vars` in replica `context`, the
    float gradients summed in the wire type of `compression`; the others by Keras."""
    wire, n = WIRE[compression], context.num_replicas_in_sync
    in_range = compression == "fp16"  # (bfloat16 has float32's range: nothing to scale.)
    out = list(grads_and_vars)
    chosen = [i for i, (g, _) in enumerate(out) if _compressible(g)]
    rest = [i for i, (g, _) in enumerate(out) if g is not None and i not in chosen]
    if chosen:
        sent = [tf.cast(out[i][0] / n if in_range else out[i][0], wire) for i in chosen]
        for i, total in zip(chosen, context.all_reduce(tf.distribute.ReduceOp.SUM, sent)):
            grad, variable = out[i]
            total = tf.cast(total, grad.dtype)
            out[i] = (total * n if in_range else total, variable)
    if rest:  # (Keras refuses a list without any gradient.)
        for i, pair in zip(rest, keras_all_reduce(optimizer, [out[i] for i in rest])):
            out[i] = pair
    return out
