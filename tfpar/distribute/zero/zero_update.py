"""ZeRO's optimizer step: gradients reduced to their owners in buckets, each owner's
update of its own variables, and (stages 1-2) the updated values shared back."""

import contextlib
import dataclasses

import tensorflow as tf

from tfpar.contract import hooks_of
from tfpar.distribute.common.device_memory import num_bytes
from tfpar.distribute.zero.zero_collectives import _runs
from tfpar.distribute.zero.zero_pacing import _pace_gradients
from tfpar.distribute.zero.zero_reads import _update
from tfpar.keras import compression as compression_lib
from tfpar.keras import steps
from tfpar.keras.replicas import replica_id, replica_in_sync
from tfpar.plan import sharding


@dataclasses.dataclass
class StepShapes:
    """What the last traced step kept per replica: the bytes of its gradient shard, per
    dtype bucket (read by `memory_report`)."""

    gradient_bytes: int = 0


def _flat(tensor):
    return tf.reshape(tensor, [-1])


def _bucket(tensors, length, dtype):
    """One flat tensor of `length` elements: the tensors' values, then zeros."""
    if not tensors:
        return tf.zeros([length], dtype)
    flat = tf.concat([_flat(t) for t in tensors], axis=0)
    used = flat.shape[0]
    return tf.pad(flat, [[0, length - used]]) if used < length else flat


def _unbucket(flat, like):
    """The tensors of `like`'s shapes, in order, from the front of `flat`."""
    out, start = [], 0
    for t in like:
        size = t.shape.num_elements()
        out.append(tf.reshape(flat[start:start + size], t.shape))
        start += size
    return out


def _by_owner(items, owners, num_replicas):
    groups = [[] for _ in range(num_replicas)]
    for item, owner in zip(items, owners):
        groups[owner].append(item)
    return groups


def _bucket_length(groups):
    return max([sum(v.shape.num_elements() for v in g) for g in groups] + [1])


class Accumulation:
    """Gradient accumulation in a sharded step: each owner's accumulators (`accumulators[i]`
    for variable i, kept on its owner), the number of steps a mean takes, the boolean
    tensor of an update step, and the optimizer's clipping."""

    def __init__(self, accumulators, steps, is_update_step, clip):
        self.accumulators = accumulators
        self.steps = steps
        self.is_update_step = is_update_step
        self.clip = clip

    def apply(self, optimizer, owned, learning_rate):
        """Accumulates or applies `owned`: (index, summed gradient, variable) of the
        replica's own variables. Local operations only, so the branch may be a `cond`
        (collectives inside one fail in TensorFlow)."""
        if not owned:
            return
        accumulators = [self.accumulators[i] for i, _, _ in owned]
        totals = [tf.convert_to_tensor(g) + a.read_value()
                  for (_, g, _), a in zip(owned, accumulators)]

        def update():
            for (_, _, variable), grad in zip(owned, self.clip(
                    [t / self.steps for t in totals])):
                optimizer.update_step(grad, variable, learning_rate)
            for accumulator in accumulators:
                accumulator.assign(tf.zeros_like(accumulator))
            return tf.constant(True)

        def keep():
            for accumulator, total in zip(accumulators, totals):
                accumulator.assign(total)
            return tf.constant(False)

        tf.cond(self.is_update_step, update, keep)


def _apply_owned(optimizer, owned, learning_rate, accumulation, in_turn):
    """The optimizer's update of the replica's own variables, or their accumulation;
    each update made through `in_turn` (a `steps.InTurn`, or `steps.at_once`)."""
    if accumulation is not None:
        accumulation.apply(optimizer, owned, learning_rate)
        # (Keras' moving averages follow the weights every step, updated or not.)
        for _, _, variable in owned:
            optimizer.after_step(variable)
        return

    def update(grad, variable):
        optimizer.update_step(grad, variable, learning_rate)
        optimizer.after_step(variable)
        return variable.read_value()  # Ordered after the update (the same resource).

    for _, grad, variable in owned:
        in_turn(update, grad, variable)


def sharded_update(strategy, optimizer, grads, variables, learning_rate, stage, collectives,
                   bucket_bytes, accumulation=None):
    """The optimizer step of one replica under ZeRO `stage` (1-3), in replica context.

    `optimizer` is the owner's step of the Keras seam (`zero_optimizers.OwnerStep`:
    `update_step`, `after_step` of each owned variable every step, and `clip` of the owned
    gradients when it `clips`);
    `variables` are the strategy's variables (tf.Variables, not keras.Variables),
    `grads` this replica's gradients for them (not yet reduced), `collectives` a
    `ShardCollectives`; gradients travel in buckets of about `bucket_bytes`
    (`tfpar.plan.sharding.buckets`). Every replica makes the same collective calls in
    the same order: the plan is the same on all.
    """
    ctx = tf.distribute.get_replica_context()
    me = replica_in_sync()
    owner = [strategy._tfpar_shard_owners.owner_of(v) for v in variables]
    # DataParallelStrategy(compression=...): the gradients' sums in the wire type.
    compression = hooks_of(strategy)._tfpar_compression
    # The global gradient is clipped once every owner's is summed: its norm is the sum of
    # the owners' squared norms. (Accumulation clips its own means.)
    clipping = optimizer.clips and accumulation is None

    def clipped(owned):
        grads_owned = optimizer.clip(
            [g for _, g, _ in owned],
            lambda x: ctx.all_reduce(tf.distribute.ReduceOp.SUM, x))
        return [(i, g, v) for (i, _, v), g in zip(owned, grads_owned)]

    if strategy._tfpar_gathers_parameters:
        # Each read's gradient was already summed to its owner (`read_parameter`).
        mine = [i for i in range(len(variables)) if owner[i] == me]
        _runs([g for i, g in enumerate(grads) if owner[i] != me and g is not None])
        owned = [(i, grads[i], variables[i]) for i in mine]
        owned = clipped(owned) if clipping else owned
        _update.running = True
        try:
            _apply_owned(optimizer, owned, learning_rate, accumulation, steps.InTurn())
        finally:
            _update.running = False
        strategy._tfpar_step_shapes.gradient_bytes = sum(num_bytes(variables[i]) for i in mine)
        return
    ordinals = [strategy._tfpar_shard_owners.ordinal_of(v) for v in variables]
    # A replica's own copy of a mirrored variable (among this worker's copies); a stage-3
    # variable has one copy.
    local = [strategy.experimental_local_results(v)[replica_id()]
             if isinstance(v, tf.distribute.DistributedValues) else v for v in variables]
    gradient_bytes = 0
    # Across workers the step's updates run one after another, and so do its broadcasts of
    # updated values: each holds temporaries (a receive, its buffer from when it starts)
    # the size of its variable. On 24 x Dense(1024) over 2 workers, ZeRO-1 peaked 240 MiB
    # above its state with neither in turn, 100 with both (the gradients alone: 90). (On
    # one host, not measured, the updates run at once as before.)
    across_workers = collectives.kind == "pairwise"
    updates = steps.InTurn() if across_workers else steps.at_once
    broadcasts = steps.InTurn()
    transfers = []  # (variable index, its gradient's transfer), the last layers' first.

    def apply_and_share(owned, groups, dtype):
        _apply_owned(optimizer, owned, learning_rate, accumulation, updates)
        if stage < 3 and collectives.kind == "placed":
            shared = [i for group in groups for i in group]
            collectives.copy_from_owners(
                ctx, [strategy.experimental_local_results(variables[i]) for i in shared],
                [owner[i] for i in shared])
        elif stage < 3 and across_workers:
            _broadcast_updates(ctx, collectives, local, groups, ordinals, grads, broadcasts)
        elif stage < 3:
            _gather_updates(ctx, collectives, local, groups, dtype)

    pending = []  # Clipping: each bucket's (device, scope, owned, groups, dtype), summed.
    for devices, index, prefix in _update_groups(strategy._tfpar_shard_owners, variables):
        # A pipeline stage's variables updated on this replica's device of the stage.
        device = devices[me] if devices else None
        with tf.device(device) if device else contextlib.nullcontext():
            # Each bucket is reduced, applied and gathered on its own, so that its
            # collectives wait only for its own gradients (the last layers' come first).
            for number, bucket in enumerate(sharding.buckets(
                    [num_bytes(variables[i]) for i in index], bucket_bytes)):
                with tf.name_scope(f"{prefix}bucket_{number}"):
                    members = [index[j] for j in bucket]
                    groups = _by_owner(members, [owner[i] for i in members],
                                       ctx.num_replicas_in_sync)
                    reduced, kept, sent = _own_gradients(ctx, collectives, stage, grads,
                                                         variables, groups, ordinals, devices,
                                                         compression)
                    transfers += [(i, sent[i]) for i in members if i in sent]
                    gradient_bytes += kept
                    owned = [(i, reduced[i], local[i]) for i in groups[me]]
                    dtype = variables[index[0]].dtype
                    if clipping:
                        pending.append((device, f"{prefix}bucket_{number}_update", owned,
                                        groups, dtype))
                    else:
                        apply_and_share(owned, groups, dtype)
    if pending:
        every = clipped([item for _, _, owned, _, _ in pending for item in owned])
        for device, scope, owned, groups, dtype in pending:
            mine, every = every[:len(owned)], every[len(owned):]
            with tf.device(device) if device else contextlib.nullcontext(), \
                    tf.name_scope(scope):
                apply_and_share(mine, groups, dtype)
    _pace_gradients(grads, [(i, op, num_bytes(variables[i])) for i, op in transfers],
                    bucket_bytes)
    strategy._tfpar_step_shapes.gradient_bytes = gradient_bytes


def _update_groups(owners, variables):
    """(devices, variable indices, name prefix) of the variables updated together: one
    dtype of one group of `owners` (the group's devices, one per replica: a pipeline
    stage's; None without groups), in the order of their first variables, the same on
    every replica."""
    found = {}
    for i, variable in enumerate(variables):
        found.setdefault(owners.group_devices(variable), []).append(i)
    for number, (devices, members) in enumerate(found.items()):
        for dtype in sorted({variables[i].dtype for i in members}, key=lambda d: d.name):
            yield (devices, [i for i in members if variables[i].dtype == dtype],
                   f"tfpar_zero_{number}_" if devices else "tfpar_zero_")


def _own_gradients(ctx, collectives, stage, grads, variables, groups, ordinals,
                   devices=None, compression=None):
    """`_reduced_gradients`, with the dense float gradients summed in the wire type of
    `compression` ("fp16", "bf16", or None: as they are), as data parallelism sums them."""
    n = ctx.num_replicas_in_sync
    index = [i for g in groups for i in g]
    squeezed = [i for i in index if compression and compression_lib.compressible(grads[i])]
    if not squeezed:
        return _reduced_gradients(ctx, collectives, stage, grads, variables, groups, ordinals,
                                  devices)
    sent = list(grads)
    for i in squeezed:
        sent[i] = compression_lib.to_wire(grads[i], compression, n)
    reduced, kept, done = _reduced_gradients(ctx, collectives, stage, sent, variables, groups,
                                             ordinals, devices, sent[squeezed[0]].dtype)
    return ({i: compression_lib.from_wire(g, variables[i].dtype, compression, n)
             if i in squeezed else g for i, g in reduced.items()}, kept, done)


def _reduced_gradients(ctx, collectives, stage, grads, variables, groups, ordinals,
                       devices=None, wire_dtype=None):
    """{variable index: summed gradient} for this replica's variables, the bytes of
    gradients the step keeps on the replica, and {variable index: the op that ends its
    gradient's transfer} where each is sent to its owner alone. (`devices`: the group's
    device of each replica, where "placed" collectives sum.)"""
    index = [i for g in groups for i in g]
    me = replica_in_sync()
    sent = {}  # {variable index: the op that ends its gradient's transfer} ("pairwise")
    # Gradients are reduce-scattered where there is a reduce-scatter (NCCL), sent to their
    # owners one by one across workers on CPUs ("pairwise");
    # without one (CPUs of one host) they are all-reduced and each replica keeps its own:
    # flattening into a bucket to slice it after would only add copies. Sparse gradients
    # stay sparse (all-reduced as slices, as without sharding): Keras optimizers treat
    # repeated rows of IndexedSlices apart (Adam squares each).
    whole = [i for i in index
             if not collectives.scatters or isinstance(grads[i], tf.IndexedSlices)]
    reduced = dict(zip(whole, ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                             [grads[i] for i in whole]))) if whole else {}
    # Stage 1 keeps every gradient (the local ones it computed, whole); stages 2-3 keep
    # their own reduced ones only.
    kept = (sum(num_bytes(variables[i]) for i in index) if stage == 1
            else sum(num_bytes(variables[i]) for i in whole if i in groups[me]))
    dense = [[i for i in g if i not in reduced] for g in groups]
    dtype = wire_dtype or variables[index[0]].dtype
    if collectives.kind == "pairwise" and any(dense):
        # Each variable by its ordinal, which names its transfers on every worker.
        ordinal = {i: ordinals[i] for group in dense for i in group}
        owner_of = {ordinal[i]: owner for owner, group in enumerate(dense) for i in group}
        mine, done = collectives.reduce_to_owners(
            ctx, {ordinal[i]: grads[i] for i in ordinal}, owner_of)
        reduced.update({i: mine[ordinal[i]] for i in dense[me]})
        sent = {i: done[ordinal[i]] for group in dense for i in group}
        kept += sum(num_bytes(variables[i]) for i in dense[me]) if stage > 1 else 0
    elif collectives.kind == "placed" and any(dense):
        flat = [(owner, i) for owner, group in enumerate(dense) for i in group]
        sums = collectives.sum_on_owners(ctx, [grads[i] for _, i in flat],
                                         [devices[owner] for owner, _ in flat])
        reduced.update({i: total for (owner, i), total in zip(flat, sums) if owner == me})
        kept += sum(num_bytes(variables[i]) for i in dense[me]) if stage > 1 else 0
    elif any(dense):
        length = _bucket_length([[variables[i] for i in g] for g in dense])
        flat = tf.concat([_bucket([grads[i] for i in g], length, dtype)
                          for g in dense], axis=0)
        shard = collectives.reduce_scatter(ctx, flat)
        reduced.update(zip(dense[me], _unbucket(shard, [variables[i] for i in dense[me]])))
        kept += length * dtype.size if stage > 1 else 0
    return reduced, kept, sent


def _gather_updates(ctx, collectives, local, groups, dtype):
    """Every replica's copy takes the values its owners just computed (stages 1-2)."""
    length = _bucket_length([[local[i] for i in g] for g in groups])
    me = replica_in_sync()
    # Reads of the updated variables: automatic control dependencies order them after
    # the updates (the same resources).
    gathered = collectives.all_gather(
        ctx, _bucket([local[i].read_value() for i in groups[me]], length, dtype),
        ctx.num_replicas_in_sync)
    for owner, group in enumerate(groups):
        if owner == me or not group:
            continue
        values = _unbucket(gathered[owner * length:(owner + 1) * length],
                           [local[i] for i in group])
        for i, value in zip(group, values):
            local[i].assign(value)


def _broadcast_updates(ctx, collectives, local, groups, ordinals, grads, in_turn):
    """Every replica's copy takes the values its owners just computed (stages 1-2, across
    workers): one variable at a time (`in_turn`, a `steps.InTurn`, in the same order on
    every replica), each broadcast from its owner straight into the copies. (An all-gather
    of the bucket held it three times over: the owner's part, the gathered whole and its
    slices; receives started together held all their buffers at once.)"""
    me = replica_in_sync()

    def send(i):
        # A read of the updated variable: automatic control dependencies order it after
        # the update (the same resource).
        return collectives.broadcast(ctx, local[i].read_value(), None, None, ordinals[i])

    def receive(i):
        # The receive also waits for this replica's own gradient of the variable, so that
        # none starts before the backward pass reaches its layer.
        with tf.control_dependencies([_dependency(grads[i])]):
            value = collectives.broadcast(ctx, None, local[i].shape, local[i].dtype,
                                          ordinals[i])
        return local[i].assign(value, read_value=False)

    sends = []
    for owner, group in enumerate(groups):
        for i in group:
            if owner == me:
                sends.append(in_turn(send, i))
            else:
                in_turn(receive, i)
    _runs(sends)


def _dependency(value):
    return value.values if isinstance(value, tf.IndexedSlices) else value
