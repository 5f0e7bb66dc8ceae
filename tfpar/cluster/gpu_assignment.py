"""Which GPUs each task of a local cluster sees (`CUDA_VISIBLE_DEVICES`). Plain Python.

The workers compute, so they share the host's GPUs out (round-robin over the visible
list); the chief, parameter servers and tf.data service tasks see none, so TensorFlow in
them reserves no GPU memory. Without any visible GPU nothing is set.

    >>> assign(["chief:0", "worker:0", "worker:1", "ps:0"], ["0", "1", "2", "3"])
    {'chief:0': '', 'worker:0': '0,1', 'worker:1': '2,3', 'ps:0': ''}
"""

import shutil
import subprocess

ENV = "CUDA_VISIBLE_DEVICES"
COMPUTING_JOBS = ("worker",)


def visible_gpus(environ, list_gpus=None):
    """The GPU ids this host can hand out: the entries of `CUDA_VISIBLE_DEVICES` when it is
    set ("" or "-1": none), else one per GPU `nvidia-smi --list-gpus` lists (none without
    nvidia-smi). `list_gpus()` returns those lines (default: runs nvidia-smi).

    >>> visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"})
    ['2', '3']
    >>> visible_gpus({}, lambda: ["GPU 0: A100 (UUID: GPU-1)", "GPU 1: A100 (UUID: GPU-2)"])
    ['0', '1']
    """
    if ENV in environ:
        entries = [e.strip() for e in environ[ENV].split(",") if e.strip()]
        return [] if entries in ([], ["-1"]) else entries
    lines = (list_gpus or _nvidia_smi_list)()
    return [str(i) for i, line in enumerate(lines or []) if line.startswith("GPU ")]


def _nvidia_smi_list():
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        done = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return done.stdout.splitlines() if done.returncode == 0 else []


def assign(task_names, gpus, gpus_per_task=None):
    """{task name: its CUDA_VISIBLE_DEVICES} for `task_names` ("job:index"), or {} when
    nothing is to be set (no GPUs, or `gpus_per_task=0`).

    Args:
      gpus: the visible GPU ids (`visible_gpus`).
      gpus_per_task: GPUs per worker. None: the GPUs split evenly (at least one each;
        with fewer GPUs than workers, workers share them round-robin).

    Raises:
      ValueError: `gpus_per_task` is not an integer >= 0, or asks for more GPUs than
        there are.
    """
    if gpus_per_task is not None and (isinstance(gpus_per_task, bool)
                                      or not isinstance(gpus_per_task, int)
                                      or gpus_per_task < 0):
        raise ValueError(f"--gpus_per_task must be an integer >= 0. Received: "
                         f"{gpus_per_task!r}")
    workers = [t for t in task_names if t.split(":")[0] in COMPUTING_JOBS]
    if gpus_per_task == 0 or not workers:
        return {}
    if not gpus:
        if gpus_per_task:
            raise ValueError(f"--gpus_per_task={gpus_per_task}, but this host has no GPU to "
                             f"assign (no CUDA_VISIBLE_DEVICES, nvidia-smi lists none). "
                             f"Remove it.")
        return {}
    if gpus_per_task is None:
        gpus_per_task = max(1, len(gpus) // len(workers))
    elif gpus_per_task * len(workers) > len(gpus):
        raise ValueError(
            f"--gpus_per_task={gpus_per_task} for {len(workers)} workers needs "
            f"{gpus_per_task * len(workers)} GPUs; this host has {len(gpus)} "
            f"({','.join(gpus)}). Lower --gpus_per_task or --workers.")
    out = {}
    for name in task_names:
        if name in workers:
            first = workers.index(name) * gpus_per_task
            out[name] = ",".join(gpus[(first + k) % len(gpus)] for k in range(gpus_per_task))
        else:
            out[name] = ""
    return out
