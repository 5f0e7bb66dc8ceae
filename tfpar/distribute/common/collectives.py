"""Collectives over the replicas of a strategy, for use inside `strategy.run`.

They go through the strategy's own cross-device ops, so they use NCCL on GPUs
and the strategy's CPU implementation elsewhere.

    strategy = tfpar.DataParallelStrategy()

    def step():
        ctx = tf.distribute.get_replica_context()
        x = tf.cast(ctx.replica_id_in_sync_group, tf.float32) * tf.ones([4])
        return tfpar.collectives.all_reduce(x, op="sum")

    totals = strategy.run(step)
"""

import tensorflow as tf

from tfpar.errors import ReplicaContextError

_OPS = ("sum", "mean", "max", "min")


def _replica_context(name):
    ctx = tf.distribute.get_replica_context()
    if ctx is None or tf.distribute.in_cross_replica_context():
        raise ReplicaContextError(
            f"tfpar.collectives.{name} must be called inside strategy.run(fn), in "
            f"replica context; it was called in cross-replica context.")
    return ctx


def _check_op(op):
    if op not in _OPS:
        raise ValueError(f"Unknown reduction op {op!r}. Use one of: {', '.join(_OPS)}.")


def _check_root(root, ctx):
    if not isinstance(root, int) or not 0 <= root < ctx.num_replicas_in_sync:
        raise ValueError(
            f"root must be a replica index in [0, {ctx.num_replicas_in_sync}). "
            f"Received: root={root!r}")


def _all_reduce(ctx, value, op):
    if op in ("sum", "mean"):
        reduce_op = tf.distribute.ReduceOp.SUM if op == "sum" else tf.distribute.ReduceOp.MEAN
        return ctx.all_reduce(reduce_op, value)
    # max/min have no all-reduce of their own in tf.distribute: gather then reduce.
    value = tf.convert_to_tensor(value)
    gathered = ctx.all_gather(tf.expand_dims(value, 0), axis=0)
    return tf.reduce_max(gathered, 0) if op == "max" else tf.reduce_min(gathered, 0)


def _is_replica(ctx, root):
    return tf.equal(ctx.replica_id_in_sync_group, root)


def all_reduce(value, op="sum"):
    """Every replica gets the reduction ("sum", "mean", "max", "min") of all values."""
    ctx = _replica_context("all_reduce")
    _check_op(op)
    return _all_reduce(ctx, value, op)


def broadcast(value, root=0):
    """Every replica gets replica `root`'s value."""
    ctx = _replica_context("broadcast")
    _check_root(root, ctx)
    value = tf.convert_to_tensor(value)
    # A sum where only the root contributes: one all-reduce, no extra primitive.
    mine = tf.where(_is_replica(ctx, root), value, tf.zeros_like(value))
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, mine)


def reduce(value, op="sum", root=0):
    """Replica `root` gets the reduction of all values; the others keep their own value."""
    ctx = _replica_context("reduce")
    _check_op(op)
    _check_root(root, ctx)
    value = tf.convert_to_tensor(value)
    return tf.where(_is_replica(ctx, root), _all_reduce(ctx, value, op), value)


def all_gather(value, axis=0):
    """Every replica gets all values concatenated along `axis`, in replica order."""
    ctx = _replica_context("all_gather")
    return ctx.all_gather(value, axis=axis)


def reduce_scatter(value, op="sum", axis=0):
    """Replica i gets the i-th of `num_replicas` equal slices (along `axis`) of the reduction."""
    ctx = _replica_context("reduce_scatter")
    _check_op(op)
    value = tf.convert_to_tensor(value)
    n = ctx.num_replicas_in_sync
    size = value.shape[axis] if value.shape.rank is not None else None
    if size is None or size % n:
        raise ValueError(
            f"reduce_scatter splits dimension {axis} into {n} equal slices, one per "
            f"replica, so its size must be known and a multiple of {n}. "
            f"Received: shape={value.shape}")
    reduced = _all_reduce(ctx, value, op)
    chunk = size // n
    begin = ctx.replica_id_in_sync_group * chunk
    rank = value.shape.rank
    axis = axis % rank
    starts = [0] * rank
    sizes = [-1] * rank
    starts[axis] = begin
    sizes[axis] = chunk
    return tf.slice(reduced, tf.stack(starts), sizes)
