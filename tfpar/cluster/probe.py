"""Is every task of a cluster listening? Plain sockets, no TensorFlow.

TensorFlow's own connection to a missing task retries for a long time; probing
first turns that into a clear error within the timeout.
"""

import socket
import time

from tfpar.errors import ClusterError


def unreachable_tasks(cluster, jobs, timeout_seconds=30.0, poll_seconds=0.2):
    """Waits until every task of `jobs` accepts TCP connections, or the timeout passes.

    Args:
      cluster: job name -> list of "host:port" (as in `ClusterConfig.cluster`).
      jobs: the jobs to probe, e.g. ("worker", "ps").
      timeout_seconds: how long tasks that are still starting get.

    Returns:
      The "job:index (host:port)" names of tasks still unreachable; empty when all listen.
    """
    pending = {f"{job}:{i} ({address})": address
               for job in jobs for i, address in enumerate(cluster.get(job, ()))}
    deadline = time.monotonic() + timeout_seconds
    while pending:
        for name, address in list(pending.items()):
            if listening(address):
                del pending[name]
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(poll_seconds)
    return sorted(pending)


def require_reachable(cluster, jobs, timeout_seconds, how_to_start):
    """Waits as `unreachable_tasks` does; raises ClusterError naming the tasks still
    unreachable after `timeout_seconds`, with `how_to_start` them (a sentence)."""
    missing = unreachable_tasks(cluster, jobs, timeout_seconds)
    if missing:
        raise ClusterError(
            f"Cannot reach {', '.join(missing)} after {timeout_seconds:g}s. {how_to_start}, "
            f"and check the addresses.")


def listening(address):
    """Whether a task accepts TCP connections at "host:port" now."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
            return True
    except OSError:
        return False
