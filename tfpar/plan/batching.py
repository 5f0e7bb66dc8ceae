"""How a global batch splits over replicas. Pure Python."""

from tfpar.errors import BatchSizeError


def check_global_batch(global_batch_size, num_replicas):
    """Raises `BatchSizeError` if a global batch cannot give every replica an example."""
    if not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool):
        raise BatchSizeError(
            f"The global batch size must be an integer. Received: {global_batch_size!r}")
    if global_batch_size < num_replicas:
        raise BatchSizeError(
            f"The global batch size ({global_batch_size}) is smaller than the number of "
            f"replicas ({num_replicas}): every replica needs at least one example. Use a "
            f"global batch size of at least {num_replicas}, ideally a multiple of it, or "
            f"use fewer devices.")


def per_replica_batch_size(global_batch_size, num_replicas):
    """Splits a global batch evenly over replicas.

    The split must be exact: with Keras' per-replica mean loss, an uneven split
    weighs examples unequally and the result differs from one device.

    >>> per_replica_batch_size(64, 4)
    16
    """
    check_global_batch(global_batch_size, num_replicas)
    if global_batch_size % num_replicas:
        lower = global_batch_size - global_batch_size % num_replicas
        raise BatchSizeError(
            f"The global batch size ({global_batch_size}) does not divide evenly over "
            f"{num_replicas} replicas. Use a multiple of {num_replicas}, such as {lower} "
            f"or {lower + num_replicas}.")
    return global_batch_size // num_replicas
