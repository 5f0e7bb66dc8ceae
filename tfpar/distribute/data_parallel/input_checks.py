"""Checks on the input a strategy distributes, made before or as the first batch is read."""

import tensorflow as tf

from tfpar.plan import batching


def check_first_batch(dataset, num_replicas, in_pipeline=True):
    """Fails fast when a dataset's global batch cannot feed every replica.

    A static batch dimension is checked now. Otherwise, with `in_pipeline`, the first
    batch is checked when it is read (later batches may be a legitimate last partial
    batch). Across workers the pipeline is left as it is: any transformation that
    counts batches (enumerate, scan) makes tf.data's FILE auto-sharding fall back to
    DATA sharding, so every worker would read every file. A replica whose part is empty
    there adds nothing to the loss (tfpar normalizes losses by the global count).
    """
    if num_replicas < 2:
        return dataset
    first = tf.nest.flatten(dataset.element_spec)[0]
    shape = getattr(first, "shape", None)
    if shape is None or shape.rank in (None, 0):
        return dataset
    if shape[0] is not None:
        batching.check_global_batch(int(shape[0]), num_replicas)
        return dataset
    if not in_pipeline:
        return dataset
    message = (
        f"The global batch size is smaller than the number of replicas ({num_replicas}): "
        f"every replica needs at least one example. Use a global batch size of at "
        f"least {num_replicas}, ideally a multiple of it, or use fewer devices.")

    def check(index, element):
        size = tf.shape(tf.nest.flatten(element)[0])[0]
        ok = tf.logical_or(index > 0, size >= num_replicas)
        with tf.control_dependencies([tf.debugging.Assert(ok, [message, "Got:", size])]):
            return tf.nest.map_structure(
                lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t, element)

    return dataset.enumerate().map(check)

