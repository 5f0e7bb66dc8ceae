"""Strategy by name, for binaries and the launcher; the strategy an advice names."""

STRATEGIES = ("data", "ps", "model", "pipeline", "auto")


class AutoError(ValueError):
    """`--strategy=auto` cannot build what the advisor chose (or nothing fits)."""


def from_advice(advice):
    """The `make_strategy` name and keyword arguments of the layout `advice`
    (`tfpar.plan.advise`) chose: ("data", {"shard": ...}) for data parallelism and ZeRO,
    ("pipeline", {"num_stages", "num_replicas", "shard"[, "tensor_parallel"]}) for a
    pipeline (with data parallelism over its replicas) or tensor parallelism (the caller
    adds the `layout_map` of its model).

    An `AutoError` when nothing fits: `auto` never trains a layout that does not.

    >>> from tfpar.plan import advise
    >>> from_advice(advise(1000, 4, 10_000))
    ('data', {'shard': 'optimizer'})
    """
    chosen = advice.chosen
    if chosen is None:
        raise AutoError(f"--strategy=auto: no layout fits. {advice._reason()}")
    shard = chosen.config.shard
    if chosen.pipe == 1 and chosen.model == 1:
        return "data", {"shard": shard}
    kwargs = {"num_stages": chosen.pipe, "num_replicas": chosen.data, "shard": shard}
    if chosen.model > 1:
        kwargs["tensor_parallel"] = chosen.model
    return "pipeline", kwargs


def make_strategy(name, num_devices=None, communication="auto", timeout_seconds=None,
                  ps_mode="async", pipeline=None, shard=None, compression=None, sync_every=1):
    """Builds the tfpar strategy called `name` over the first `num_devices` devices.

    "ps" is parameter-server training on the TF_CONFIG cluster (`ps_mode` "async" or
    "sync"); its devices are the cluster's, so `num_devices` does not apply.
    "model" is `ModelParallelStrategy` (balanced layer placement) on one host.
    "pipeline" is `PipelineStrategy` on one host, or, on the chief of a TF_CONFIG cluster
    without ps tasks (`tfpar launch --workers N --coordinator`), one stage per worker task
    (`num_devices` does not apply); `pipeline` is a dict of its keyword arguments
    (num_micro_batches, schedule, remat, num_replicas, num_stages, virtual_stages, shard,
    tensor_parallel, layout_map).
    `shard`, `compression`, `sync_every`: for "data", `DataParallelStrategy`'s (ZeRO's stage,
    the gradients' wire type, the steps between averagings); refused for the others.
    "auto" is resolved by the caller (`from_advice`), not here.

    In a TF_CONFIG cluster of several workers each worker uses all its local devices
    and `num_devices` is ignored. On one host with no GPU, `num_devices` logical CPUs
    are made first (so call this before TensorFlow initializes its devices).
    """
    if name not in STRATEGIES:
        raise ValueError(
            f"Unknown strategy {name!r}. Use one of: {', '.join(STRATEGIES)}.")
    if compression and name != "data":
        raise ValueError(f"compression={compression!r} is for the data strategy; "
                         f"strategy {name!r} sums its gradients in full precision.")
    if sync_every != 1 and name != "data":
        raise ValueError(f"sync_every={sync_every!r} is for the data strategy; strategy "
                         f"{name!r} sums its gradients every step.")
    if name == "auto":
        raise ValueError("make_strategy('auto'): resolve the advice first with "
                         "from_advice(tfpar.plan.advise(...)), then build that name.")
    if name == "ps":
        from tfpar.distribute.parameter_server.parameter_server_strategy import ParameterServerStrategy

        return ParameterServerStrategy(mode=ps_mode)
    if name == "model":
        from tfpar.distribute.model_parallel.model_parallel_strategy import ModelParallelStrategy

        return ModelParallelStrategy(_local_devices(num_devices))
    if name == "pipeline":
        from tfpar.cluster.tf_config import parse_tf_config
        from tfpar.distribute.pipeline.pipeline_strategy import PipelineStrategy

        config = parse_tf_config()
        if config is not None and config.task_type == "chief" and not config.num_ps:
            import tensorflow as tf

            return PipelineStrategy(
                cluster_resolver=tf.distribute.cluster_resolver.TFConfigClusterResolver(),
                **(pipeline or {}))
        return PipelineStrategy(_local_devices(num_devices), **(pipeline or {}))
    from tfpar.distribute.data_parallel.data_parallel_strategy import DataParallelStrategy
    from tfpar.distribute.data_parallel.multi_worker import cluster_worker_count

    if cluster_worker_count() > 1:  # TF_CONFIG names several workers
        return DataParallelStrategy(communication=communication, timeout_seconds=timeout_seconds,
                                    shard=shard, compression=compression, sync_every=sync_every)
    return DataParallelStrategy(devices=_local_devices(num_devices), communication=communication,
                                shard=shard, compression=compression, sync_every=sync_every)


def _local_devices(num_devices):
    """The first `num_devices` devices of this host (logical CPUs made when there is no GPU)."""
    import tensorflow as tf

    from tfpar import devices as devices_lib

    if num_devices is not None and not tf.config.list_physical_devices("GPU"):
        devices_lib.virtual_cpus(num_devices)
    devices = devices_lib.default_devices()
    if num_devices is not None:
        if num_devices < 1 or num_devices > len(devices):
            raise ValueError(
                f"num_devices={num_devices} but this host has {len(devices)} device(s) "
                f"({', '.join(devices)}). Ask for between 1 and {len(devices)}.")
        devices = devices[:num_devices]
    return devices
