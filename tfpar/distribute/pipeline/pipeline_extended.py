"""The extended part of `PipelineStrategy`: a mirrored strategy with one reduction per stage.

A pipeline's variables are mirrored over its R replicas, each copy on its stage's device in
that replica (`mirrored_placement`). A gradient's R copies then live on one stage's devices,
and are all-reduced by that stage's own cross-device ops (`stage_reductions`: NCCL when
they are GPUs, peer collectives across processes), not by the strategy's.
"""

# pylint: disable=protected-access

import dataclasses

import tensorflow as tf

from tfpar import devices as devices_lib
from tfpar.distribute.common.cross_device import make_cross_device_ops
from tfpar.distribute.common.placed_call import canonical_device
from tfpar.distribute.pipeline import mirrored_placement
from tfpar.distribute.zero import zero_owners
from tfpar.keras import internals
from tfpar.keras import tf_runtime
from tfpar.keras import tf_variables
from tfpar.keras import variable_birth
from tfpar.plan.communication import select_communication


@dataclasses.dataclass(frozen=True)
class StageReduction:
    """How one stage's gradients are all-reduced across its copies in the R replicas."""

    devices: tuple  # The stage's device in each replica, canonical.
    communication: str  # "nccl" when they are all GPUs (see select_communication).
    ops: object  # The tf.distribute.CrossDeviceOps doing it.


def stage_reductions(grid, collective_keys):
    """One `StageReduction` per stage of `grid[replica][stage]` devices."""
    reductions = []
    for s in range(len(grid[0])):
        devices = tuple(canonical_device(row[s]) for row in grid)
        # A stage's copies on several processes: peer collectives (ring, or NCCL's on GPUs).
        communication = select_communication(
            "auto", [devices_lib.device_type(d) for d in devices],
            multi_worker=devices_lib.spans_tasks(devices),
            physical_gpus=devices_lib.physical_gpus_of(devices, host=devices_lib.host_task()))
        reductions.append(StageReduction(devices, communication, make_cross_device_ops(
            communication, devices, collective_keys)))
    return reductions


@internals.overrides
class _PipelineExtended(tf_runtime.mirrored_extended()):
    """A mirrored strategy over the replicas' first devices, with one reduction per stage.

    Variables are mirrored over the replicas; placement moves each copy to its
    stage's device. A gradient's copies then live on one stage's R devices, and
    are reduced by that stage's cross-device ops.
    """

    def __init__(self, container_strategy, grid, reduction_grid=None, replica_devices=None):
        self._grid = grid
        self._reduction_grid = reduction_grid or grid
        self._own_replica_devices = replica_devices is not None
        super().__init__(container_strategy,
                         devices=replica_devices or [row[0] for row in grid])

    def _initialize_strategy(self, devices):
        super()._initialize_strategy(devices)
        reductions = stage_reductions(self._grid, tf_runtime.collective_keys(self))
        self.stage_communication = {s: r.communication for s, r in enumerate(reductions)}
        self._stage_ops = {r.devices: r.ops for r in reductions}
        if self._reduction_grid is not self._grid:  # Tensor parallelism: one per device.
            self._stage_ops.update({r.devices: r.ops for r in stage_reductions(
                self._reduction_grid, tf_runtime.collective_keys(self))})
        # Stage 0's devices are the replicas', or the replicas are this process's CPUs (an
        # add on one of them: TensorFlow's default, collectives, do not run there once
        # this process has joined a cluster).
        tf_runtime.set_cross_device_ops(self, tf.distribute.ReductionToOneDevice()
                                        if self._own_replica_devices else reductions[0].ops)

    def _get_cross_device_ops(self, value):
        ops = super()._get_cross_device_ops(value)
        if (ops is not tf_runtime.cross_device_ops(self)
                or not isinstance(value, tf.distribute.DistributedValues)):
            return ops  # XLA or int32: TensorFlow's own choice.
        devices = tuple(canonical_device(v.device) for v in value.values)
        return self._stage_ops.get(devices, ops)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        # Gradients of different stages live on different devices: reduce each
        # stage's group with that stage's ops.
        groups = {}
        for i, (value, _) in enumerate(value_destination_pairs):
            ops = self._get_cross_device_ops(value)
            groups.setdefault(id(ops), (ops, []))[1].append(i)
        results = [None] * len(value_destination_pairs)
        for ops, indices in groups.values():
            reduced = ops.batch_reduce(
                reduce_op, [value_destination_pairs[i] for i in indices],
                options=tf_runtime.communication_options(self).merge(options))
            for i, value in zip(indices, reduced):
                results[i] = value
        return results

    def _validate_colocate_with_variable(self, colocate_with_variable):
        # A stage-3 variable lives on one device, as no stock MirroredStrategy variable does.
        if not zero_owners.colocates_with_owned(tf_runtime.container_strategy(self),
                                                colocate_with_variable):
            super()._validate_colocate_with_variable(colocate_with_variable)

    def _create_variable(self, next_creator, **kwargs):
        colocate_with = kwargs.get("colocate_with")
        home = variable_birth.current_variable_home()  # Where tfpar says it is born.
        if (home is None and colocate_with is None and kwargs.get("trainable", True)
                and tf_runtime.container_strategy(self)._tfpar_shard_stage == 3):
            home = tf_runtime.container_strategy(self)._default_home  # (A variable of no layer.)
        copies = None
        if colocate_with is None and home is not None:
            # MirroredExtended makes one copy per device of what it colocates with.
            copies = tuple(map(canonical_device, home * len(self._grid) if len(home) == 1
                               else home))
        # Under shard=...: optimizer state on its variable's owner among the stage's
        # devices; under shard="parameters", a trainable variable on its owner only.
        owned = zero_owners.on_owner(tf_runtime.container_strategy(self), next_creator, kwargs,
                                     copies, 0)
        if owned is not None:
            return owned
        if copies is not None:
            kwargs["colocate_with"] = tf_variables.colocate_with_devices(copies)
        variable = super()._create_variable(next_creator, **kwargs)
        if copies is not None:
            tf_variables.check_copies_on(mirrored_placement.devices_of(variable), copies)
        distributed_variable = tf_variables.distributed_variable_class()
        if isinstance(colocate_with, distributed_variable) and isinstance(
                variable, distributed_variable):
            # Optimizer state: when placement later moves `colocate_with`, it follows.
            variable._tfpar_colocated_with = colocate_with
        return variable

    def follow_colocated(self, optimizer):
        """Moves optimizer state created next to a variable that has since moved."""
        for variable in getattr(optimizer, "variables", ()):
            distributed = mirrored_placement.distributed_value(variable)
            target = getattr(distributed, "_tfpar_colocated_with", None)
            if target is not None and (mirrored_placement.devices_of(target)
                                       != mirrored_placement.devices_of(variable)):
                mirrored_placement.move_copies(variable, mirrored_placement.devices_of(target))
