"""Device discovery and logical CPUs, so multi-device code runs without GPUs."""

from tfpar.errors import DeviceError, InitializationError


def virtual_cpus(n, one_core_each=False):
    """Splits the host CPU into `n` logical devices `/CPU:0` .. `/CPU:n-1`.

    Call it before TensorFlow initializes its devices (before any op, strategy
    or model is created). Calling it again with the same `n` is a no-op. It also
    selects the CPU allocator that keeps memory statistics on any CPU
    (`tfpar.process_memory`; see `tfpar.cluster.memory_probe.allocator_statistics_env`).

    Args:
      n: number of logical CPU devices.
      one_core_each: make each logical device behave like one core: one thread
        per op (intra-op 1) and at least `n` ops at once (inter-op >= n), so
        that work placed on two devices runs on two cores. For benchmarks.

    Returns:
      The logical CPU device names.

    Examples:
      >>> import tfpar
      >>> tfpar.virtual_cpus(2)  # doctest: +SKIP
      ['/device:CPU:0', '/device:CPU:1']
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"virtual_cpus(n) needs an integer n >= 1. Received: n={n!r}")
    from tfpar.cluster.memory_probe import use_allocator_statistics

    use_allocator_statistics()
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        if one_core_each:
            tf.config.threading.set_intra_op_parallelism_threads(1)
            tf.config.threading.set_inter_op_parallelism_threads(max(n, 2))
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    except RuntimeError as error:
        have = [d.name for d in tf.config.list_logical_devices("CPU")]
        same_threads = not one_core_each or (
            tf.config.threading.get_intra_op_parallelism_threads() == 1)
        if len(have) == n and same_threads:
            return have
        raise InitializationError(
            f"tfpar.virtual_cpus({n}) must be called before TensorFlow initializes its "
            f"devices, but TensorFlow already runs with {len(have)} logical CPU(s)"
            f"{'' if same_threads else ' and other thread settings'}. Call it at the top "
            f"of your program, before creating any tensor, model or strategy.") from error
    # Listing logical devices would initialize TensorFlow, and a multi-worker
    # strategy created afterwards must still be able to configure collectives.
    return [f"/device:CPU:{i}" for i in range(n)]


def default_devices():
    """All GPUs of this process, or all its logical CPUs when it has no GPU (devices of
    other tasks, visible after `tf.config.experimental_connect_to_cluster`, are not)."""
    import tensorflow as tf

    host = host_task()
    gpus, cpus = ([d.name for d in tf.config.list_logical_devices(kind)
                   if task_of(d.name) == host] for kind in ("GPU", "CPU"))
    return gpus or cpus


def host_task():
    """This process's task, '/job:localhost/replica:0/task:0' outside a cluster (e.g.
    '/job:chief/replica:0/task:0' once connected to one). Initializes TensorFlow."""
    import tensorflow as tf

    # TensorFlow lists this process's devices first (device_util.canonicalize relies on it).
    return task_of(tf.config.list_logical_devices("CPU")[0].name)


def task_of(device):
    """'/job:worker/replica:0/task:1' for '/job:worker/task:1/device:CPU:0'; a device that
    names no job ('/gpu:0') is this process's."""
    import tensorflow as tf

    from tfpar.keras.tf_runtime import canonical_device

    spec = tf.DeviceSpec.from_string(canonical_device(device))
    return f"/job:{spec.job}/replica:{spec.replica}/task:{spec.task}"


def spans_tasks(devices):
    """Whether `devices` belong to more than one process (task)."""
    return len({task_of(d) for d in devices}) > 1


def host_of(device):
    """The CPU of `device`'s task ('/job:worker/replica:0/task:1/device:CPU:0' for that
    task's GPU:0): where the host memory next to a device is. A CPU's host is its task's
    CPU:0."""
    return f"{task_of(device)}/device:CPU:0"


def spare_cpu(devices):
    """The first logical CPU of this process that is none of `devices`, canonical; None if
    `devices` take them all."""
    import tensorflow as tf

    from tfpar.keras.tf_runtime import canonical_device as canonicalize

    taken = {canonicalize(d) for d in devices}
    host = host_task()
    spare = [canonicalize(d.name) for d in tf.config.list_logical_devices("CPU")
             if canonicalize(d.name) not in taken and task_of(d.name) == host]
    return spare[0] if spare else None


def logical_gpu_owners():
    """The physical GPU of each logical GPU TensorFlow will make, in logical order.

    Hidden GPUs (`tf.config.set_visible_devices`) have none; a GPU split into logical
    GPUs (`set_logical_device_configuration`) owns several. Reads the configuration
    only, so it can run before TensorFlow starts (as multi-worker strategies must).
    """
    import tensorflow as tf

    owners = []
    for gpu in tf.config.get_visible_devices("GPU"):
        logical = tf.config.get_logical_device_configuration(gpu)
        owners.extend([gpu.name] * (len(logical) if logical else 1))
    return owners


def physical_gpus_of(devices, host=None):
    """For each device, the physical GPU it runs on, or None when it is no GPU.

    `host`: this process's task (`host_task()`); a GPU of another task gets None (its
    configuration is that task's, not known here). None: every device is this process's.
    """
    import tensorflow as tf

    owners = logical_gpu_owners()
    physical = []
    for device in devices:
        spec = tf.DeviceSpec.from_string(device)
        is_gpu = (spec.device_type or "").upper() == "GPU" and (
            host is None or task_of(device) == host)
        index = spec.device_index or 0
        physical.append(owners[index] if is_gpu and index < len(owners) else None)
    return physical


def device_type(device):
    """'GPU', 'CPU', ... for a device string such as '/gpu:1'."""
    import tensorflow as tf

    return (tf.DeviceSpec.from_string(device).device_type or "").upper()


def resolve_devices(devices):
    """Validates a device list and returns it canonical ('/job:localhost/.../device:CPU:0').

    Devices of other tasks ('/job:worker/replica:0/task:1/device:CPU:0') are valid once
    this process is connected to their cluster (`tf.config.experimental_connect_to_cluster`).

    Raises:
      DeviceError: a device is malformed, does not exist, or is listed twice.
    """
    import tensorflow as tf

    from tfpar.keras.tf_runtime import canonical_device as canonicalize

    if devices is None:
        devices = default_devices()
    if isinstance(devices, str):
        devices = [devices]
    devices = list(devices)
    if not devices:
        raise DeviceError("The device list is empty. Pass devices=None to use all devices.")
    available = {}
    for kind in ("CPU", "GPU"):
        for d in tf.config.list_logical_devices(kind):
            available[canonicalize(d.name)] = d.name
    canonical = []
    for device in devices:
        try:
            spec = tf.DeviceSpec.from_string(device)
        except (ValueError, TypeError) as error:
            raise DeviceError(
                f"Malformed device {device!r}: use a name like '/cpu:0' or '/gpu:1'.") from error
        if not spec.device_type:
            raise DeviceError(f"Device {device!r} names no device type: use '/cpu:0' or '/gpu:1'.")
        name = canonicalize(device)
        if name not in available:
            if spec.job not in (None, "localhost"):
                raise DeviceError(
                    f"Device {device!r} is not a device of this process or of a cluster it "
                    f"is connected to. Available devices: {', '.join(available.values())}. "
                    f"Connect first (tfpar.PipelineStrategy(cluster_resolver=...) does, or "
                    f"tf.config.experimental_connect_to_cluster), and check the task index.")
            raise DeviceError(
                f"Device {device!r} does not exist on this host. Available devices: "
                f"{', '.join(available.values())}. For more logical CPUs, call "
                f"tfpar.virtual_cpus(n) before TensorFlow starts.")
        if name in canonical:
            raise DeviceError(
                f"Device {device!r} is listed twice in {devices!r}: each replica needs "
                f"its own device.")
        canonical.append(name)
    return tuple(canonical)
