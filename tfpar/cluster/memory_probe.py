"""What this process really holds: TensorFlow's allocator and the operating system's count.

A memory claim is a measured peak, not a sum of variable sizes. Per process there are two
peaks: TensorFlow's allocator (`tf.config.experimental.get_memory_info`, which works on
CPU; all logical CPUs of one process share one allocator, so per-device figures need one
process per device) and the resident set (Linux's VmHWM: everything, TensorFlow's
libraries, Python and buffers outside the allocator included).

    import tfpar
    tfpar.reset_memory_peaks()
    model.fit(dataset, epochs=1)
    print(tfpar.process_memory().format())
"""

import dataclasses
import resource

_STATUS = "/proc/self/status"


@dataclasses.dataclass(frozen=True)
class ProcessMemory:
    """Bytes this process holds now and at its peak.

    >>> ProcessMemory(1 << 20, 3 << 20, 600 << 20, 900 << 20).format()
    'allocator 1.0 MiB (peak 3.0 MiB), resident 600.0 MiB (peak 900.0 MiB)'
    """

    allocator_bytes: int
    allocator_peak_bytes: int
    rss_bytes: int
    rss_peak_bytes: int

    def format(self):
        mib = 1 << 20
        return (f"allocator {self.allocator_bytes / mib:.1f} MiB (peak "
                f"{self.allocator_peak_bytes / mib:.1f} MiB), resident "
                f"{self.rss_bytes / mib:.1f} MiB (peak {self.rss_peak_bytes / mib:.1f} MiB)")


def _status_kib(field):
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def resident_bytes():
    """(current, peak) resident bytes of this process. Without /proc (not Linux) the
    current figure is the peak, from getrusage."""
    peak = _status_kib("VmHWM")
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak * 1024, peak * 1024
    return (_status_kib("VmRSS") or 0) * 1024, peak * 1024


def process_memory(device="CPU:0"):
    """A `ProcessMemory` of this process now: `device`'s allocator (the one every logical
    CPU of the process shares, by default) and the resident set."""
    import tensorflow as tf

    info = tf.config.experimental.get_memory_info(device)
    rss, rss_peak = resident_bytes()
    return ProcessMemory(int(info["current"]), int(info["peak"]), rss, rss_peak)


def reset_memory_peaks(device="CPU:0"):
    """Starts both peaks again from what is held now: the allocator's, and the resident
    set's (Linux: writing 5 to /proc/self/clear_refs; elsewhere the resident peak cannot
    be reset, and stays the process's)."""
    import tensorflow as tf

    tf.config.experimental.reset_memory_stats(device)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
