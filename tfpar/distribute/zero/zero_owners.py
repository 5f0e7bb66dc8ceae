"""ZeRO's owners: each trainable variable's owner replica, and the optimizer state made
on it (at stage 3 the variable itself too), with full values of that state for saving."""

import collections
import threading

import tensorflow as tf

from tfpar.contract import hooks_of
from tfpar.distribute.common import owner_values
from tfpar.distribute.common.device_memory import num_bytes
from tfpar.distribute.zero.zero_reads import _read_from_owner
from tfpar.keras import internals
from tfpar.keras import models
from tfpar.keras import tf_runtime
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
