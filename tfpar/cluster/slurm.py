"""`tfpar launch --slurm`: run this Slurm task as one task of a TF_CONFIG cluster.

Every srun task runs `tfpar launch --slurm -- python train.py`. This module

1. checks the Slurm step's environment (pure: `check_environment`, `check_flags`,
   `check_placement`, `gpus_per_node_to_use`, `physical_gpus`, `cluster_config`);
2. builds this task's TF_CONFIG with TensorFlow's own
   `tf.distribute.cluster_resolver.SlurmClusterResolver` (`resolve`, the one place TensorFlow
   is imported): every Slurm task is a worker (`SLURM_PROCID` r is `worker:r`; worker 0 is
   the chief), at `node:port_base + k` for the k-th task on a node;
3. runs the command as this one task (`run`): TF_CONFIG, CUDA_VISIBLE_DEVICES when GPUs
   are assigned, PYTHONUNBUFFERED; SIGTERM/SIGINT are forwarded to it; it dies with the
   launcher; its exit code is returned.

Parameter servers are refused: a Slurm step ends when all its tasks end, and worker and ps
servers (`python -m tfpar.cluster.server`) serve until killed, so a step would outlive its training.
"""

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time

from tfpar.cluster.launcher import _die_with_parent
from tfpar.cluster.tf_config import TFConfigError, parse_tf_config

DEFAULT_PORT_BASE = 8888  # As SlurmClusterResolver.
# What SlurmClusterResolver reads (TensorFlow 2.21 expands the node list itself).
STEP_VARIABLES = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST",
                  "SLURM_STEP_TASKS_PER_NODE")
# `tfpar launch` flags that only apply to the local launcher.
LOCAL_FLAGS = ("ps", "coordinator", "host", "report_seconds", "max_restarts", "data_service",
               "network", "timeout", "memory_cap", "gpus_per_task")
EXAMPLE = "srun --ntasks-per-node=1 tfpar launch --slurm -- python train.py"


class SlurmError(ValueError):
    """The Slurm environment or the flags do not give a usable cluster."""


@dataclasses.dataclass(frozen=True)
class SlurmTask:
    """This Slurm task's part of the cluster."""

    config: object  # ClusterConfig: the TF_CONFIG of this task.
    rank: int  # SLURM_PROCID.
    num_tasks: int  # SLURM_STEP_NUM_TASKS.
    cuda_visible_devices: str = None  # For the command; None: left as it is.


def check_flags(given, workers=None, num_tasks=None):
    """Refuses `tfpar launch` flags that do not apply with --slurm.

    Args:
      given: names of the flags given explicitly on the command line.
      workers: --workers if given explicitly, else None.
      num_tasks: the Slurm step's task count, to compare `workers` with.
    """
    served = [name for name in ("ps", "coordinator") if name in given]
    if served:
        raise SlurmError(
            f"--{served[0]} is not supported with --slurm: a Slurm step ends only when all "
            f"its tasks end, but the worker (and ps) tasks that serve a chief run until they "
            f"are killed, so the step would never end. Use collective training without "
            f"--{served[0]} (`{EXAMPLE}` with tfpar.DataParallelStrategy), or start the "
            f"chief and the serving tasks yourself with their own TF_CONFIG.")
    local = [f"--{name}" for name in LOCAL_FLAGS if name in given]
    if local:
        raise SlurmError(
            f"{', '.join(local)}: for the local launcher only, not with --slurm (where "
            f"Slurm places the tasks and TF_CONFIG names the nodes). Remove them.")
    if workers is not None and num_tasks is not None and workers != num_tasks:
        raise SlurmError(
            f"--workers={workers}, but this Slurm step has {num_tasks} task(s) "
            f"(SLURM_STEP_NUM_TASKS): with --slurm every srun task is one worker. Drop "
            f"--workers, or start {workers} tasks (srun --ntasks / --ntasks-per-node).")


def check_environment(environ):
    """Checks that this process is a task of a Slurm job step; returns (rank, num_tasks)."""
    missing = [name for name in STEP_VARIABLES if not environ.get(name)]
    if missing:
        names = ", ".join(missing)
        if environ.get("SLURM_JOB_ID"):
            where = (f"this process is in Slurm job {environ['SLURM_JOB_ID']} but not in a job "
                     f"step (an sbatch script runs outside any step)")
        else:
            where = "this is not a Slurm task"
        raise SlurmError(
            f"--slurm needs the Slurm step variable(s) {names}, which are not set: {where}. "
            f"Start it with srun, e.g. `{EXAMPLE}` in an sbatch script; outside Slurm, use "
            f"`tfpar launch --workers N -- python train.py`.")
    values = {}
    for name in ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        value = environ[name]
        if not value.isdigit():
            raise SlurmError(f"{name} must be an integer >= 0. Received: {value!r}")
        values[name] = int(value)
    rank, num_tasks = values["SLURM_PROCID"], values["SLURM_STEP_NUM_TASKS"]
    if not rank < num_tasks:
        raise SlurmError(f"SLURM_PROCID={rank} is out of range for SLURM_STEP_NUM_TASKS="
                         f"{num_tasks}: the Slurm environment is inconsistent.")
    return rank, num_tasks


def gpus_per_node_to_use(environ, gpus_per_node, gpus_per_task, nvidia_smi):
    """How many GPUs per node to give the resolver: None to let it count, 0 for no GPUs.

    The resolver counts CUDA_VISIBLE_DEVICES, else `nvidia-smi --list-gpus` (and fails
    when there is no nvidia-smi); with neither, the node has no GPUs to assign.
    """
    for name, value in (("--slurm_gpus_per_node", gpus_per_node),
                        ("--slurm_gpus_per_task", gpus_per_task)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise SlurmError(f"{name} must be an integer >= 0. Received: {value!r}")
    if gpus_per_node is None:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            gpus_per_node = len(_split(visible))
        elif nvidia_smi:
            return None
        else:
            gpus_per_node = 0
    if gpus_per_node == 0 and gpus_per_task:
        raise SlurmError(f"--slurm_gpus_per_task={gpus_per_task}, but there are no GPUs to "
                         f"assign (no CUDA_VISIBLE_DEVICES, no nvidia-smi, or "
                         f"--slurm_gpus_per_node=0). Remove it or give --slurm_gpus_per_node.")
    return gpus_per_node


def cluster_config(cluster, task_type, task_index):
    """The resolver's cluster dict and task as a validated ClusterConfig."""
    try:
        return parse_tf_config({"cluster": {job: list(a) for job, a in cluster.items()},
                                "task": {"type": task_type, "index": task_index}})
    except TFConfigError as error:
        raise SlurmError(f"SlurmClusterResolver gave an unusable cluster: {error}") from None


def check_placement(config, environ, port_base):
    """Checks that this task's TF_CONFIG address is on the node Slurm ran it on.

    The resolver sorts the node names as strings and gives the tasks of each node
    consecutive ranks: that matches Slurm only with block distribution and node names that
    sort alike as strings and numbers (node09, node10; not node9, node10). Otherwise a
    task's address would be another task's, and the cluster would connect the wrong peers.
    Checked against SLURMD_NODENAME and SLURM_LOCALID when Slurm sets them.
    """
    address = config.cluster[config.task_type][config.task_index]
    host, _, port = address.rpartition(":")
    node, local_id = environ.get("SLURMD_NODENAME"), environ.get("SLURM_LOCALID", "")
    wrong_node = bool(node) and node != host
    wrong_port = local_id.isdigit() and int(port) != port_base + int(local_id)
    if wrong_node or wrong_port:
        raise SlurmError(
            f"SlurmClusterResolver gives this task ({config.task_name}, SLURM_PROCID="
            f"{environ.get('SLURM_PROCID')}) the address {address}, but Slurm runs it on "
            f"node {node or host} as its local task {local_id or '?'}: another task's address. "
            f"The resolver assumes block distribution (srun --distribution=block) and node "
            f"names that sort the same as text and as numbers (node09, node10).")


def physical_gpus(assigned, visible):
    """The resolver's GPU indices on the node, as CUDA_VISIBLE_DEVICES for the command.

    The indices count the GPUs this task sees: when CUDA_VISIBLE_DEVICES is set already
    (Slurm sets it to the job's GPUs), index i is its i-th entry.
    """
    if visible is None:
        return assigned
    entries = _split(visible)
    indices = [int(i) for i in _split(assigned)]
    if any(i >= len(entries) for i in indices):
        raise SlurmError(
            f"The resolver assigned GPU(s) {assigned} to this task, but it sees only "
            f"CUDA_VISIBLE_DEVICES={visible}: --slurm_gpus_per_node is more than the GPUs "
            f"this task sees. Lower it.")
    return ",".join(entries[i] for i in indices)


def _split(devices):
    return [d.strip() for d in devices.split(",") if d.strip()]


def resolve(port_base=DEFAULT_PORT_BASE, gpus_per_node=None, gpus_per_task=None, workers=None):
    """This task's SlurmTask, from the Slurm environment of this process (os.environ).

    Args:
      port_base: the first port on each node (the k-th task of a node gets port_base + k).
      gpus_per_node: GPUs of a node to share among its tasks; None: counted (as the
        resolver does: CUDA_VISIBLE_DEVICES, else nvidia-smi; none without either); 0: no
        GPU assignment (CUDA_VISIBLE_DEVICES is left as Slurm set it).
      gpus_per_task: GPUs per task; None: gpus_per_node // tasks on the busiest node.
      workers: --workers if given explicitly: must equal the step's task count.

    Raises:
      SlurmError: saying what is missing or inconsistent and how to fix it.
    """
    environ = os.environ
    rank, num_tasks = check_environment(environ)
    check_flags((), workers, num_tasks)
    if isinstance(port_base, bool) or not isinstance(port_base, int) or not 0 < port_base < 65536:
        raise SlurmError(f"--slurm_port_base must be a port in 1..65535. Received: {port_base!r}")
    node_gpus = gpus_per_node_to_use(environ, gpus_per_node, gpus_per_task,
                                     nvidia_smi=shutil.which("nvidia-smi") is not None)
    assign_gpus = node_gpus != 0
    if not assign_gpus:
        # The resolver cannot place tasks on 0 GPUs (a range with step 0): it gets one
        # GPU per task to compute with, and does not touch CUDA_VISIBLE_DEVICES.
        node_gpus, gpus_per_task = num_tasks, 1

    import tensorflow as tf

    visible = environ.get("CUDA_VISIBLE_DEVICES")
    try:
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
            jobs={"worker": num_tasks}, port_base=port_base, gpus_per_node=node_gpus,
            gpus_per_task=gpus_per_task, auto_set_gpu=assign_gpus)
        if resolver.num_accelerators()["GPU"] == 0:
            raise SlurmError(
                f"{node_gpus} GPU(s) per node is fewer than the tasks on a node "
                f"(SLURM_STEP_TASKS_PER_NODE={environ['SLURM_STEP_TASKS_PER_NODE']}): each "
                f"task would get none. Run at most one task per GPU (srun "
                f"--ntasks-per-node), or pass --slurm_gpus_per_node=0 when Slurm already "
                f"gives each task its GPUs (srun --gpus-per-task).")
        spec = resolver.cluster_spec().as_dict()  # With auto_set_gpu, sets os.environ's.
        assigned = environ.get("CUDA_VISIBLE_DEVICES") if assign_gpus else None
    except (RuntimeError, ValueError) as error:
        if isinstance(error, SlurmError):
            raise
        raise SlurmError(f"SlurmClusterResolver could not resolve the cluster: {error}") from None
    finally:  # The launcher's own environment stays as it was; the command gets `assigned`.
        if visible is None:
            environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            environ["CUDA_VISIBLE_DEVICES"] = visible
    task_type, task_index = resolver.get_task_info()
    config = cluster_config(spec, task_type, task_index)
    check_placement(config, environ, port_base)
    devices = physical_gpus(assigned, visible) if assign_gpus else None
    return SlurmTask(config, rank, num_tasks, devices)


def run(task, command, grace_seconds=5.0, env=None, log=None):
    """Runs `command` as `task`; returns its exit code (128 + N if killed by signal N).

    The command gets its own session (all it starts is stopped with it) and dies with
    this process. SIGTERM and SIGINT (Slurm's time limit, scancel, Ctrl-C on srun) are
    forwarded to it; if it still runs `grace_seconds` later, it is killed.
    """
    log = log or (lambda line: print(f"tfpar launch: {line}", file=sys.stderr, flush=True))
    env = dict(os.environ if env is None else env, TF_CONFIG=task.config.to_json(),
               PYTHONUNBUFFERED="1")
    if task.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = task.cuda_visible_devices
    address = task.config.cluster[task.config.task_type][task.config.task_index]
    gpus = ("" if task.cuda_visible_devices is None
            else f", CUDA_VISIBLE_DEVICES={task.cuda_visible_devices}")
    log(f"Slurm task {task.rank} of {task.num_tasks} is {task.config.task_name} at "
        f"{address}{gpus}")
    received = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    process = None
    try:
        try:
            process = subprocess.Popen(list(command), env=env, start_new_session=True,
                                       preexec_fn=_die_with_parent)
        except OSError as error:
            log(f"cannot run {command[0]!r}: {error}")
            return 127
        forwarded, kill_at = 0, None
        while process.poll() is None:
            for signum in received[forwarded:]:
                log(f"got signal {signum}: forwarding it to {task.config.task_name}")
                _signal_group(process.pid, signum)
                kill_at = kill_at or time.monotonic() + grace_seconds
            forwarded = len(received)
            if kill_at is not None and time.monotonic() > kill_at:
                log(f"{task.config.task_name} still runs {grace_seconds:g}s after the signal: "
                    f"killing it")
                _signal_group(process.pid, signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(0.05)
        code = process.returncode
        return code if code >= 0 else 128 - code
    finally:
        if process is not None:  # Whatever the command left in its session.
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _signal_group(pid, sig):
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
