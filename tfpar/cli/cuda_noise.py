"""TensorFlow's CUDA probe noise kept out of a program's output on a host with no GPU.

On such a host TensorFlow 2.21 logs that it found no CUDA driver and that cuInit failed,
twice over, and its first lines come before absl's logging starts, so
`TF_CPP_MIN_LOG_LEVEL` does not reach them; `CUDA_VISIBLE_DEVICES=""` or `-1` does not
stop them either (measured). `filter_stderr()` passes the process's stderr (file
descriptor 2: TensorFlow's C++ logs and Python's) through a child process that drops
those lines and forwards every other one. A child, not a thread: if the program dies,
the child still forwards what it wrote. Nothing here runs on import.
"""

import atexit
import glob
import os
import re
import subprocess
import sys

# Dropped on a host with no GPU: the CUDA probe's lines.
CUDA_PROBE = (r"failed call to cuInit", r"Could not find cuda drivers on your machine")
# Dropped when TF_CPP_MIN_LOG_LEVEL >= 1: the INFO lines written before absl's logging
# starts (which ignore that level), and absl's banner announcing them.
_INFO = r"^I\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] "
_BANNER = r"^WARNING: All log messages before absl::InitializeLog\(\) is called"

# The child: reads lines from stdin, writes those no pattern matches to stdout (the
# program's stderr), line by line; ignores Ctrl-C (the program's to handle), ends at EOF.
_FILTER = """
import re, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
noise = re.compile("|".join(sys.argv[1:]).encode())
for line in sys.stdin.buffer:
    if not noise.search(line):
        sys.stdout.buffer.write(line)
        sys.stdout.buffer.flush()
"""


def gpu_absent():
    """True when the host has no NVIDIA device node and no NVIDIA driver (cheap: reads no
    TensorFlow)."""
    return not glob.glob("/dev/nvidia*") and not os.path.exists("/proc/driver/nvidia")


def noise_patterns(environ=None):
    """The regular expressions of the lines `filter_stderr` drops here and now."""
    environ = os.environ if environ is None else environ
    patterns = list(CUDA_PROBE) if gpu_absent() else []
    try:
        level = int(environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        level = 0
    if level >= 1:
        patterns += [_INFO, _BANNER]
    return patterns


def is_noise(line, patterns):
    return bool(patterns) and re.search("|".join(patterns), line) is not None


def filter_stderr():
    """From now on, the lines of `noise_patterns()` written to this process's stderr are
    dropped. Call it before TensorFlow is imported. Returns the filter process (None: no
    pattern applies here)."""
    patterns = noise_patterns()
    if not patterns:
        return None
    sys.stderr.flush()
    original = os.dup(2)
    read, write = os.pipe()
    child = subprocess.Popen([sys.executable, "-c", _FILTER, *patterns], stdin=read,
                             stdout=original, stderr=original)
    os.close(read)
    os.dup2(write, 2)
    os.close(write)

    def drain():
        # (Python has printed an uncaught exception's traceback by now.) The pipe's last
        # writer goes, the child forwards what is left and ends.
        sys.stderr.flush()
        os.dup2(original, 2)
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass  # A process this one started still holds the pipe: the child ends with it.

    atexit.register(drain)
    return child
