"""Strategy by name, for binaries and the launcher."""

STRATEGIES = ("data",)


def make_strategy(name, num_devices=None, communication="auto"):
    """Builds the tfpar strategy called `name` over the first `num_devices` devices.

    Call `tfpar.virtual_cpus` first when running on CPUs only.
    """
    if name not in STRATEGIES:
        raise ValueError(
            f"Unknown strategy {name!r}. Use one of: {', '.join(STRATEGIES)}.")
    from tfpar import devices as devices_lib
    from tfpar.distribute.data_parallel import DataParallelStrategy

    devices = devices_lib.default_devices()
    if num_devices is not None:
        if num_devices < 1 or num_devices > len(devices):
            raise ValueError(
                f"num_devices={num_devices} but this host has {len(devices)} device(s) "
                f"({', '.join(devices)}). Ask for between 1 and {len(devices)}.")
        devices = devices[:num_devices]
    return DataParallelStrategy(devices=devices, communication=communication)
