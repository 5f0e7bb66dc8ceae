"""ZeRO-sharded data parallelism: the TensorFlow side of `DataParallelStrategy(shard=...)`.

Every trainable variable has one owner replica (`tfpar.plan.sharding`), chosen when the
optimizer first asks for it; whole variables are owned, as in PyTorch's
ZeroRedundancyOptimizer, so an optimizer that looks at a whole variable (LAMB's trust
ratio, per-variable clipping) sees it whole.

- Stage 1 ("optimizer"): the optimizer state of a variable lives on its owner only
  (`slot_device`). Gradients are all-reduced as usual; each replica updates the
  variables it owns, with the user's own optimizer, and the updated values are
  all-gathered into every replica's copy.
- Stage 2 ("gradients"): as stage 1, but gradients are reduce-scattered: each replica
  receives the summed gradients of its own variables only.
- Stage 3 ("parameters"): as stage 2, and each trainable variable lives on its owner
  only (a plain variable on one device, made there: `ShardOwners.create_owned`). Every
  replica reads it where a layer uses it (TensorFlow copies it to the replica's device
  at that point, and frees the copy when the step no longer needs it); the owner alone
  updates it, so nothing is gathered after the update. Across workers a replica cannot
  read another worker's variable: each read is a broadcast from the owner, and its
  gradient goes back to the owner alone, which sums (`read_parameter`, as FSDP gathers
  and reduces per layer); a worker that owns no part of a variable holds an empty
  stand-in. With `reshard_after_forward` (the default) recomputable layers are recomputed
  in the backward pass, so each read lives for its layer's forward (or backward) only
  (`tfpar.keras.zero_optimizers.regather_in_backward`). These collectives are keyed by the
  variable's ordinal and its count of reads in the traced step, not by trace order, which
  differs between a variable's owner and the others once layers are recomputed.

Gradients and updated values travel in flat buckets of about `bytes_per_pack` (25 MiB by
default), the last layers' first: each bucket's reduce-scatter waits only for its own
gradients, so it overlaps the backward pass of earlier layers. Within a bucket each
owner's part is padded to the largest, so one reduce-scatter and one all-gather serve it. On
GPUs they are NCCL collectives. On CPUs TensorFlow has no reduce-scatter: on one host the
gradients are all-reduced and each replica keeps its own (measured in
benchmarks/sharded.py); across workers each gradient is sent to its owner alone, one
variable at a time (`ShardCollectives.reduce_to_owners`), the backward pass waiting once
about a bucket is in flight (`_pace_gradients`), and stages 1-2 broadcast each updated
variable from its owner, one after another, instead of gathering buckets.
"""

import collections
import contextlib
import dataclasses
import functools
import threading
import weakref

import tensorflow as tf

from tfpar.contract import hooks_of
from tfpar.distribute.common import group_keys
from tfpar.distribute.common import owner_values
from tfpar.distribute.common.device_memory import num_bytes
from tfpar.keras import hooks as keras_hooks
from tfpar.keras import internals
from tfpar.keras import models
from tfpar.keras import steps
from tfpar.keras import tf_runtime
from tfpar.keras import tf_variables
from tfpar.keras import variable_birth
from tfpar.keras import zero_optimizers as keras_sharded
from tfpar.keras.replicas import replica_id, replica_in_sync
from tfpar.plan import sharding


class ShardOwners:
    """The owner replica of each trainable variable, assigned in the order asked.

    Owners even out bytes within a group: all variables when `group_of` is None (data
    parallelism); else the variables `group_of(variable)` gives the same key, a tuple of
    the devices of the group's replicas (a pipeline stage's R devices: each stage's
    state divided over its replicas)."""

    def __init__(self, num_replicas, group_of=None):
        self.num_replicas = num_replicas
        self._group_of = group_of
        self._lock = threading.Lock()
        self._loads = collections.defaultdict(lambda: [0] * num_replicas)  # group -> loads
        self._owner = {}  # variable key -> owner replica
        self._group = {}  # variable key -> its group (None: the only one)
        self._ordinal = {}  # variable key -> the order it was given an owner in
        self.slots = {}  # id(optimizer state variable) -> its model variable
        self.remote = set()  # ids of the stand-ins of state owned on another worker

    def owner_of(self, variable):
        key = id(variable)
        if key not in self._owner:
            group = self._group_of(variable) if self._group_of else None
            with self._lock:
                if key not in self._owner:
                    self._own(key, self._take(num_bytes(variable), group), group)
        return self._owner[key]

    def owner_if_known(self, variable):
        """`variable`'s owner replica if it was given one, else None (gives none)."""
        return self._owner.get(id(variable))

    def group_devices(self, variable):
        """The devices of `variable`'s group, one per replica (None without groups)."""
        self.owner_of(variable)
        return self._group[id(variable)]

    def ordinal_of(self, variable):
        """The order in which `variable` was given its owner: the same on every worker
        (owners are given in the same order everywhere), so it names the variable in
        collectives."""
        self.owner_of(variable)
        return self._ordinal[id(variable)]

    def _own(self, key, owner, group):
        self._owner[key] = owner
        self._group[key] = group
        self._ordinal[key] = len(self._ordinal)

    def _take(self, size, group):
        loads = self._loads[group]
        owner = sharding.next_owner(loads)
        loads[owner] += size
        return owner

    def create_owned(self, value, local_devices, first_replica, create):
        """A trainable variable (stage 3) of initial `value`, made by
        `create(initial_value)` on the device of the next owner (in the group of
        `local_devices`, with groups) when the owner is one of this worker's replicas
        (replica indices `first_replica`...); elsewhere an empty stand-in, recorded in
        `remote`."""
        group = None
        if self._group_of is not None:  # (The group of a variable made on these devices.)
            group = tuple(local_devices)
        with self._lock:
            owner = self._take(num_bytes(value), group)
        variable = self._made_on(owner, local_devices, first_replica,
                                 lambda local: create(value if local
                                                      else tf.zeros([0], value.dtype)))
        with self._lock:
            self._own(id(variable), owner, group)
        return variable

    def _made_on(self, owner, local_devices, first_replica, create):
        index = owner - first_replica
        local = 0 <= index < len(local_devices)
        with tf.device(local_devices[index if local else 0]):
            variable = create(local)
        if not local:
            with self._lock:
                self.remote.add(id(variable))
        return variable

    def known(self, variable):
        return id(variable) in self._owner

    @property
    def loads(self):
        """Bytes of trainable variables owned by each replica (over all groups)."""
        return [sum(column) for column in zip(*self._loads.values())] or [0] * self.num_replicas

    def create_slot(self, reference, local_devices, first_replica, create):
        """Optimizer state for `reference`, made by `create(initial_value=None)` on its
        owner's device when the owner is one of this worker's replicas; elsewhere an empty
        stand-in (no memory), recorded in `remote`: only the owner's worker has its value."""
        slot = self._made_on(self.owner_of(reference), local_devices, first_replica,
                             lambda local: create(None if local
                                                  else tf.zeros([0], reference.dtype)))
        with self._lock:
            self.slots[id(slot)] = reference
        return slot


def on_owner(strategy, next_creator, kwargs, local_devices, first_replica):
    """What a strategy's variable creator makes under shard=...: optimizer state
    (`slot_on_owner`) or a stage-3 variable (`parameter_on_owner`) on its owner; None
    for any other variable. `local_devices`: this worker's replica devices, the first
    being replica `first_replica`."""
    slot = slot_on_owner(strategy, next_creator, kwargs, local_devices, first_replica)
    if slot is not None:
        return slot
    return parameter_on_owner(strategy, next_creator, kwargs, local_devices, first_replica)


def slot_on_owner(strategy, next_creator, kwargs, local_devices, first_replica):
    """Under shard=..., the state a variable creator is asked for next to a trainable
    variable (Keras' optimizer slots), made on the variable's owner (or an empty stand-in
    on a worker that does not own it); None for any other variable. `local_devices`:
    this worker's replica devices, the first being replica `first_replica`."""
    reference = kwargs.get("colocate_with")
    if not (hooks_of(strategy)._tfpar_shard_stage and reference is not None
            and _is_sharded(strategy, reference)):
        return None
    kwargs = {k: v for k, v in kwargs.items() if k != "colocate_with"}

    def create(initial_value):
        if initial_value is not None:
            kwargs["initial_value"] = initial_value
        return next_creator(**kwargs)
    owners = strategy._tfpar_shard_owners
    # With groups (a pipeline's stages), the devices of the reference's stage.
    local_devices = owners.group_devices(reference) or local_devices
    return owners.create_slot(reference, local_devices, first_replica, create)


def parameter_on_owner(strategy, next_creator, kwargs, local_devices, first_replica):
    """Under shard="parameters", a trainable variable made on its owner replica only (an
    empty stand-in on a worker that does not own it); None for any other variable. Across
    workers, replicas read it through `read_parameter`."""
    if not (strategy._tfpar_shard_stage == 3 and kwargs.get("colocate_with") is None
            and kwargs.get("trainable", True)):
        return None
    # Keras passes its initial value as a tensor; a callable is called once, on every worker
    # alike (owner or not), so that random initializers draw the same numbers everywhere.
    initial = kwargs["initial_value"]
    value = tf.convert_to_tensor(initial() if callable(initial) else initial,
                                 dtype=kwargs.get("dtype"))
    variable = strategy._tfpar_shard_owners.create_owned(
        value, local_devices, first_replica,
        lambda initial_value: next_creator(**dict(kwargs, initial_value=initial_value)))
    if strategy._tfpar_gathers_parameters:
        _read_from_owner(variable, strategy, value.shape)
    return variable


_update = threading.local()  # .running: this thread applies an owner's update.


def _read_from_owner(variable, strategy, shape):
    """Makes every read of `variable` (a tensor conversion, `numpy()`) return the full
    value held by its owner (`read_parameter`), and a write to an empty stand-in a no-op.

    The variable becomes an instance of a subclass of its own class, so that what reads
    it (Keras layers, Keras' operators, TensorFlow ops) needs no change: the subclass
    only overrides how the variable turns into a tensor.
    """
    base = type(variable)
    # Fails closed before the class changes.
    tf_variables.check_converts_through_dense_var_to_tensor(base)
    owner = strategy._tfpar_shard_owners.owner_of(variable)
    stand_in = id(variable) in strategy._tfpar_shard_owners.remote
    read = functools.partial(read_parameter, strategy, variable, owner, shape)

    @internals.overrides
    class ReadFromOwner(base):
        def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
            # The owner's own update step reads its variable in place, and so does
            # tf.custom_gradient recording what a rematerialized layer read.
            if (as_ref or getattr(_update, "running", False)
                    or keras_sharded.recording_a_remat_call()):
                return super()._dense_var_to_tensor(dtype=dtype, name=name, as_ref=as_ref)
            if variable_birth.tracing_shapes():  # Keras traces shapes: any value will do.
                return tf.zeros(shape, self.dtype)
            return read()

        def numpy(self):
            return self._dense_var_to_tensor().numpy()

        def assign(self, value, use_locking=None, name=None, read_value=True):
            # (load_weights on every worker: only the owner keeps the value.)
            if stand_in:
                return None
            return super().assign(value, use_locking=use_locking, name=name,
                                  read_value=read_value)

    keras_hooks.patch_object(variable, "__class__", ReadFromOwner)


def read_parameter(strategy, variable, owner, shape):
    """The full value of a stage-3 variable held by replica `owner`, on any worker.

    In a replica of `strategy` (a step): the owner's value, broadcast from the owner; its
    gradient is reduced to the owner (`ShardCollectives.reduce_to_owner`): the parameter
    is gathered layer by layer where Keras reads it, and its gradient reduced there too
    (as FSDP does). Elsewhere (saving, `get_weights`): fetched from the owner,
    a collective that every worker makes in the same order.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.strategy is not strategy:
        if tf.inside_function():
            raise ValueError(
                "A shard='parameters' variable across workers was read inside a tf.function "
                "outside strategy.run: its value is on its owner's worker. Read it inside "
                "strategy.run, or eagerly (every worker together, as for saving).")
        return owner_values.values_of_owners(strategy, [(shape, variable.dtype)], [owner],
                                             lambda _: variable.read_value())[0]
    mine = replica_in_sync() == owner
    tag = strategy._tfpar_shard_owners.ordinal_of(variable)
    if mine:
        local = variable.read_value()
    else:
        # An empty read keeps this replica's gradient for the variable (zeros) connected
        # to it, so that every replica applies gradients to the same variables.
        with tf.device(variable.device):
            local = tf.reshape(variable.read_value(), [-1])[:0]

    @tf.custom_gradient
    def from_owner(local):
        full = strategy._tfpar_shard_collectives.broadcast(
            ctx, local if mine else None, shape, local.dtype, tag)

        def gradient(upstream):
            return strategy._tfpar_shard_collectives.reduce_to_owner(
                ctx, upstream, owner, tf.zeros_like(local), tag)

        return full, gradient

    return from_owner(local)


@internals.overrides
class OwnerPlacedVariables:
    """What a mirrored extended (one host or a worker's) does for ZeRO: state made for a
    trainable variable lives on the variable's owner only, and under shard="parameters" so
    does the trainable variable itself (on other workers an empty stand-in). Mixed in
    before TensorFlow's extended class; `_zero_local_replicas()` gives this worker's replica
    devices and the replica index of the first."""

    def _validate_colocate_with_variable(self, colocate_with_variable):
        # A stage-3 variable lives on one device, as no stock mirrored variable does.
        if not colocates_with_owned(tf_runtime.container_strategy(self),
                                    colocate_with_variable):
            super()._validate_colocate_with_variable(colocate_with_variable)

    def _create_variable(self, next_creator, **kwargs):
        devices, first = self._zero_local_replicas()
        owned = on_owner(tf_runtime.container_strategy(self), next_creator, kwargs, devices,
                         first)
        return owned if owned is not None else super()._create_variable(next_creator, **kwargs)


def colocates_with_owned(strategy, variable):
    """True for a stage-3 variable (one copy, on its owner), next to which Keras makes
    optimizer state: stock strategies accept only their mirrored variables there."""
    return (strategy._tfpar_shard_stage == 3
            and strategy._tfpar_shard_owners.known(variable))


def _is_sharded(strategy, variable):
    # A trainable variable whose state goes to one owner: mirrored (stages 1-2) or
    # already owned (stage 3).
    if strategy._tfpar_shard_owners.known(variable):
        return True
    return isinstance(variable, tf.distribute.DistributedValues) and variable.trainable


def full_state(strategy, keras_variables):
    """The optimizer's variables `keras_variables` with their full values (numpy), as one
    device would hold them, one at a time (a generator): state owned on another worker is
    fetched from its owner when its turn comes, so a checkpoint never holds more than one
    variable of it. A collective: every worker iterates it, in the same order."""
    owners = strategy._tfpar_shard_owners
    for keras_variable in keras_variables:
        variable = models.storage(keras_variable)
        if id(variable) not in owners.slots:
            yield variable.numpy()
            continue
        # (The shape from Keras: under stage 3 a reference may be an empty stand-in.)
        yield owner_values.values_of_owners(
            strategy, [(keras_variable.shape, variable.dtype)],
            [owners.owner_of(owners.slots[id(variable)])], lambda _: variable)[0].numpy()


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
        if stage < 3 and across_workers:
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
                                                         variables, groups, ordinals)
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


# Instance keys per tag: a variable read (and its gradient sent) this many times in a step
# at most.
_OCCURRENCES = 64


def _outermost_graph():
    """The function being traced (not a cond branch or loop body inside it)."""
    graph = tf.compat.v1.get_default_graph()
    while hasattr(getattr(graph, "outer_graph", None), "outer_graph"):
        graph = graph.outer_graph  # (Only a function's graph has an outer graph.)
    return graph


def _runs(tensors):
    """Makes the step run what computes `tensors` although nothing uses them: a
    replica's gradients of variables it does not own, which carry its sends to their
    owners. (TensorFlow's automatic control dependencies keep no collective broadcast
    whose value is unused: they are "async stateful" ops, pruned like pure ones.)"""
    if tensors:
        with tf.control_dependencies(tensors):
            tf.debugging.Assert(True, ["gradients sent to their owners"])


def _own_gradients(ctx, collectives, stage, grads, variables, groups, ordinals):
    """{variable index: summed gradient} for this replica's variables, the bytes of
    gradients the step keeps on the replica, and {variable index: the op that ends its
    gradient's transfer} where each is sent to its owner alone."""
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
    dtype = variables[index[0]].dtype
    if collectives.kind == "pairwise" and any(dense):
        # Each variable by its ordinal, which names its transfers on every worker.
        ordinal = {i: ordinals[i] for group in dense for i in group}
        owner_of = {ordinal[i]: owner for owner, group in enumerate(dense) for i in group}
        mine, done = collectives.reduce_to_owners(
            ctx, {ordinal[i]: grads[i] for i in ordinal}, owner_of)
        reduced.update({i: mine[ordinal[i]] for i in dense[me]})
        sent = {i: done[ordinal[i]] for group in dense for i in group}
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


class ShardCollectives:
    """Reduce-scatter and all-gather over a strategy's replicas, in replica context.

    "nccl" uses NCCL's own reduce-scatter and all-gather (collective ops with the NCCL
    hint, selected when every replica is a GPU; across workers the group spans all
    replicas, keyed by this worker's devices as TensorFlow keys its own NCCL
    all-reduce); "pairwise" (CPUs across workers) sends each gradient to its owner
    alone, each send a broadcast in a group of two replicas; "all_reduce" (CPUs of one host)
    has no reduce-scatter: gradients are all-reduced through the strategy's cross-device
    ops, each replica keeping its own. Except under "nccl" the all-gather goes through the
    strategy.
    (TensorFlow 2.21 has no CPU reduce-scatter: `CollectiveReduceScatterV2` with the
    ring hint times out, and the all-to-all ops either hang (V2) or cannot form a group
    across workers (V3); BUILD_NOTES.)
    """

    def __init__(self, kind, collective_keys=None, devices=None, timeout_seconds=None,
                 key_base=None):
        self.kind = kind
        self._keys = collective_keys
        self._devices = devices  # This worker's replica devices.
        self._timeout = timeout_seconds or 0
        self._key_base = key_base  # The strategy's block of group keys ("pairwise").
        self._lock = threading.Lock()
        # Per traced function: how many transfers of each (group, tag) a replica made.
        self._counts = weakref.WeakKeyDictionary()

    @property
    def scatters(self):
        """Whether `reduce_scatter` exists (else gradients are all-reduced)."""
        return self.kind != "all_reduce"

    def _keys_here(self):
        group = self._keys.get_group_key(self._devices)
        device = self._devices[replica_id()]
        return group, self._keys.get_instance_key(group, device)

    def reduce_scatter(self, ctx, flat):
        """Each replica's slice of the sum of `flat` over the replicas (NCCL)."""
        if self.kind != "nccl":
            raise ValueError(f"No reduce-scatter for {self.kind!r} collectives: use "
                             f"reduce_to_owners.")
        group, instance = self._keys_here()
        return tf.raw_ops.CollectiveReduceScatterV2(
            input=flat, group_size=ctx.num_replicas_in_sync, group_key=group,
            instance_key=instance, ordering_token=[], merge_op="Add", final_op="Id",
            communication_hint="nccl")

    def _instance(self, group, tag):
        """The instance key of this replica's next collective in `group` about tag `tag` (a
        variable's ordinal) in the function being traced: the same on every replica
        whatever order each traces its collectives in. (Counted in trace order, as
        TensorFlow counts its own, the keys of a recomputed layer's reads and gradients
        differed between an owner and the others: a shape mismatch across workers.)"""
        graph = _outermost_graph()
        with self._lock:
            counts = self._counts.setdefault(graph, collections.Counter())
            key = (group, tag, self._devices[replica_id()])
            counts[key] += 1
            occurrence = counts[key]
        if not tf.inside_function():  # Eager: each runs before the next starts.
            occurrence = (occurrence - 1) % (_OCCURRENCES - 1) + 1
        elif occurrence >= _OCCURRENCES:
            raise ValueError(f"More than {_OCCURRENCES - 1} reads of one sharded variable in "
                             f"one step: not supported.")
        return 1 + tag * _OCCURRENCES + occurrence

    def _send_or_receive(self, me, other, source, n, value, tag):
        """A point-to-point transfer between replicas `me` and `other`, from `source`: the
        value sent (from `me`) or received (shaped like `value`), a broadcast in their group
        of two, about tag `tag`."""
        group = group_keys.pair_key(self._key_base, min(me, other), max(me, other), n)
        common = dict(group_size=2, group_key=group, instance_key=self._instance(group, tag),
                      communication_hint="auto", timeout_seconds=self._timeout)
        if source == me:
            return tf.raw_ops.CollectiveBcastSendV2(input=value, **common)
        return tf.raw_ops.CollectiveBcastRecvV2(shape=value.shape, T=value.dtype, **common)

    def reduce_to_owners(self, ctx, values, owners):
        """{key: the sum over the replicas of values[key]} for the keys this replica owns
        (`owners[key]`; keys are the variables' ordinals), and {key: the op that ends
        that transfer here}, one variable at a time: each other replica sends its value
        to the owner alone ("pairwise" across workers on CPUs, where TensorFlow has no
        reduce-scatter). Per replica that moves what a reduce-scatter would, (n-1)/n of
        the values, and nothing is flattened or padded. (A bucketed exchange, each pair
        sending both ways, hung across workers once there were more buckets than
        workers: BUILD_NOTES.)
        """
        me = replica_in_sync()
        mine, sends, done = {}, [], {}
        for key, value in values.items():
            summed = self.reduce_to_owner(ctx, value, owners[key], tf.zeros([0], value.dtype),
                                          key)
            done[key] = summed.op if tf.inside_function() else None  # (Eager: done.)
            if owners[key] == me:
                mine[key] = summed
            else:
                sends.append(summed)
        _runs(sends)
        return mine, done

    def reduce_to_owner(self, ctx, value, owner, not_owner, tag):
        """The sum of `value` over the replicas on replica `owner`; `not_owner` on the
        others. "pairwise": each other replica sends its value to the owner alone (the bytes
        of a reduce-scatter of it), as transfers about `tag` (the variable's ordinal); else
        an all-reduce."""
        me = replica_in_sync()
        n = ctx.num_replicas_in_sync
        if self.kind != "pairwise":
            summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, value)
            return summed if me == owner else not_owner
        if me != owner:
            sent = self._send_or_receive(me, owner, me, n, value, tag)
            with tf.control_dependencies([sent]):
                return tf.identity(not_owner)
        # The owner's receives wait for its own gradient: launched when the step starts
        # they would hold their buffers through the whole forward pass.
        with tf.control_dependencies([value]):
            received = [self._send_or_receive(me, other, other, n, value, tag)
                        for other in range(n) if other != me]
        return tf.add_n([value] + received)

    def broadcast(self, ctx, value, shape, dtype, tag):
        """`value` from the one replica that passes it (the others pass None), on every
        replica: a collective broadcast over all replicas about `tag` (a variable's
        ordinal), in tfpar's own group (NCCL: keyed as the strategy keys its own)."""
        if self.kind == "nccl" or self._key_base is None:
            group, instance = self._keys_here()
        else:
            group = group_keys.broadcast_key(self._key_base)
            instance = self._instance(group, tag)
        common = dict(group_size=ctx.num_replicas_in_sync, group_key=group,
                      instance_key=instance, timeout_seconds=self._timeout,
                      communication_hint="nccl" if self.kind == "nccl" else "auto")
        if value is not None:
            return tf.raw_ops.CollectiveBcastSendV2(input=value, **common)
        return tf.raw_ops.CollectiveBcastRecvV2(shape=shape, T=dtype, **common)

    def all_gather(self, ctx, flat, n):
        if self.kind == "nccl":
            group, instance = self._keys_here()
            return tf.raw_ops.CollectiveGatherV2(
                input=flat, group_size=n, group_key=group, instance_key=instance,
                ordering_token=[], communication_hint="nccl")
        return ctx.all_gather(flat, axis=0)


class ZeroHooks:
    """What a sharding strategy (`DataParallelStrategy(shard=...)`, a pipeline's
    `PipelineStrategy(shard=...)`) answers the Keras seam with. Set up by `set_up`."""

    def _tfpar_full_optimizer_state(self, keras_variables):
        # Asked by the Keras seam when a sharded optimizer is saved across workers, and for
        # the moving averages (use_ema) that replace the weights when training ends.
        return full_state(self, keras_variables)

    def _tfpar_sharded_update(self, optimizer, grads, variables, learning_rate,
                              accumulation=None):
        # Asked by the Keras seam for an optimizer step under shard=...
        return sharded_update(self, optimizer, grads, variables, learning_rate,
                              self._tfpar_shard_stage, self._tfpar_shard_collectives,
                              self._zero_bucket_bytes, accumulation)

    # Asked by the Keras seam for gradient accumulation under shard=...
    _tfpar_accumulation = Accumulation


def set_up(strategy, num_replicas, collectives, group_of=None):
    """A strategy's ZeRO state: its owners (`ShardOwners(num_replicas, group_of)`), and
    under shard=... (`strategy._tfpar_shard_stage`) Keras' optimizers sharded and the
    collectives `collectives()` makes (a `ShardCollectives`)."""
    strategy._tfpar_shard_owners = ShardOwners(num_replicas, group_of)
    strategy._tfpar_step_shapes = StepShapes()
    if strategy._tfpar_shard_stage:
        keras_hooks.install_sharded_optimizers()
        strategy._tfpar_shard_collectives = collectives()
