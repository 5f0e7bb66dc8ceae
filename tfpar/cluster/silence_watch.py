"""Ends a process whose cluster tasks stop answering. Its own process; no TensorFlow.

TensorFlow waits for a remote task that neither answers nor closes its connections (a
stopped or hung process, a network that drops its packets) without end. Measured on TF
2.21, a pipeline chief whose stage worker got SIGSTOP hung in `TFE_ContextAddFunction`
(registering a function on the workers) holding Python's interpreter lock: no thread of
that process runs Python again, so the watch runs here, in a process of its own.

The watched process writes "watch" when it starts waiting on the tasks (fit, evaluate,
predict) and "idle" when it is done; while watching, every task is probed
(`probe.answers`). One silent for `timeout_seconds` gets its message printed, then the
watched process SIGTERM (SIGKILL 5 s later if it still runs). A task that refuses
connections is gone, which TensorFlow itself reports: only silence counts. The watch ends
with its input (the watched process's end).

    python -m tfpar.cluster.silence_watch PID TIMEOUT_SECONDS TASKS_JSON < commands

TASKS_JSON: [[name, "host:port", what it holds], ...].
"""

import json
import os
import select
import signal
import sys
import time

from tfpar.cluster.probe import answers

GRACE_SECONDS = 5.0


def message(name, address, holds, seconds):
    return (f"tfpar: {name} ({address}), which holds {holds}, has not answered for "
            f"{seconds:.0f} s: its process is stopped or hung, or the network drops its "
            f"packets. TensorFlow would wait for it without end (its remote calls have no "
            f"deadline), so this process is ended (SIGTERM). Restart that worker (`python -m "
            f"tfpar.cluster.server` with its TF_CONFIG) and run the program again: with "
            f"keras.callbacks.BackupAndRestore it resumes from the last backup (`tfpar launch "
            f"--coordinator --max_restarts N` does both). PipelineStrategy("
            f"stage_timeout_seconds=...) sets the wait.")


def tell(watcher, command):
    """Writes a command line to a watcher process's input (also tests/stall_watch.py's);
    a watcher that has ended takes nothing down with it."""
    try:
        watcher.stdin.write(f"{command}\n".encode())
        watcher.stdin.flush()
    except OSError:
        pass


def watch(pid, timeout_seconds, tasks, commands_fd=0, probe=answers, out=sys.stderr):
    """Runs the watch (see the module docstring). Returns the silent task's name after
    ending `pid`, or None when the commands end."""
    interval = min(5.0, timeout_seconds / 4)
    watching, silent_since, pending = False, {}, b""
    while True:
        ready, _, _ = select.select([commands_fd], [], [], interval if watching else None)
        if ready:
            chunk = os.read(commands_fd, 4096)
            if not chunk:
                return None
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                watching = line.strip() == b"watch"
                silent_since.clear()  # Each wait starts with a clean slate.
            continue
        for name, address, holds in tasks:
            start = time.monotonic()
            if probe(address, min(5.0, timeout_seconds / 2)) != "silent":
                silent_since.pop(name, None)
                continue
            silent = time.monotonic() - silent_since.setdefault(name, start)
            if silent >= timeout_seconds:
                print(message(name, address, holds, silent), file=out, flush=True)
                _end(pid)
                return name


def _end(pid):
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_SECONDS
        while time.monotonic() < deadline:
            os.kill(pid, 0)  # Raises once it is gone (reaped, or not our child).
            if _zombie(pid):
                return
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)  # A Python SIGTERM handler cannot run without the lock.
    except ProcessLookupError:
        pass


def _zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the watched process's.
    watch(int(sys.argv[1]), float(sys.argv[2]), json.loads(sys.argv[3]))
