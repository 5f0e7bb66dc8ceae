"""Clusters of real processes on 127.0.0.1 for the multi-process tests.

Every process a test starts is killed at the end (whole process groups, and only
those), and every wait has a timeout.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

from tfpar.cluster.launcher import REUSE_PORT_ENV, PortReservation, Task, cluster_jobs, make_cluster
from tfpar.cluster.tf_config import ClusterConfig

SERVER = (sys.executable, "-m", "tfpar.cluster.server")


def alive(pid):
    """Whether process `pid` runs (a zombie is dead for our purpose)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def stop_launcher(process, timeout=20):
    """Stops a `tfpar launch` subprocess as Ctrl-C would (its tasks go with it), then kills
    it if it is still there after `timeout` seconds."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=timeout)
    except Exception:  # subprocess.TimeoutExpired
        process.kill()
        process.wait()


def children_of(parent_pid, job, index=None):
    """Pids of `parent_pid`'s child processes whose TF_CONFIG task type is `job` (and task
    index `index`, unless None)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            task = json.loads(env[b"TF_CONFIG"])["task"]
            if task["type"] == job and index in (None, task.get("index", 0)):
                found.append(int(entry))
        except (OSError, ValueError, KeyError):
            continue
    return found


@contextlib.contextmanager
def cpu_load(processes):
    """`processes` busy-looping Python processes for the time of the block, then killed."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(processes)]
    try:
        yield
    finally:
        for process in busy:
            process.kill()
            process.wait(10)


def launch(command):
    """The launcher running `command`, its output lines as they come, and their reader."""
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
    reader.start()
    return launcher, lines, reader


def wait_for_line(prefix, launcher, lines, timeout):
    """Waits until an output line starts with `prefix`; fails if the launcher ends first."""
    deadline = time.monotonic() + timeout
    while not any(line.startswith(prefix) for line in list(lines)):
        assert launcher.poll() is None and time.monotonic() < deadline, "".join(lines)[-4000:]
        time.sleep(0.2)


class Cluster:
    """Tasks started by a test, with their output collected."""

    def __init__(self, workers, ps=0):
        # Held until kill_all, as the launcher holds its ports.
        self._ports = PortReservation(sum(n for _, n in cluster_jobs(workers, ps)))
        self.cluster = make_cluster(workers, ps, ports=self._ports.ports)
        self.lines = []
        self.tasks = {}
        self._lock = threading.Lock()

    def _collect(self, line):
        with self._lock:
            self.lines.append(line)

    def start(self, args, job="worker", index=None):
        """Runs `python *args` as task(s) of `job` (all of them when `index` is None)."""
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **REUSE_PORT_ENV)
        indices = range(len(self.cluster[job])) if index is None else [index]
        for i in indices:
            config = ClusterConfig(self.cluster, job, i)
            self.tasks[config.task_name] = Task(config, [sys.executable, *args], env, self._collect)

    def start_servers(self):
        """`python -m tfpar.cluster.server` for every worker and ps task."""
        for job in ("worker", "ps"):
            for i in range(len(self.cluster.get(job, ()))):
                self.start(SERVER[1:], job, i)

    def process(self, name):
        return self.tasks[name].process

    def wait(self, names, timeout):
        deadline = time.monotonic() + timeout
        codes = [self.process(n).wait(max(0.1, deadline - time.monotonic())) for n in names]
        for name in names:
            self.tasks[name].join_output()
        return codes

    def wait_for(self, text, name, timeout):
        """Waits until `text` appears in `name`'s output; fails if the task ends first."""
        deadline = time.monotonic() + timeout
        while text not in self.output(name):
            if time.monotonic() > deadline or self.process(name).poll() is not None:
                raise AssertionError(f"{text!r} not seen from {name}:\n{self.output()[-4000:]}")
            time.sleep(0.05)

    def output(self, name=None):
        with self._lock:
            return "\n".join(l for l in self.lines if name is None or l.startswith(f"[{name}]"))

    def kill(self, name):
        self.tasks[name].signal(signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.process(name).wait(10)

    def kill_all(self):
        for name in list(self.tasks):
            self.kill(name)
        self._ports.close()


def run_in_own_session(command, timeout):
    """(exit code, output) of `command`, run in a session of its own that is killed whole
    after `timeout` seconds (an AssertionError then) and at the end, with whatever it left
    behind."""
    process = subprocess.Popen(command, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"{command} took over {timeout} s:\n{output.decode()[-3000:]}")
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return process.returncode, output.decode(errors="replace")
