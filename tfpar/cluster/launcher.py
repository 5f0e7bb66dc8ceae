"""Start a local TF_CONFIG cluster: one process per task on 127.0.0.1. No TensorFlow here.

Without parameter servers every worker runs the user's command (worker 0 is the
chief). With parameter servers, or with `coordinator=True` (a pipeline whose stages live
on the workers), a chief runs the command and the workers and ps tasks run
`python -m tfpar.cluster.server`. Each output line is prefixed with its task;
when a task that matters fails, the others are stopped and its exit code returned.
Nothing outlives the launcher: each task has a parent-death signal, and a watchdog
(`tfpar.cluster.watchdog`) kills the tasks' process groups if the launcher dies.

Two options:

- `max_restarts=N`: with parameter servers, a worker server that exits is started again
  with the same TF_CONFIG (same address: the coordinator reconnects to it), at most N
  times per worker task; the chief and the ps tasks are never restarted (a ps holds the
  variables). Without parameter servers (collective training, which cannot take one
  worker back, or a coordinator whose workers hold pipeline stages), the whole job is
  started again after a task fails, at most N times; it resumes from the chief's last
  `BackupAndRestore` backup, which the chief broadcasts (collective training) or holds.
- `data_service=True`: a tf.data service for the run (`python -m tfpar.cluster.data_service`): one
  dispatcher and one tf.data service worker per training worker, on free ports of the same
  host; every cluster task gets the dispatcher's address in `TFPAR_DATA_SERVICE`
  (`grpc://host:port`). If the dispatcher dies, all tasks are stopped with its exit code.
"""

import contextlib
import ctypes
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from tfpar.cluster import gpu_assignment, memory_cgroup, memory_probe, network
from tfpar.cluster.data_service import DATA_SERVICE_ENV
from tfpar.cluster.tf_config import ClusterConfig

SERVER_COMMAND = (sys.executable, "-m", "tfpar.cluster.server")
TIMEOUT_EXIT_CODE = 124  # As coreutils' `timeout`.
DATA_SERVICE_COMMAND = (sys.executable, "-m", "tfpar.cluster.data_service")
WATCHDOG_COMMAND = (sys.executable, "-m", "tfpar.cluster.watchdog")


# In a task's environment: TensorFlow's gRPC server binds with SO_REUSEPORT, so it can
# take a port that a PortReservation holds.
REUSE_PORT_ENV = {"TF_GRPC_REUSE_PORT": "1"}
# Unless the environment says otherwise, glibc keeps at most 2 malloc arenas per task.
# Measured (benchmarks/memory.py, 100.7M MLP, 2 ZeRO-1 workers): with one arena per
# thread, memory that gRPC transfers freed stayed resident, 1,590-1,685 MiB per worker
# against 1,465-1,485 MiB with 2, with no slower steps.
MALLOC_ENV = {"MALLOC_ARENA_MAX": "2"}


# Unless the environment says otherwise, the tasks on one host share its cores: each op
# runs on at most (cores / tasks) threads, as torchrun sets OMP_NUM_THREADS=1 for several
# processes per node. TensorFlow's default is every core for each process: N tasks on C
# cores ran N x C threads per op. Measured (BUILD_NOTES, "Suite times"): 2 training
# processes beside a third on 2 cores, 1 thread each: 51 -> 82 steps/s (oneDNN off), 51
# -> 58 (on).
INTRA_OP_THREADS_ENV = "TF_NUM_INTRAOP_THREADS"


def host_cores():
    """The cores this process may run on (its CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (Not Linux.)
        return os.cpu_count() or 1


def task_environment(base=None, tasks=1, cores=None):
    """The environment each of `tasks` tasks on this host starts with: `base` (default:
    this process's), with `MALLOC_ENV`, TensorFlow's allocator statistics on any CPU
    (`memory_probe.allocator_statistics_env`) and, for several tasks, an op's threads
    (`INTRA_OP_THREADS_ENV`: `cores` / `tasks`, at least 1) unless `base` says otherwise,
    and `REUSE_PORT_ENV`.

    >>> env = task_environment({"MALLOC_ARENA_MAX": "8", "TF_CPU_ALLOCATOR_USE_BFC": "false"},
    ...                        tasks=3, cores=8)
    >>> env["MALLOC_ARENA_MAX"], env["TF_CPU_ALLOCATOR_USE_BFC"], env["TF_GRPC_REUSE_PORT"]
    ('8', 'false', '1')
    >>> env["TF_NUM_INTRAOP_THREADS"]
    '2'
    """
    base = dict(os.environ if base is None else base)
    env = dict(MALLOC_ENV, **memory_probe.allocator_statistics_env(base))
    if tasks > 1:
        env[INTRA_OP_THREADS_ENV] = str(max(1, (cores or host_cores()) // tasks))
    env.update(base)
    env.update(REUSE_PORT_ENV)
    return env


def free_ports(count, host="127.0.0.1"):
    """Ports free on `host` now (all held open together, so they are distinct).

    They are released on return: another program may take one before the task that
    was given it binds. The launcher holds its ports with a PortReservation instead.
    """
    with PortReservation(count, host) as reservation:
        return list(reservation.ports)


class PortReservation:
    """Ports held until `close()`, so that no other program takes them first.

    Each is a socket bound with SO_REUSEPORT that never listens. A TensorFlow server
    with `REUSE_PORT_ENV` in its environment binds the same port (TensorFlow's own
    TF_GRPC_REUSE_PORT switch); any other program's bind fails with "address in
    use", and connections reach only the listening server. Linux lets only the same
    user share a port this way.
    """

    def __init__(self, count, host="127.0.0.1"):
        self._sockets = []
        try:
            for _ in range(count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                self._sockets.append(s)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                s.bind((host, 0))
        except OSError:
            self.close()
            raise
        self.ports = [s.getsockname()[1] for s in self._sockets]

    def close(self):
        for s in self._sockets:
            s.close()
        self._sockets = []

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def cluster_jobs(workers, ps=0, coordinator=False):
    """[(job, task count)] of a local cluster: workers, plus ps tasks if `ps`, plus a chief
    (which runs the program while the others serve) if `ps` or `coordinator`."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--workers must be an integer >= 1. Received: {workers!r}")
    if isinstance(ps, bool) or not isinstance(ps, int) or ps < 0:
        raise ValueError(f"--ps must be an integer >= 0. Received: {ps!r}")
    if not isinstance(coordinator, bool):
        raise ValueError(f"coordinator must be True or False. Received: {coordinator!r}")
    chief = [("chief", 1)] if ps or coordinator else []
    return chief + [("worker", workers)] + ([("ps", ps)] if ps else [])


def make_cluster(workers, ps=0, host="127.0.0.1", ports=None, coordinator=False,
                 task_hosts=None):
    """The cluster dict for `workers` workers and `ps` parameter servers, plus a chief if
    `ps` or `coordinator` (see `cluster_jobs`).

    `ports`: one per task, in job order (default: free ports, released at once).
    `task_hosts`: the address of each task, in job order (default: `host` for all).
    """
    jobs = cluster_jobs(workers, ps, coordinator)
    size = sum(n for _, n in jobs)
    ports = list(free_ports(size, host) if ports is None else ports)
    if len(ports) != size:
        raise ValueError(f"The cluster has {size} tasks but {len(ports)} ports were given.")
    hosts = iter([host] * size if task_hosts is None else task_hosts)
    ports = iter(ports)
    return {job: tuple(f"{next(hosts)}:{next(ports)}" for _ in range(n)) for job, n in jobs}


def hosts_of_tasks(jobs, hosts):
    """The host index of every task of `jobs` ([(job, count)], in job order) on `hosts`
    hosts: the workers in contiguous blocks, as a scheduler fills machines (worker w on
    host w x hosts // workers), the chief on the first, ps tasks round-robin.

    >>> hosts_of_tasks([("chief", 1), ("worker", 4), ("ps", 2)], 2)
    [0, 0, 0, 1, 1, 0, 1]
    """
    placed = []
    for job, count in jobs:
        if job == "worker":
            placed += [w * hosts // count for w in range(count)]
        elif job == "ps":
            placed += [i % hosts for i in range(count)]
        else:
            placed += [0] * count
    return placed


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent():
    """In the child before exec: SIGKILL when the launcher thread that started it dies.

    Linux only (prctl); elsewhere tasks outlive a killed launcher. Only the task's own
    process gets the signal: what it started itself is in its session, which `stop`
    signals as a whole when the launcher ends normally, and the watchdog kills when it
    does not.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _before_exec(cgroup=None, join_host=None):
    """In the child before exec: into its memory cgroup and onto its simulated host (if
    any), then dying with the launcher."""
    if cgroup is not None:
        cgroup.join()
    if join_host is not None:
        join_host()
    _die_with_parent()


class Task:
    """One started process of the cluster.

    With a `config` the process gets its TF_CONFIG and is named after its task; without
    one (a helper process such as the tf.data service) it is named `name`.
    """

    def __init__(self, config, command, env, output, name=None, cgroup=None, join_host=None):
        self.config = config
        self.cgroup = cgroup  # A MemoryCgroup the process runs in, or None.
        self.join_host = join_host  # Puts the child on its simulated host, or None.
        self.name = config.task_name if config is not None else name
        self.command = list(command)
        self.env = dict(env, PYTHONUNBUFFERED="1")
        if config is not None:
            self.env["TF_CONFIG"] = config.to_json()
        self.restarts = 0  # How many times this task was started again before this process.
        self._output = output
        # Own session: stopping a task stops everything it started, and nothing else.
        # Killed with the launcher, however it dies (SIGKILL, the OOM killer): a task must
        # not outlive it holding its ports.
        self.process = subprocess.Popen(
            self.command, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=_die_with_parent if cgroup is None and join_host is None
            else functools.partial(_before_exec, cgroup, join_host))
        self._reader = threading.Thread(target=self._forward, args=(output,), daemon=True)
        self._reader.start()

    def _forward(self, output):
        for raw in self.process.stdout:
            output(f"[{self.name}] {raw.decode(errors='replace').rstrip()}")

    def signal(self, sig):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def join_output(self, timeout=5):
        self._reader.join(timeout)

    def restart(self):
        """A new Task running the same command with the same environment (and TF_CONFIG).

        What the exited process left in its process group is killed first: it could hold
        the task's port.
        """
        self.signal(signal.SIGKILL)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)  # Anything left of the group yet?
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.02)
        task = Task(self.config, self.command, self.env, self._output, name=self.name,
                    cgroup=self.cgroup, join_host=self.join_host)
        task.restarts = self.restarts + 1
        return task


def _gib(size):
    return f"{size / 2**30:.2f} GiB"


class Launcher:
    """Runs one process per task of a local cluster. Use `run()`; see `tfpar launch`.

    Args:
      command: the user's program (run by every worker, or by the chief when `ps` or
        `coordinator`).
      workers, ps, host: the cluster (see `make_cluster`).
      grace_seconds: between SIGTERM and SIGKILL when stopping.
      server_command: what worker and ps tasks run when there is a chief
        (`python -m tfpar.cluster.server`).
      env: the environment of the tasks (default: this process's).
      output: called with every prefixed output line (default: print).
      report_seconds: after a ps (or, with `coordinator`, a worker) dies, how long the
        chief gets to fail on its own.
      max_restarts: with `ps`, how many times each worker task is started again after it
        exits (same TF_CONFIG). Without `ps`, how many times the whole job is started
        again after a task fails: collective training cannot take one worker back, and a
        coordinator's worker holds pipeline stages, so every task restarts (same
        TF_CONFIG, same ports) and resumes from the chief's last backup
        (`keras.callbacks.BackupAndRestore`; in collective training the chief's restored
        state is broadcast to the others, so no shared filesystem is needed).
      data_service: also run a tf.data service (a dispatcher and one worker per training
        worker); every task gets its address in `TFPAR_DATA_SERVICE`.
      timeout_seconds: the whole run may take this long; then every task is stopped and
        `run()` returns 124 (as `timeout`). None: no limit.
      coordinator: add a chief that runs `command` while the workers serve (without `ps`:
        the workers hold what the chief places on their devices, e.g. the stages of
        `tfpar.PipelineStrategy(cluster_resolver=...)`).
      gpus_per_task: GPUs each worker task sees (CUDA_VISIBLE_DEVICES, round-robin over
        the host's); the chief, ps and tf.data service tasks see none. None: the host's
        GPUs split evenly over the workers; 0: CUDA_VISIBLE_DEVICES left as it is.
      gpus: the host's GPU ids (default: `gpu_assignment.visible_gpus` of `env`).
      hosts: simulate this many hosts on this machine (`network.SimulatedHosts`: a network
        namespace each, with its own address, joined by virtual links; this process must
        be in its private network, `network.enter_private_network`): the tasks are split
        over them (`hosts_of_tasks`), each bound to and reached at its host's address.
      link_mbit: with `hosts`, each end of a link between hosts sends at most this many
        Mbit/s (None: as fast as memory).
    """

    def __init__(self, command, workers, ps=0, host="127.0.0.1", grace_seconds=5.0,
                 server_command=SERVER_COMMAND, env=None, output=None, report_seconds=60.0,
                 max_restarts=0, data_service=False, timeout_seconds=None, coordinator=False,
                 memory_cap=None, memory_cap_jobs=None, gpus_per_task=None, gpus=None,
                 hosts=1, link_mbit=None):
        if not command:
            raise ValueError("No command to launch: give it after '--', e.g. "
                             "tfpar launch --workers 2 -- python train.py")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"--max_restarts must be an integer >= 0. Received: {max_restarts!r}")
        if timeout_seconds is not None and not (
                isinstance(timeout_seconds, (int, float)) and timeout_seconds > 0):
            raise ValueError(f"--timeout must be a number of seconds > 0 (0 on the command "
                             f"line: no limit). Received: {timeout_seconds!r}")
        self.timeout_seconds = timeout_seconds
        if memory_cap is not None and (isinstance(memory_cap, bool)
                                       or not isinstance(memory_cap, int) or memory_cap <= 0):
            raise ValueError(f"--memory_cap must be a size > 0, e.g. 2GiB. Received: "
                             f"{memory_cap!r}")
        self.memory_cap = memory_cap
        self._cgroups = {}  # task name -> its MemoryCgroup (--memory_cap)
        jobs = cluster_jobs(workers, ps, coordinator)
        if memory_cap_jobs is not None:
            names = [job for job, _ in jobs]
            unknown = sorted(set(memory_cap_jobs) - set(names))
            if unknown or not memory_cap_jobs:
                raise ValueError(f"--memory_cap_jobs names jobs of this cluster ("
                                 f"{', '.join(names)}). Received: {','.join(memory_cap_jobs)!r}")
        self.memory_cap_jobs = None if memory_cap_jobs is None else tuple(memory_cap_jobs)
        self.command = list(command)
        size = sum(n for _, n in jobs)
        self._hosts = None
        self._task_hosts = [0] * size  # The simulated host of each task, in job order.
        if link_mbit is not None and hosts == 1:
            raise ValueError("--link_mbit limits the links between simulated hosts: give "
                             "--hosts too.")
        if hosts != 1:
            if not network.is_loopback(host):
                raise ValueError(f"--hosts simulates hosts on this machine: --host={host} "
                                 f"cannot be given with it.")
            self._hosts = network.SimulatedHosts(hosts, link_mbit)
            host = self._hosts.addresses[0]
            self._task_hosts = hosts_of_tasks(jobs, hosts)
        # Held until the run ends: also while a restarted worker starts again. (On simulated
        # hosts each namespace has ports of its own; these are held on the first.)
        self._ports = PortReservation(size + (1 + workers if data_service else 0), host)
        self.cluster = make_cluster(
            workers, ps, host, self._ports.ports[:size], coordinator,
            None if self._hosts is None else
            [self._hosts.addresses[h] for h in self._task_hosts])
        self.host = host
        self.grace_seconds = grace_seconds
        # After a ps dies, the chief gets this long to fail on its own: its error says
        # which task was lost and how to resume, which the launcher cannot.
        self.report_seconds = report_seconds
        self.server_command = list(server_command)
        self.max_restarts = max_restarts
        self.env = task_environment(env, tasks=size)
        # Task name -> its CUDA_VISIBLE_DEVICES ({}: left as the launcher's).
        self.gpus = gpu_assignment.assign(
            [f"{job}:{i}" for job, addresses in self.cluster.items()
             for i in range(len(addresses))],
            gpu_assignment.visible_gpus(self.env) if gpus is None else list(gpus),
            gpus_per_task)
        self.data_service = None  # The dispatcher's address, "grpc://host:port".
        if data_service:
            # gRPC binds with SO_REUSEPORT by default: these ports are held too.
            self._data_service_ports = self._ports.ports[size:]
            self.data_service = f"grpc://{host}:{self._data_service_ports[0]}"
            self.env[DATA_SERVICE_ENV] = self.data_service
        self._lock = threading.Lock()
        self._output = output or self._print
        self.tasks = []  # The current process of every task (restarted ones replace theirs).
        self.job_restarts = 0  # Whole-job restarts so far (collective training).
        self.replaced = []  # Tasks that exited and were restarted.

    def _print(self, line):
        with self._lock:
            print(line, flush=True)

    def _plan(self):
        """(config, command, runs_user_code, fatal, restartable) for every task.

        The run succeeds when every task running the user's command exits 0; it fails
        when one of those fails, or a server task that holds state dies: a ps task, or a
        worker of a coordinator without ps (it holds pipeline stages). The chief then
        gets `report_seconds` to fail with its own error first. Under parameter servers a
        worker server that dies is not fatal: the coordinator reschedules its work (and
        takes the worker back when `max_restarts` starts it again).
        """
        has_ps = "ps" in self.cluster
        has_chief = "chief" in self.cluster  # It runs the command; the others serve.
        plan = []
        for job, addresses in self.cluster.items():
            for index in range(len(addresses)):
                config = ClusterConfig(self.cluster, job, index)
                runs_user_code = job == "chief" or not has_chief
                holds_state = job == "ps" or (job == "worker" and not has_ps)
                plan.append((config, self.command if runs_user_code else self.server_command,
                             runs_user_code, runs_user_code or holds_state,
                             has_ps and job == "worker"))
        return plan

    def _host_of(self, position):
        """The pre-exec step putting the task at `position` (job order) on its host."""
        return None if self._hosts is None else self._hosts.joiner(self._task_hosts[position])

    def _describe_hosts(self):
        names = [f"{job}:{i}" for job, addresses in self.cluster.items()
                 for i in range(len(addresses))]
        return "; ".join(
            f"host {h} at {address}: " + ", ".join(
                n for n, t in zip(names, self._task_hosts) if t == h)
            for h, address in enumerate(self._hosts.addresses))

    def _start_data_service(self):
        """Starts the dispatcher and its workers; returns the dispatcher's task."""
        env = {k: v for k, v in self.env.items() if k != "TF_CONFIG"}
        if self.gpus:
            env[gpu_assignment.ENV] = ""  # The workers' GPUs are theirs.
        dispatcher_port, *worker_ports = self._data_service_ports
        dispatcher = self._track(Task(None, [*DATA_SERVICE_COMMAND, "--role=dispatcher",
                                             f"--port={dispatcher_port}"],
                                      env, self._output, name="data_service:dispatcher"))
        for index, port in enumerate(worker_ports):
            self._track(Task(
                None, [*DATA_SERVICE_COMMAND, "--role=worker", f"--port={port}",
                       f"--dispatcher={self.host}:{dispatcher_port}", f"--host={self.host}"],
                env, self._output, name=f"data_service:worker:{index}"))
        return dispatcher

    def run(self):
        """Starts every task and waits; returns the exit code of the run."""
        previous = {sig: signal.signal(sig, self._on_signal)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        self._interrupted = None
        # Own session: signals to the launcher's group do not reach it.
        self._watchdog = subprocess.Popen(
            WATCHDOG_COMMAND, stdin=subprocess.PIPE, text=True, start_new_session=True)
        try:
            return self._run()
        finally:
            self.stop()
            self._tell_watchdog("exit")
            self._watchdog.stdin.close()
            self._watchdog.wait()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _tell_watchdog(self, line):
        with contextlib.suppress(OSError, ValueError):
            self._watchdog.stdin.write(line + "\n")
            self._watchdog.stdin.flush()

    def _track(self, task):
        """Adds `task` to the current tasks; the watchdog kills its group if we die."""
        with self._lock:
            self.tasks.append(task)
        self._tell_watchdog(f"+{task.process.pid}")
        return task

    def _on_signal(self, signum, frame):
        self._interrupted = signum

    def _start_cluster(self):
        """Starts every cluster task; returns (user tasks, fatal tasks, restartable tasks)."""
        user_tasks, fatal_tasks, restartable = [], [], []
        for position, (config, command, runs_user_code, fatal, can_restart) in enumerate(
                self._plan()):
            env = self.env if config.task_name not in self.gpus else {
                **self.env, gpu_assignment.ENV: self.gpus[config.task_name]}
            task = self._track(Task(config, command, env, self._output,
                                    cgroup=self._cgroup_of(config.task_name),
                                    join_host=self._host_of(position)))
            if runs_user_code:
                user_tasks.append(task)
            if fatal:
                fatal_tasks.append(task)
            if can_restart:
                restartable.append(task)
        return user_tasks, fatal_tasks, restartable

    def _cgroup_of(self, name):
        """The memory cgroup of task `name` under --memory_cap (kept across restarts)."""
        if self.memory_cap is None or (self.memory_cap_jobs is not None
                                       and name.split(":")[0] not in self.memory_cap_jobs):
            return None
        if name not in self._cgroups:
            self._cgroups[name] = memory_cgroup.MemoryCgroup(
                f"tfpar_launch_{os.getpid()}_{name.replace(':', '_')}", self.memory_cap)
        return self._cgroups[name]

    def _exit_note(self, task, code):
        """What the kernel did, when a task it killed was over its --memory_cap."""
        if task.cgroup is None or code != -signal.SIGKILL:
            return ""
        figures = task.cgroup.figures()
        if not figures.get("oom_kills"):
            return ""
        return (f" (killed by the kernel: over its --memory_cap of "
                f"{_gib(self.memory_cap)}, peak {_gib(figures['cgroup_peak'])})")

    def _report_memory(self):
        """One line of every task's peak memory under --memory_cap, then the cgroups go."""
        if not self._cgroups:
            return
        peaks = []
        for name, group in self._cgroups.items():
            figures = group.figures()
            if figures:
                kills = f", {figures['oom_kills']} killed" if figures["oom_kills"] else ""
                peaks.append(f"{name} {_gib(figures['cgroup_peak'])}{kills}")
            group.remove()
        if peaks:
            self._output(f"[launcher] memory peaks under --memory_cap={_gib(self.memory_cap)}: "
                         f"{', '.join(peaks)}")

    def _restart_job(self):
        """Kills every cluster task (the whole job) and starts the cluster again."""
        with self._lock:
            tasks = [t for t in self.tasks if t.config is not None]
        for task in tasks:
            task.signal(signal.SIGKILL)
        for task in tasks:
            task.process.wait()
            self._tell_watchdog(f"-{task.process.pid}")
        with self._lock:
            self.tasks = [t for t in self.tasks if t not in tasks]
            self.replaced.extend(tasks)
        self.job_restarts += 1
        return self._start_cluster()

    def _run(self):
        if self._hosts is not None:
            self._output(f"[launcher] simulated hosts: {self._describe_hosts()}")
        if self.gpus:
            self._output("[launcher] CUDA_VISIBLE_DEVICES per task: " + ", ".join(
                f"{name}={gpus or '(none)'}" for name, gpus in self.gpus.items()))
        dispatcher = self._start_data_service() if self.data_service else None
        data_service_workers = self.tasks[1:]
        user_tasks, fatal_tasks, restartable = self._start_cluster()
        lost, report_deadline = None, None  # A dead server task, and the chief's time to say so.
        deadline = (None if self.timeout_seconds is None
                    else time.monotonic() + self.timeout_seconds)
        given_up = set()  # Worker tasks that exited with no restart left (said once).
        while True:
            if self._interrupted is not None:
                self._output(f"[launcher] got signal {self._interrupted}: stopping all tasks")
                return 128 + self._interrupted
            if deadline is not None and time.monotonic() > deadline:
                running = [t.name for t in user_tasks if t.process.poll() is None]
                self._output(f"[launcher] the run took longer than --timeout="
                             f"{self.timeout_seconds:g}s ({', '.join(running)} still running): "
                             f"stopping all tasks")
                return TIMEOUT_EXIT_CODE
            for task in fatal_tasks:
                code = task.process.poll()
                if code in (None, 0) or task is lost:
                    continue
                if (task in user_tasks and "ps" not in self.cluster
                        and self.job_restarts < self.max_restarts):
                    self._output(f"[launcher] {task.name} exited with code {code}: "
                                 f"restarting the job (restart {self.job_restarts + 1} of "
                                 f"{self.max_restarts}); it resumes from its last backup")
                    user_tasks, fatal_tasks, restartable = self._restart_job()
                    lost = None
                    break
                if task in user_tasks or lost is not None:
                    self._output(f"[launcher] {task.name} exited with code {code}"
                                 f"{self._exit_note(task, code)}: stopping all tasks")
                    return code
                lost, report_deadline = task, time.monotonic() + self.report_seconds
                self._output(f"[launcher] {task.name} exited with code {code}"
                             f"{self._exit_note(task, code)}: waiting up to "
                             f"{self.report_seconds:g}s for the chief to stop")
            if dispatcher is not None and dispatcher.process.poll() is not None:
                code = dispatcher.process.returncode
                self._output(f"[launcher] {dispatcher.name} exited with code {code}: "
                             f"the tf.data service is gone, stopping all tasks")
                return code or 1
            for task in data_service_workers:
                if task.process.poll() is not None and task not in given_up:
                    given_up.add(task)
                    self._output(f"[launcher] {task.name} exited with code "
                                 f"{task.process.returncode} (a tf.data service worker: "
                                 f"not restarted)")
            if all(t.process.poll() == 0 for t in user_tasks):
                return 0  # The chief finished: the run did what it was for.
            if lost is not None and time.monotonic() > report_deadline:
                self._output(f"[launcher] the chief still runs {self.report_seconds:g}s after "
                             f"{lost.name} exited: stopping all tasks")
                return lost.process.returncode
            for i, task in enumerate(restartable):
                self._restart_if_exited(restartable, i, given_up)
            time.sleep(0.1)

    def _restart_if_exited(self, restartable, i, given_up):
        """Starts worker task `restartable[i]` again if it exited and has restarts left."""
        task = restartable[i]
        code = task.process.poll()
        if code is None or task in given_up or not self.max_restarts:
            return
        if task.restarts >= self.max_restarts:
            given_up.add(task)
            self._output(f"[launcher] {task.name} exited with code {code}: not restarting it "
                         f"any more (restarted {task.restarts} of {self.max_restarts} times); "
                         f"the chief decides whether the run goes on")
            return
        self._output(f"[launcher] {task.name} exited with code {code}: restarting it "
                     f"(restart {task.restarts + 1} of {self.max_restarts})")
        new = task.restart()
        self._tell_watchdog(f"-{task.process.pid}")
        self._tell_watchdog(f"+{new.process.pid}")
        with self._lock:  # stop() may run from another thread.
            self.tasks[self.tasks.index(task)] = new
            self.replaced.append(task)
        restartable[i] = new

    def stop(self):
        """Stops every process the tasks started: SIGTERM, then SIGKILL after the grace period.

        Whole process groups are signalled, also for tasks that already exited, so that
        nothing they started is left behind. A restarted task's earlier process groups were
        killed when it was restarted; its current one is stopped here like any other.
        """
        with self._lock:
            tasks, replaced = list(self.tasks), list(self.replaced)
        for task in tasks:
            task.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_seconds
        for task in tasks:
            try:
                task.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for task in tasks:
            task.signal(signal.SIGKILL)
            task.process.wait()
            task.join_output()
        for task in replaced:
            task.join_output()
        self._report_memory()
        self._ports.close()
        if self._hosts is not None:
            self._hosts.close()
