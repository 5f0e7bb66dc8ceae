"""Start a local TF_CONFIG cluster: one process per task on 127.0.0.1. No TensorFlow here.

Without parameter servers every worker runs the user's command (worker 0 is the
chief). With parameter servers the chief runs the command and the workers and ps
tasks run `python -m tfpar.server`. Each output line is prefixed with its task;
when a task that matters fails, the others are stopped and its exit code returned.
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from tfpar.cluster.tf_config import ClusterConfig

SERVER_COMMAND = (sys.executable, "-m", "tfpar.server")


def free_ports(count, host="127.0.0.1"):
    """Ports free on `host` now (all held open together, so they are distinct)."""
    with contextlib.ExitStack() as stack:
        sockets = []
        for _ in range(count):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]


def make_cluster(workers, ps=0, host="127.0.0.1"):
    """The cluster dict for `workers` workers and `ps` parameter servers (plus a chief if ps)."""
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--workers must be an integer >= 1. Received: {workers!r}")
    if not isinstance(ps, int) or ps < 0:
        raise ValueError(f"--ps must be an integer >= 0. Received: {ps!r}")
    jobs = ([("chief", 1)] if ps else []) + [("worker", workers)] + ([("ps", ps)] if ps else [])
    ports = iter(free_ports(sum(n for _, n in jobs), host))
    return {job: tuple(f"{host}:{next(ports)}" for _ in range(n)) for job, n in jobs}


class Task:
    """One started process of the cluster."""

    def __init__(self, config, command, env, output):
        self.name = config.task_name
        env = dict(env, TF_CONFIG=config.to_json(), PYTHONUNBUFFERED="1")
        # Own session: stopping a task stops everything it started, and nothing else.
        self.process = subprocess.Popen(
            list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
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


class Launcher:
    """Runs one process per task of a local cluster. Use `run()`; see `tfpar launch`."""

    def __init__(self, command, workers, ps=0, host="127.0.0.1", grace_seconds=5.0,
                 server_command=SERVER_COMMAND, env=None, output=None, report_seconds=60.0):
        if not command:
            raise ValueError("No command to launch: give it after '--', e.g. "
                             "tfpar launch --workers 2 -- python train.py")
        self.command = list(command)
        self.cluster = make_cluster(workers, ps, host)
        self.grace_seconds = grace_seconds
        # After a ps dies, the chief gets this long to fail on its own: its error says
        # which task was lost and how to resume, which the launcher cannot.
        self.report_seconds = report_seconds
        self.server_command = list(server_command)
        self.env = dict(os.environ if env is None else env)
        self._lock = threading.Lock()
        self._output = output or self._print
        self.tasks = []

    def _print(self, line):
        with self._lock:
            print(line, flush=True)

    def _plan(self):
        """(config, command, runs_user_code, fatal) for every task.

        The run succeeds when every task running the user's command exits 0; it fails
        when one of those fails, or a ps task dies (its variables are gone; the chief
        gets `report_seconds` to fail with its own error first). A worker server that
        dies is not fatal: a parameter-server coordinator reschedules its work.
        """
        has_ps = "ps" in self.cluster
        plan = []
        for job, addresses in self.cluster.items():
            for index in range(len(addresses)):
                config = ClusterConfig(self.cluster, job, index)
                runs_user_code = job == "chief" or not has_ps
                plan.append((config, self.command if runs_user_code else self.server_command,
                             runs_user_code, runs_user_code or job == "ps"))
        return plan

    def run(self):
        """Starts every task and waits; returns the exit code of the run."""
        previous = {sig: signal.signal(sig, self._on_signal)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        self._interrupted = None
        try:
            return self._run()
        finally:
            self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum, frame):
        self._interrupted = signum

    def _run(self):
        user_tasks, fatal_tasks = [], []
        for config, command, runs_user_code, fatal in self._plan():
            task = Task(config, command, self.env, self._output)
            self.tasks.append(task)
            if runs_user_code:
                user_tasks.append(task)
            if fatal:
                fatal_tasks.append(task)
        lost, report_deadline = None, None  # A dead server task, and the chief's time to say so.
        while True:
            if self._interrupted is not None:
                self._output(f"[launcher] got signal {self._interrupted}: stopping all tasks")
                return 128 + self._interrupted
            for task in fatal_tasks:
                code = task.process.poll()
                if code in (None, 0) or task is lost:
                    continue
                if task in user_tasks or lost is not None:
                    self._output(f"[launcher] {task.name} exited with code {code}: "
                                 f"stopping all tasks")
                    return code
                lost, report_deadline = task, time.monotonic() + self.report_seconds
                self._output(f"[launcher] {task.name} exited with code {code}: waiting up to "
                             f"{self.report_seconds:g}s for the chief to stop")
            if all(t.process.poll() == 0 for t in user_tasks):
                return 0  # The chief finished: the run did what it was for.
            if lost is not None and time.monotonic() > report_deadline:
                self._output(f"[launcher] the chief still runs {self.report_seconds:g}s after "
                             f"{lost.name} exited: stopping all tasks")
                return lost.process.returncode
            time.sleep(0.1)

    def stop(self):
        """Stops every process the tasks started: SIGTERM, then SIGKILL after the grace period.

        Whole process groups are signalled, also for tasks that already exited, so that
        nothing they started is left behind.
        """
        for task in self.tasks:
            task.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_seconds
        for task in self.tasks:
            try:
                task.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for task in self.tasks:
            task.signal(signal.SIGKILL)
            task.process.wait()
            task.join_output()
