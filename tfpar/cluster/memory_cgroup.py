"""A memory cap for one process: a Linux cgroup (v1 memory controller) of its own.

Memory claims hold only as peaks measured in a real process under a cap: the kernel
kills a process that goes over it. Needs root and a writable v1 memory controller at
/sys/fs/cgroup/memory (`available()` says); elsewhere a `MemoryCgroup` does nothing and
reports nothing, and callers measure peaks without a cap (and say so).

    group = MemoryCgroup("my_worker", limit=1 << 30)
    process = subprocess.Popen(command, preexec_fn=group.join)
    process.wait()
    group.figures()  # {"cgroup_peak": bytes, "oom_kills": n}
    group.remove()

The cgroup counts what its process brings into memory, page cache included; pages
another process loaded first (TensorFlow's libraries, say) are charged to that process.
"""

import contextlib
import os

ROOT = "/sys/fs/cgroup/memory"


def available(root=ROOT):
    """Whether this process can make memory cgroups (root, a writable controller)."""
    return os.geteuid() == 0 and os.path.isdir(root) and os.access(root, os.W_OK)


class MemoryCgroup:
    """A memory cgroup named `name` under `root`, capped at `limit` bytes (None: no cap,
    the peak is still measured), without swap to fall back on."""

    def __init__(self, name, limit=None, root=ROOT):
        if limit is not None and (not isinstance(limit, int) or limit <= 0):
            raise ValueError(f"limit must be a positive number of bytes or None. "
                             f"Received: limit={limit!r}")
        self.limit = limit
        self.path = None
        if not available(root):
            return
        self.path = os.path.join(root, name)
        os.makedirs(self.path, exist_ok=True)
        self._write("memory.max_usage_in_bytes", "0")
        self._write("memory.limit_in_bytes", str(limit) if limit else "-1")
        for name, value in (("memory.memsw.limit_in_bytes", limit or -1),
                            ("memory.swappiness", 0)):
            with contextlib.suppress(OSError):  # (Not every kernel has swap accounting.)
                self._write(name, str(value))

    def _write(self, name, value):
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def _read(self, name):
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def join(self):
        """Moves the calling process into the cgroup: run it in a child before it execs
        (`subprocess.Popen(..., preexec_fn=group.join)`), so that all it allocates counts."""
        if self.path:
            with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    def figures(self):
        """{"cgroup_peak": bytes, "oom_kills": processes the kernel killed over the cap};
        {} without a cgroup."""
        if not self.path:
            return {}
        control = dict(line.split() for line in self._read("memory.oom_control").splitlines())
        return {"cgroup_peak": int(self._read("memory.max_usage_in_bytes")),
                "oom_kills": int(control.get("oom_kill", 0))}

    def remove(self):
        """Removes the cgroup (its processes must have exited)."""
        if self.path:
            with contextlib.suppress(OSError):
                os.rmdir(self.path)
