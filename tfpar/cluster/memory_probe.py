"""What this process really holds: TensorFlow's allocator and the operating system's count.

A memory claim is a measured peak, not a sum of variable sizes. Per process there are two
peaks: TensorFlow's allocator (`tf.config.experimental.get_memory_info`; all logical CPUs of
one process share one allocator, so per-device figures need one process per device) and the
resident set (Linux's VmHWM: everything, TensorFlow's libraries, Python and buffers outside
the allocator included).

TensorFlow's default CPU allocator keeps statistics only when oneDNN's optimizations are on,
which TensorFlow enables by default on some CPUs only (none on an AMD EPYC without AVX-512).
Its BFC allocator keeps them on every CPU, so tfpar selects it (`allocator_statistics_env`)
in every process it configures before TensorFlow starts: `tfpar.virtual_cpus`, the tasks of
`tfpar launch`, and these probes when they are the first to touch TensorFlow. Where
statistics still cannot be had (TensorFlow started earlier, or `TF_CPU_ALLOCATOR_USE_BFC=false`
without oneDNN), the allocator figures are None and the resident set is reported, labelled so.

    import tfpar
    tfpar.reset_memory_peaks()
    model.fit(dataset, epochs=1)
    print(tfpar.process_memory().format())
"""

import dataclasses
import os
import resource

_STATUS = "/proc/self/status"
_MIB = 1 << 20

# TensorFlow reads both when it creates its CPU allocator (process_state.cc). Its BFC
# allocator for CPUs stops at 64 GiB unless told a limit: tfpar gives it the host's memory.
USE_BFC = "TF_CPU_ALLOCATOR_USE_BFC"
BFC_LIMIT_MIB = "TF_CPU_BFC_MEM_LIMIT_IN_MB"


def allocator_statistics_env(environ=None):
    """The variables to add to `environ` (default: this process's) so that a TensorFlow
    started with them keeps allocator statistics on any CPU: TensorFlow's BFC allocator for
    CPU memory, limited by the host's physical memory. Variables `environ` sets already are
    left as they are (`TF_CPU_ALLOCATOR_USE_BFC=false` opts out).

    >>> allocator_statistics_env({"TF_CPU_ALLOCATOR_USE_BFC": "false"})
    {}
    >>> sorted(allocator_statistics_env({}))
    ['TF_CPU_ALLOCATOR_USE_BFC', 'TF_CPU_BFC_MEM_LIMIT_IN_MB']
    """
    environ = os.environ if environ is None else environ
    if USE_BFC in environ:
        return {}
    added = {USE_BFC: "true"}
    physical = _physical_memory_mib()
    if BFC_LIMIT_MIB not in environ and physical:
        added[BFC_LIMIT_MIB] = str(physical)
    return added


def use_allocator_statistics():
    """Sets `allocator_statistics_env()` in this process's environment, so that TensorFlow
    keeps allocator statistics on any CPU. Takes effect only if TensorFlow has not made its
    CPU allocator yet (before its first op or device listing); harmless after.
    `tfpar.virtual_cpus` and the tasks of `tfpar launch` do it already.

        import tfpar
        tfpar.use_allocator_statistics()   # first, before TensorFlow runs anything
        ...
        print(tfpar.process_memory().format())
    """
    os.environ.update(allocator_statistics_env())


def _physical_memory_mib():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // _MIB
    except (AttributeError, ValueError, OSError):  # Not POSIX: TensorFlow's default limit.
        return None


@dataclasses.dataclass(frozen=True)
class ProcessMemory:
    """Bytes this process holds now and at its peak. The allocator figures are None where
    TensorFlow keeps no allocator statistics; `peak_bytes` is then the resident peak, and
    `format` says so.

    >>> ProcessMemory(1 << 20, 3 << 20, 600 << 20, 900 << 20).format()
    'allocator 1.0 MiB (peak 3.0 MiB), resident 600.0 MiB (peak 900.0 MiB)'
    >>> m = ProcessMemory(None, None, 600 << 20, 900 << 20)
    >>> m.peak_source, m.peak_bytes == 900 << 20
    ('resident', True)
    >>> m.format()
    'allocator statistics unavailable, resident 600.0 MiB (peak 900.0 MiB)'
    """

    allocator_bytes: int | None
    allocator_peak_bytes: int | None
    rss_bytes: int
    rss_peak_bytes: int

    @property
    def peak_source(self):
        """'allocator' when TensorFlow's allocator peak is known, else 'resident'."""
        return "resident" if self.allocator_peak_bytes is None else "allocator"

    @property
    def peak_bytes(self):
        """The allocator's peak, or the resident peak where there is none."""
        return self.rss_peak_bytes if self.allocator_peak_bytes is None \
            else self.allocator_peak_bytes

    def format(self):
        allocator = ("allocator statistics unavailable" if self.allocator_bytes is None else
                     f"allocator {self.allocator_bytes / _MIB:.1f} MiB (peak "
                     f"{self.allocator_peak_bytes / _MIB:.1f} MiB)")
        return (f"{allocator}, resident {self.rss_bytes / _MIB:.1f} MiB (peak "
                f"{self.rss_peak_bytes / _MIB:.1f} MiB)")


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


def allocator_bytes(device="CPU:0"):
    """(current, peak) bytes of `device`'s TensorFlow allocator, or None when TensorFlow
    keeps no statistics for it (see the module's docstring)."""
    use_allocator_statistics()
    import tensorflow as tf

    try:
        info = tf.config.experimental.get_memory_info(device)
    except ValueError as error:
        if "not available" in str(error):  # Not: a device that does not exist.
            return None
        raise
    return int(info["current"]), int(info["peak"])


def process_memory(device="CPU:0"):
    """A `ProcessMemory` of this process now: `device`'s allocator (the one every logical
    CPU of the process shares, by default) and the resident set."""
    allocator = allocator_bytes(device) or (None, None)
    rss, rss_peak = resident_bytes()
    return ProcessMemory(*allocator, rss, rss_peak)


def reset_memory_peaks(device="CPU:0"):
    """Starts both peaks again from what is held now: the allocator's (where TensorFlow keeps
    statistics), and the resident set's (Linux: writing 5 to /proc/self/clear_refs; elsewhere
    the resident peak cannot be reset, and stays the process's). Never raises for want of
    statistics: `process_memory` then reports the resident peak."""
    use_allocator_statistics()
    import tensorflow as tf

    try:
        tf.config.experimental.reset_memory_stats(device)
    except ValueError as error:
        if "Cannot reset memory stats" not in str(error):  # Not: a device that does not exist.
            raise
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
