"""Strategy by name, for binaries and the launcher."""

STRATEGIES = ("data", "ps")


def make_strategy(name, num_devices=None, communication="auto", timeout_seconds=None,
                  ps_mode="async"):
    """Builds the tfpar strategy called `name` over the first `num_devices` devices.

    "ps" is parameter-server training on the TF_CONFIG cluster (`ps_mode` "async" or
    "sync"); its devices are the cluster's, so `num_devices` does not apply.

    In a TF_CONFIG cluster of several workers each worker uses all its local devices
    and `num_devices` is ignored. On one host with no GPU, `num_devices` logical CPUs
    are made first (so call this before TensorFlow initializes its devices).
    """
    if name not in STRATEGIES:
        raise ValueError(
            f"Unknown strategy {name!r}. Use one of: {', '.join(STRATEGIES)}.")
    if name == "ps":
        from tfpar.distribute.parameter_server import ParameterServerStrategy

        return ParameterServerStrategy(mode=ps_mode)
    from tfpar import devices as devices_lib
    from tfpar.distribute.data_parallel import DataParallelStrategy
    from tfpar.distribute.multi_worker import cluster_worker_count

    if cluster_worker_count() > 1:  # TF_CONFIG names several workers
        return DataParallelStrategy(communication=communication, timeout_seconds=timeout_seconds)
    import tensorflow as tf

    if num_devices is not None and not tf.config.list_physical_devices("GPU"):
        devices_lib.virtual_cpus(num_devices)
    devices = devices_lib.default_devices()
    if num_devices is not None:
        if num_devices < 1 or num_devices > len(devices):
            raise ValueError(
                f"num_devices={num_devices} but this host has {len(devices)} device(s) "
                f"({', '.join(devices)}). Ask for between 1 and {len(devices)}.")
        devices = devices[:num_devices]
    return DataParallelStrategy(devices=devices, communication=communication)
