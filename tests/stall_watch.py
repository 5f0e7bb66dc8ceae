"""Watches a pytest process from outside: when a test runs past a limit, records what the
process's threads are doing, as the kernel and a debugger see them.

The in-process stall report (faulthandler) shows Python stacks only, and needs the stalled
process to run; suite runs saw in-process tests stall 87-173 s while their process used ~7 s
of CPU, with no page faults: blocked, on what is unknown. This process needs nothing from the
stalled one. Over a window during the stall it measures, per thread, the time on a CPU and the
time waiting for one (schedstat: starved threads wait on the run queue; blocked ones sleep),
its state, kernel wait channel and kernel stack, and the host's pressure (PSI) and CPU steal;
then it takes every thread's native stack with gdb.

Usage (tests/conftest.py starts it): python stall_watch.py PID SECONDS OUT
then lines on stdin: "start <test id>" and "stop". It exits at end of input.
"""

import os
import re
import select
import shutil
import subprocess
import sys
import time

WINDOW = 10  # seconds over which the stalled process is measured


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _threads(pid):
    """{tid: (name, state, on-CPU ns, run-queue wait ns, wchan)}."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else ():
        base = f"/proc/{pid}/task/{tid}"
        stat = _read(f"{base}/stat")
        sched = _read(f"{base}/schedstat").split()
        if not stat or len(sched) < 2:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        state = stat[stat.rindex(")") + 2]
        out[int(tid)] = (name, state, int(sched[0]), int(sched[1]), _read(f"{base}/wchan"))
    return out


def _host():
    """PSI 'some' totals (us) for cpu, memory and io, and the CPUs' steal time (ticks)."""
    pressure = {}
    for kind in ("cpu", "memory", "io"):
        for line in _read(f"/proc/pressure/{kind}").splitlines():
            if line.startswith("some"):
                pressure[kind] = int(line.split("total=")[1])
    fields = _read("/proc/stat").splitlines()[0].split()
    steal = int(fields[8]) if len(fields) > 8 else 0
    return pressure, steal


def _measure(pid):
    before, (pressure0, steal0) = _threads(pid), _host()
    time.sleep(WINDOW)
    after, (pressure1, steal1) = _threads(pid), _host()
    lines = [f"over {WINDOW} s of the stall: host pressure (some, ms): " + ", ".join(
        f"{k} {(pressure1.get(k, 0) - pressure0.get(k, 0)) / 1000:.0f}" for k in pressure1)
        + f"; CPU steal {(steal1 - steal0) / os.sysconf('SC_CLK_TCK'):.1f} s",
        "threads that ran or waited to run (on CPU s, run-queue wait s, state, wchan, name):"]
    quiet = 0
    for tid, (name, state, cpu, wait, wchan) in sorted(after.items()):
        if tid not in before:
            continue
        cpu, wait = (cpu - before[tid][2]) / 1e9, (wait - before[tid][3]) / 1e9
        if cpu < 0.01 and wait < 0.01 and state == "S":
            quiet += 1
            continue
        stack = _read(f"/proc/{pid}/task/{tid}/stack").split("\n")[:6]
        lines.append(f"  {tid} {cpu:.2f} {wait:.2f} {state} {wchan or '-'} {name}"
                     + "".join(f"\n      {frame}" for frame in stack if frame.strip()))
    lines.append(f"  ({quiet} more threads slept the whole window)")
    return lines


def _native_stacks(pid):
    if shutil.which("gdb") is None:
        return ["(no gdb: native stacks not taken)"]
    try:
        out = subprocess.run(
            ["gdb", "-p", str(pid), "-batch", "-nx", "-ex", "set auto-load off",
             "-ex", "thread apply all bt 14"],
            capture_output=True, text=True, timeout=180).stdout
    except (OSError, subprocess.TimeoutExpired) as error:
        return [f"(gdb failed: {error})"]
    # A thread parked in a thread pool's wait is idle: keep the others, a frame a line.
    kept = []
    for block in out.split("\nThread ")[1:]:
        if any(idle in block for idle in IDLE):
            continue
        head, *frames = block.strip().splitlines()
        kept.append("Thread " + head)
        kept += [_frame(line) for line in frames if line.startswith("#")]
    return ["native stacks of the threads not idle in a thread pool (gdb):"] + kept


IDLE = ("WaitForWork", "do_epoll_wait", "blas_thread_server")


def _frame(line):
    """'#3  0x7f.. in f (a=1, ...) at x.c:5' -> '#3 f  x.c:5' (or the library it is from)."""
    number, _, rest = line.partition(" ")
    rest = re.sub(r"^\s*0x[0-9a-f]+ in ", "", rest.strip())
    name, _, tail = rest.partition(" (")
    where = re.search(r"\) (?:at|from) (\S+)$", rest)
    return f"  {number} {name}  {os.path.basename(where.group(1)) if where else ''}"


def main(pid, seconds, out):
    pid, seconds, current, since, pending = int(pid), float(seconds), None, 0.0, b""
    while True:
        timeout = None if current is None else max(0.0, since + seconds - time.monotonic())
        ready, _, _ = select.select([0], [], [], timeout)
        if ready:
            chunk = os.read(0, 4096)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                command, _, test = line.decode().partition(" ")
                current, since = (test, time.monotonic()) if command == "start" else (None, 0.0)
            continue
        if current is not None:
            lines = [f"NATIVE: {current} still running after {seconds:.0f} s"]
            lines += _measure(pid)
            lines += _native_stacks(pid)
            with open(out, "a") as f:
                f.write("\n".join(lines) + "\n")
            current = None  # once per test


if __name__ == "__main__":
    main(*sys.argv[1:4])
