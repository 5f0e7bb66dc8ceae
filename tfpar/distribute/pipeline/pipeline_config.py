"""`PipelineStrategy`'s arguments, checked and resolved into a device grid and a schedule.

`PipelineConfig.resolve` takes the strategy's arguments and refuses bad ones in a fixed
order: first those that need no device (ZeRO stage, remat, offloading, balance_by, the
schedule's name and M, the stage timeout), then, once the devices are known (the layout
map's mesh, the cluster it connects to, `tfpar.devices.resolve_devices`), the counts
that must agree with them (tensor parallelism, R x K (x T), the layout map, ZeRO over
the replicas, a schedule of the user's own). Everything but connecting to a cluster and
resolving devices is plain Python.
"""

import dataclasses

from tfpar import devices as devices_lib
from tfpar.distribute.common import layer_timing
from tfpar.distribute.pipeline import tensor_parallel as tensor_parallel_lib
from tfpar.distribute.pipeline import workers as stage_workers
from tfpar.errors import DeviceError, PlacementError, ScheduleError
from tfpar.plan import schedule as schedule_lib
from tfpar.plan import sharding


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """A `PipelineStrategy`'s arguments, checked, and the devices they resolve to."""

    shard: object  # None, "optimizer", "gradients" or "parameters", as given.
    shard_stage: int  # Its ZeRO stage (0: none).
    schedule: schedule_lib.Schedule  # Validated, for K stages.
    remat: bool
    offload_activations: object  # False, True or a device name.
    balance_by: str  # "params" or "time".
    timing_device: object  # With balance_by="time", the CPU that times layers; else None.
    stage_timeout_seconds: object
    tensor_parallel: int  # T.
    layout_map: object
    workers: object  # The cluster's tasks (StageWorkers) when stages are on other processes.
    replica_devices: object  # With workers, the devices feeding each replica; else None.
    grid: tuple  # grid[r][s]: the (first) device of stage s in replica r, canonical.
    tp_grid: tuple  # tp_grid[r][s]: the T devices of stage s in replica r.
    display: dict  # Canonical device -> its name as the user gave it.

    @property
    def num_replicas(self):
        return len(self.grid)

    @property
    def reduction_grid(self):
        """With tensor parallelism, each replica's devices, all T of each stage: a shard's
        copies live on one device of its stage in each replica, so each of a stage's T
        devices has its own reduction across the replicas. Else None."""
        if self.tensor_parallel == 1:
            return None
        return tuple(tuple(d for stage in row for d in stage) for row in self.tp_grid)

    @classmethod
    def resolve(cls, *, devices, num_micro_batches, schedule, remat, num_replicas, num_stages,
                virtual_stages, balance_by, cluster_resolver, connect_timeout_seconds,
                stage_timeout_seconds, offload_activations, shard, tensor_parallel,
                layout_map):
        """Checks `PipelineStrategy`'s arguments (see its docstring) and resolves its
        devices; with `cluster_resolver`, connects to the cluster first."""
        shard_stage = sharding.check_shard(shard)
        _check_deviceless(remat, offload_activations, balance_by, schedule, num_micro_batches,
                          virtual_stages, stage_timeout_seconds)
        devices, num_replicas, num_stages, tensor_parallel = (
            tensor_parallel_lib.degrees_of_mesh(layout_map, devices, num_replicas, num_stages,
                                                tensor_parallel, cluster_resolver is not None))
        if cluster_resolver is not None:
            cluster = stage_workers.connect(cluster_resolver, connect_timeout_seconds)
            if devices is None:
                devices = cluster.first_devices()
        resolved = devices_lib.resolve_devices(devices)
        workers = stage_workers.of_devices(resolved)
        replica_devices = (workers.replica_devices(resolved, num_replicas)
                           if workers is not None else None)
        _check_tensor_parallel(tensor_parallel, layout_map, len(resolved), num_replicas,
                               workers, schedule=schedule, balance_by=balance_by)
        num_stages, grid, tp_grid = _device_grid(resolved, num_replicas, num_stages,
                                                 tensor_parallel)
        if layout_map is not None:
            tensor_parallel_lib.check_layout_map(layout_map, tensor_parallel, num_stages,
                                                 num_replicas)
        _check_shard(shard, num_replicas, schedule, balance_by)
        schedule = _schedule_of(schedule, num_stages, num_micro_batches, virtual_stages)
        timing_device = (layer_timing.timing_device(resolved, "balance_by='params'")
                         if balance_by == "time" else None)
        given = [devices] if isinstance(devices, str) else (
            list(devices) if devices is not None else devices_lib.default_devices())
        return cls(shard=shard, shard_stage=shard_stage, schedule=schedule, remat=remat,
                   offload_activations=offload_activations, balance_by=balance_by,
                   timing_device=timing_device, stage_timeout_seconds=stage_timeout_seconds,
                   tensor_parallel=tensor_parallel, layout_map=layout_map, workers=workers,
                   replica_devices=replica_devices, grid=grid, tp_grid=tp_grid,
                   display=dict(zip(resolved, given)))


def _check_deviceless(remat, offload, balance_by, schedule, num_micro_batches, virtual_stages,
                      stage_timeout_seconds):
    """Refuses what is wrong whatever the devices, before anything touches them."""
    if not isinstance(remat, bool):
        raise ValueError(f"remat must be True or False. Received: remat={remat!r}")
    _check_offload(offload, remat)
    if balance_by not in ("params", "time"):
        raise PlacementError(f"balance_by must be 'params' or 'time'. Received: "
                             f"balance_by={balance_by!r}")
    # Validates M and the schedule's name (K is checked with the devices).
    if not isinstance(schedule, schedule_lib.Schedule):
        schedule_lib.make_schedule(schedule, 1, num_micro_batches, virtual_stages)
    if stage_timeout_seconds is not None and (
            isinstance(stage_timeout_seconds, bool)
            or not isinstance(stage_timeout_seconds, (int, float))
            or not stage_timeout_seconds > 0):
        raise ValueError(f"stage_timeout_seconds must be a number of seconds > 0, or None "
                         f"to wait for a silent stage worker without end. Received: "
                         f"stage_timeout_seconds={stage_timeout_seconds!r}")


def _device_grid(resolved, num_replicas, num_stages, tensor_parallel):
    """(K, grid, tp_grid) of the resolved devices, R x K x T of them, replica-major, then
    stage, then the model axis: `tp_grid[r][s]` the T devices of stage s in replica r,
    `grid[r][s]` the first of them."""
    groups = [resolved[i:i + tensor_parallel] for i in range(0, len(resolved), tensor_parallel)]
    firsts = [group[0] for group in groups]
    num_stages = _stage_count(len(firsts), num_replicas, num_stages, tensor_parallel)
    tp_grid = tuple(tuple(tuple(groups[r * num_stages + s]) for s in range(num_stages))
                    for r in range(num_replicas))
    grid = tuple(firsts[r * num_stages:(r + 1) * num_stages] for r in range(num_replicas))
    return num_stages, grid, tp_grid


def _schedule_of(schedule, num_stages, num_micro_batches, virtual_stages):
    """The validated schedule: built from its name, or a user's `Schedule`, which must
    fit the strategy (its stages, micro-batches and virtual stages)."""
    if not isinstance(schedule, schedule_lib.Schedule):
        built = schedule_lib.make_schedule(schedule, num_stages, num_micro_batches,
                                           virtual_stages)
        schedule_lib.validate(built)
        return built
    for what, theirs, ours in (("num_stages", schedule.num_stages, num_stages),
                               ("num_micro_batches", schedule.num_micro_batches,
                                num_micro_batches),
                               ("virtual_stages", schedule.virtual_stages, virtual_stages)):
        if theirs != ours:
            raise ScheduleError(
                f"The schedule {schedule.name!r} has {what}={theirs}, but the strategy has "
                f"{what}={ours}: pass {what}={theirs} to PipelineStrategy, or build the "
                f"schedule for {ours}.")
    schedule_lib.validate(schedule)
    return schedule


def _stage_count(num_groups, num_replicas, num_stages, tensor_parallel=1):
    """The number of stages of `num_groups` groups of `tensor_parallel` devices (one group
    per stage of each replica); errors count devices, as the user passed them."""
    if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
        raise DeviceError(f"num_replicas must be an integer >= 1. Received: {num_replicas!r}")
    num_devices = num_groups * tensor_parallel
    times_t = f" x {tensor_parallel}" if tensor_parallel > 1 else ""
    if num_stages is None:
        if num_groups % num_replicas:
            raise DeviceError(
                f"{num_devices} devices do not split into {num_replicas} pipeline replicas of "
                f"equal length: num_replicas x num_stages{' x tensor_parallel' * bool(times_t)}"
                f" must equal the number of devices. Use a multiple of "
                f"{num_replicas * tensor_parallel} devices, or another num_replicas.")
        return num_groups // num_replicas
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise DeviceError(f"num_stages must be an integer >= 1 or None. Received: {num_stages!r}")
    if num_stages * num_replicas != num_groups:
        needed = num_replicas * num_stages * tensor_parallel
        raise DeviceError(
            f"num_replicas x num_stages{' x tensor_parallel' * bool(times_t)} "
            f"({num_replicas} x {num_stages}{times_t} = {needed}) must equal the number of "
            f"devices ({num_devices}): each pipeline replica runs one stage per "
            f"{'group of tensor_parallel devices' if times_t else 'device'}. Pass {needed} "
            f"devices, or num_stages=None.")
    return num_stages


def _check_shard(shard, num_replicas, schedule, balance_by):
    """Refuses what ZeRO over a pipeline's replicas cannot do, saying what to use."""
    if not shard:
        return
    if num_replicas < 2:
        raise ValueError(
            f"shard={shard!r} divides each stage's state over the stage's num_replicas "
            f"copies; with num_replicas={num_replicas} there is one copy and nothing to "
            f"divide. Pass num_replicas=2 or more (num_replicas x num_stages devices), or "
            f"drop shard.")
    name = schedule.name if isinstance(schedule, schedule_lib.Schedule) else schedule
    if name == "2bw":
        raise ValueError(
            f"schedule='2bw' keeps an older copy of every weight next to each replica's "
            f"copy, which shard={shard!r} does not divide. Use schedule='1f1b' (the same "
            f"order and bubble) with shard, or schedule='2bw' without shard.")
    if shard == "parameters" and balance_by == "time":
        raise ValueError(
            "shard='parameters' makes each variable on its owner's stage device when the "
            "model is placed; balance_by='time' times layers before that, on another "
            "device. Use balance_by='params' or tfpar.layers.StageBoundary markers.")


def _check_tensor_parallel(tensor_parallel, layout_map, num_devices, num_replicas, workers,
                           **others):
    """Refuses tensor parallelism that is not asked for clearly, or that is combined with
    what it does not run with yet."""
    if (not isinstance(tensor_parallel, int) or isinstance(tensor_parallel, bool)
            or tensor_parallel < 1):
        raise ValueError(f"tensor_parallel must be an integer >= 1 (the devices each stage is "
                         f"split over). Received: tensor_parallel={tensor_parallel!r}")
    if tensor_parallel == 1:
        if layout_map is not None:
            mesh = getattr(layout_map, "device_mesh", None)
            sizes = dict(zip(mesh.axis_names, mesh.shape)) if mesh is not None else {}
            size = sizes.get("model", "T (e.g. 2)")
            raise ValueError(
                f"layout_map says how each stage's layers are split over its "
                f"tensor_parallel devices, but tensor_parallel=1 (one device per stage). "
                f"Pass tensor_parallel={size}, or drop layout_map.")
        return
    if layout_map is None:
        raise ValueError(
            f"tensor_parallel={tensor_parallel} needs a layout_map saying which layers to "
            f"split, e.g. layout_map['.*mlp_in/kernel'] = (None, 'model') (column) and "
            f"layout_map['.*mlp_out/kernel'] = ('model', None) (row).")
    if num_devices % tensor_parallel:
        raise DeviceError(
            f"{num_devices} devices do not make stages of tensor_parallel={tensor_parallel} "
            f"devices: pass num_replicas x num_stages x tensor_parallel devices.")
    unsupported = {
        "balance_by": (others["balance_by"] != "params", "balance_by='time'"),
        "schedule": ((others["schedule"].name if isinstance(others["schedule"],
                                                            schedule_lib.Schedule)
                      else others["schedule"]) == "2bw",
                     "schedule='2bw' (its older copy of the weights is not split)"),
    }
    for name, (given, what) in unsupported.items():
        if given:
            raise ValueError(
                f"tensor_parallel={tensor_parallel} does not run with {what} yet ({name}="
                f"{others[name]!r}): "
                f"drop {name}, or tensor_parallel.")


def _check_offload(offload, remat):
    if offload is False or offload is None:
        return
    if not (offload is True or isinstance(offload, str)):
        raise ValueError(f"offload_activations must be True, False or a device name such as "
                         f"'/job:chief/replica:0/task:0/device:CPU:0'. Received: "
                         f"offload_activations={offload!r}")
    if not remat:
        raise ValueError(
            "offload_activations needs remat=True: it moves what remat keeps (each stage's "
            "input per micro-batch) to host memory. Without remat a stage keeps every "
            "intermediate activation inside TensorFlow's gradient graph, which cannot be "
            "moved. Pass remat=True, offload_activations=... .")
