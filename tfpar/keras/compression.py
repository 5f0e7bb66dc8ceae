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
    grads_and_vars = list(grads_and_vars)
    chosen = [i for i, (g, _) in enumerate(grads_and_vars) if _compressible(g)]
    if chosen:
        scale = 1.0 / n if compression == "fp16" else 1.0
        sent = [tf.cast(grads_and_vars[i][0] * scale, wire) for i in chosen]
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, sent)
    out = list(grads_and_vars)
    rest = [i for i, (g, _) in enumerate(grads_and_vars) if g is not None and i not in chosen]
    if rest:  # (Keras refuses a list without any gradient.)
        for i, pair in zip(rest, keras_all_reduce(optimizer, [grads_and_vars[i]
                                                              for i in rest])):
            out[i] = pair
    for i, total in zip(chosen, summed if chosen else ()):
        grad, variable = grads_and_vars[i]
        out[i] = (tf.cast(total, grad.dtype) / scale, variable)
    return out
