"""ZeRO's gradient pacing across workers: the backward pass waits for earlier gradients'
transfers, so that about a bucket of them is in flight."""

import tensorflow as tf

from tfpar.contract import hooks_of
from tfpar.keras import tf_runtime


def paces_gradients(strategy):
    """Whether `strategy`'s backward pass waits for gradient transfers (`_pace_gradients`):
    ZeRO stages 1-2 across workers on CPUs."""
    collectives = hooks_of(strategy)._tfpar_shard_collectives
    return (strategy._tfpar_shard_stage in (1, 2) and collectives is not None
            and collectives.kind == "pairwise")


# Ops that compute a weight's gradient from the layer's input and upstream gradient, and
# whose output feeds nothing else in the backward pass.
_WEIGHT_GRADIENT_OPS = frozenset({
    "MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Conv2DBackpropFilter",
    "Conv2DBackpropFilterV2", "Conv3DBackpropFilterV2"})


def _pace_gradients(grads, transfers, window_bytes):
    """Makes the backward pass wait for gradient transfers: each weight gradient is
    computed only once the transfer of an earlier one (in `transfers`' order: (variable
    index, the op that ends its transfer, bytes)) has ended, so that about `window_bytes`
    of gradients are in flight. Across workers backpropagation outruns the transfers:
    unpaced, every gradient of the step was alive at once (ZeRO-2 on 24 x Dense(2048) over
    2 workers peaked at the full gradients, not its half, and gRPC held a copy of each in
    flight). Only ops that compute a weight's gradient and nothing else wait (a gradient
    clipped by the global norm, or summed over two reads, is left alone): what they wait
    for cannot depend on them, so no step can deadlock."""
    if not tf.inside_function():
        return  # Eagerly each transfer ends before the next gradient is used.
    graph = tf.compat.v1.get_default_graph()
    for position, (i, _, _) in enumerate(transfers):
        grad = grads[i]
        if isinstance(grad, tf.IndexedSlices):
            continue
        op = grad.op
        while op.type == "Identity" and op.inputs:  # (Each replica's own copy: the seam's.)
            op = op.inputs[0].op
        if op.type not in _WEIGHT_GRADIENT_OPS or op.graph is not graph:
            continue
        in_flight = 0
        for earlier in range(position, -1, -1):
            in_flight += transfers[earlier][2]
            if in_flight > window_bytes and earlier < position:
                tf_runtime.add_control_input(op, transfers[earlier][1])
                break
