"""Pipeline stages on the worker processes of a TF_CONFIG cluster (TensorFlow glue).

The program runs on the chief, which connects to the cluster with TensorFlow's remote
eager runtime (`tf.config.experimental_connect_to_cluster`); every worker task only
serves (`python -m tfpar.cluster.server`). A stage placed on a worker's device has its variables
there and runs there: Keras' step is one `tf.function`, which TensorFlow cuts into one
part per task, and activations and gradients go from worker to worker over gRPC.

A lost worker, as measured on TF 2.21 (2 workers, one stage each, SIGKILL):

- during a step, the step fails within a second with `UnavailableError` ("Socket
  closed", "Connection reset by peer");
- between two calls, the chief's next call waited forever (in `context.async_wait`,
  as `fit` builds its dataset) while TensorFlow's eager client streams its requests
  (TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE, on by default, read at each request).
  With streaming off, as TensorFlow's own ParameterServerStrategy sets it, the call fails
  within 0.1 s with `UnavailableError` ("Connection refused");
- restarted while the chief runs, the chief's next call fails with `AbortedError`
  ("Unable to find a context_id ... Perhaps the worker was restarted").

So a pipeline with stages on other tasks turns streaming off, and the Keras seam turns
the error of `fit`, `evaluate` or `predict` into a `ClusterError` that names the lost
tasks (those that no longer accept TCP connections, else those the error names) and
says how to resume.

A worker that stops answering without closing its connections (a stopped process, a hung
one, a network partition) raises nothing: TensorFlow waits for it without end. Measured
(SIGSTOP of a stage worker): its kernel still accepts connections; the chief's next call
hung in `TFE_ContextAddFunction` holding Python's interpreter lock, and a
`CancellationManager` started 5 s in did not end it. So while `fit`, `evaluate` or
`predict` runs, a process of its own (`tfpar.cluster.silence_watch`) asks each stage
worker's gRPC server for its first HTTP/2 frame; one silent for `stage_timeout_seconds`
gets its name printed and this process ended, for a launcher's restart and
BackupAndRestore to go on from.
"""

import contextlib
import json
import os
import subprocess
import sys

import tensorflow as tf

from tfpar import devices as devices_lib
from tfpar.cluster.launcher import _die_with_parent
from tfpar.cluster.probe import listening, require_reachable
from tfpar.cluster.silence_watch import tell
from tfpar.cluster.tf_config import check_pipeline_cluster
from tfpar.distribute.common.cluster_config import cluster_config
from tfpar.errors import ClusterError, DeviceError
from tfpar.keras import tf_runtime

# TensorFlow's switch for streamed eager requests (see the module docstring).
STREAMING_ENQUEUE_ENV = "TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE"


class StageWorkers:
    """The tasks of the cluster this process is connected to, as the pipeline sees them.

    Args:
      addresses: {task ('/job:worker/replica:0/task:1'): "host:port"}.
    """

    def __init__(self, addresses):
        self.addresses = dict(addresses)
        self._watchers = {}  # (tasks, timeout) -> its silence_watch process

    def first_devices(self):
        """Each worker task's first device (a GPU if it has one, else CPU:0), in task order:
        one pipeline stage per worker."""
        workers = sorted((t for t in self.addresses if t.startswith("/job:worker/")),
                         key=lambda t: int(t.rsplit(":", 1)[1]))
        devices = []
        for task in workers:
            found = {kind: sorted((d.name for d in tf.config.list_logical_devices(kind)
                                   if devices_lib.task_of(d.name) == task),
                                  key=lambda name: int(name.rsplit(":", 1)[1]))
                     for kind in ("GPU", "CPU")}
            if not (found["GPU"] or found["CPU"]):
                raise ClusterError(
                    f"{_task_name(task)} ({self.addresses[task]}) shows no device: is it a "
                    f"TensorFlow server of this cluster (`python -m tfpar.cluster.server` with its "
                    f"TF_CONFIG)?")
            devices.append((found["GPU"] or found["CPU"])[0])
        return devices

    def replica_devices(self, devices, num_replicas):
        """Where the R > 1 pipeline replicas of `devices` (some another task's) take their
        inputs and run what no stage holds: R logical CPUs of this process, for
        TensorFlow's mirrored replicas must be devices of one task in eager mode. None for
        one replica: its device is its first stage's, as on one host.

        Raises:
          DeviceError: this process has fewer than R logical CPUs.
        """
        if num_replicas == 1:
            return None
        host = devices_lib.host_task()
        cpus = sorted((d.name for d in tf.config.list_logical_devices("CPU")
                       if devices_lib.task_of(d.name) == host),
                      key=lambda name: int(name.rsplit(":", 1)[1]))
        if len(cpus) < num_replicas:
            raise DeviceError(
                f"PipelineStrategy(num_replicas={num_replicas}) with stages on other "
                f"processes feeds each replica from a logical CPU of this process (the "
                f"chief), which has {len(cpus)}. Call tfpar.virtual_cpus({num_replicas}) at "
                f"the start of the program, before TensorFlow starts.")
        return tuple(cpus[:num_replicas])

    def profiler_addresses(self, stage_devices, profilers):
        """The profiler servers ("host:port") of the other tasks that hold stages, from
        `profilers` ({'worker:1' or '/job:worker/task:1': "host:port"}).

        Raises:
          ValueError: a task that holds a stage has none, or `profilers` names another.
        """
        stages = {task: [stage for stage, _ in held]
                  for task, held in _stages_elsewhere(stage_devices).items()}
        given = {_canonical_task(task): address for task, address in (profilers or {}).items()}
        unknown = sorted(set(given) - set(stages))
        if unknown:
            raise ValueError(
                f"profilers names {', '.join(map(_task_name, unknown))}, which hold no stage "
                f"of this pipeline; stages on other tasks: "
                f"{', '.join(map(_task_name, stages)) or 'none'}.")
        missing = [t for t in stages if t not in given]
        if missing:
            raise ValueError(
                f"trace() records each task's ops with that task's own profiler, and "
                f"{' and '.join(f'{_task_name(t)} (stages {stages[t]})' for t in missing)} "
                f"{'has' if len(missing) == 1 else 'have'} none given. Serve each worker with "
                f"`python -m tfpar.cluster.server --profiler_port=P` and pass profilers="
                f"{{{', '.join(repr(_task_name(t)) + ': ' + repr('host:P') for t in missing)}}}.")
        return [given[t] for t in stages]

    @contextlib.contextmanager
    def watching(self, stage_devices, timeout_seconds):
        """While the block runs, a stage worker silent for `timeout_seconds` (None: never)
        gets this process ended, with a message naming it (`tfpar.cluster.silence_watch`,
        a process of its own: see the module docstring)."""
        stages = {t: s for t, s in _stages_elsewhere(stage_devices).items()
                  if t in self.addresses}
        if timeout_seconds is None or not stages:
            yield
            return
        tasks = [[_task_name(t), self.addresses[t], " and ".join(
            f"stage {s} of the pipeline on {d}" for s, d in held)] for t, held in stages.items()]
        key = (json.dumps(tasks), timeout_seconds)
        watcher = self._watchers.get(key)
        if watcher is None or watcher.poll() is not None:
            watcher = self._watchers[key] = subprocess.Popen(
                [sys.executable, "-m", "tfpar.cluster.silence_watch", str(os.getpid()),
                 str(timeout_seconds), key[0]], stdin=subprocess.PIPE,
                preexec_fn=_die_with_parent)
        tell(watcher, "watch")
        try:
            yield
        finally:
            tell(watcher, "idle")

    def explain(self, error, stage_devices):
        """A ClusterError for `error` if it comes from a lost stage task, else None."""
        stages = _stages_elsewhere(stage_devices)
        if not stages or not isinstance(error, tf.errors.OpError):
            return None
        lost = [t for t in stages if t in self.addresses and not listening(self.addresses[t])]
        if lost:
            what = "stopped accepting connections (the process is gone)"
        elif isinstance(error, tf.errors.UnavailableError) or "context_id" in str(error):
            # Listening again, restarted ("Unable to find a context_id", measured), or only the
            # connection broke: the stages' state on that task is gone all the same.
            lost = [t for t in stages if t in str(error)] or list(stages)
            what = "was restarted or lost its connection to this process"
        else:
            return None
        held = " and ".join(
            f"{_task_name(t)} ({self.addresses.get(t, 'address unknown')}), which held "
            + ", ".join(f"stage {s} on {d}" for s, d in stages[t]) for t in lost)
        return ClusterError(
            f"tfpar.PipelineStrategy lost {'a stage worker' if len(lost) == 1 else 'stage workers'}"
            f": {held}, {what}. The variables of those stages are gone, so training cannot go "
            f"on. Start the lost worker again (`python -m tfpar.cluster.server` with its TF_CONFIG) "
            f"and run the program again: with keras.callbacks.BackupAndRestore it resumes from "
            f"the last backup (`tfpar launch --coordinator --max_restarts N` does both). "
            f"TensorFlow said: {type(error).__name__}: {_first_line(error)}")


def connect(cluster_resolver, connect_timeout_seconds):
    """Connects this process (the chief) to the cluster of `cluster_resolver`.

    Raises:
      TFConfigError: the cluster has no worker, or this process is not its chief.
      ClusterError: a worker does not listen within `connect_timeout_seconds`.
    """
    if not isinstance(connect_timeout_seconds, (int, float)) or connect_timeout_seconds <= 0:
        raise ValueError(f"connect_timeout_seconds must be a number > 0. Received: "
                         f"{connect_timeout_seconds!r}")
    config = cluster_config(cluster_resolver)
    check_pipeline_cluster(config)
    require_reachable(config.cluster, ("worker",), connect_timeout_seconds,
                      "Start `python -m tfpar.cluster.server` for each worker task with its TF_CONFIG "
                      "(tfpar launch --workers N --coordinator does this)")
    fail_fast()
    # A ClusterSpec, not the resolver: with a resolver TensorFlow also enters the chief's
    # device scope for good, and does nothing at all when the resolver names no master.
    tf.config.experimental_connect_to_cluster(
        tf.train.ClusterSpec({job: list(tasks) for job, tasks in config.cluster.items()}),
        job_name=config.task_type or "chief", task_index=config.task_index or 0,
        protocol=cluster_resolver.rpc_layer or "grpc")
    return connected()


def connected():
    """The StageWorkers of the cluster this process is connected to; None if it is not."""
    server_def = tf_runtime.server_def()
    if server_def is None:
        return None
    return StageWorkers({f"/job:{job.name}/replica:0/task:{index}": address
                         for job in server_def.cluster.job
                         for index, address in job.tasks.items()})


def of_devices(devices):
    """StageWorkers when some of `devices` are another task's (this process connected to
    their cluster itself), else None."""
    host = devices_lib.host_task()
    if all(devices_lib.task_of(d) == host for d in devices):
        return None
    workers = connected()
    if workers is None:  # resolve_devices lets no such device through.
        raise DeviceError(f"{devices!r} name devices of other tasks, but this process is not "
                          f"connected to a cluster: pass cluster_resolver=...")
    fail_fast()
    return workers


def fail_fast():
    """A lost worker fails the next call instead of hanging it (see the module docstring)."""
    os.environ[STREAMING_ENQUEUE_ENV] = "False"


def _task_name(task):
    """'worker:1' for '/job:worker/replica:0/task:1'."""
    job, _, index = task.split("/")[1:4]
    return f"{job[4:]}:{index[5:]}"


def _stages_elsewhere(stage_devices):
    """{task: [(stage, device)]} of the stages on tasks other than this process's."""
    host = devices_lib.host_task()
    stages = {}
    for stage, device in enumerate(stage_devices):
        task = devices_lib.task_of(device)
        if task != host:
            stages.setdefault(task, []).append((stage, device))
    return stages


def _canonical_task(task):
    """'/job:worker/replica:0/task:1' for 'worker:1' or any device or task string of it."""
    if not isinstance(task, str) or not task:
        raise ValueError(f"A task in profilers is named like 'worker:1'. Received: {task!r}")
    if not task.startswith("/"):
        job, _, index = task.partition(":")
        if not index.isdigit():
            raise ValueError(f"A task in profilers is named like 'worker:1'. Received: {task!r}")
        task = f"/job:{job}/task:{index}"
    return devices_lib.task_of(task)


def _first_line(error):
    message = getattr(error, "message", str(error)).strip()
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    # Graph execution errors start with boilerplate; the root errors say what happened.
    roots = [line for line in lines if line.startswith("(0)")]
    return (roots or lines or [""])[0][:300]
