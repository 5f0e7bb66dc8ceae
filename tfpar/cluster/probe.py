"""Is every task of a cluster listening, and answering? Plain sockets, no TensorFlow.

TensorFlow's own connection to a missing task retries for a long time; probing
first turns that into a clear error within the timeout. A stopped process (or one
cut off by the network) still has its connections accepted by the kernel, so
`answers` asks for more: the gRPC server's first HTTP/2 frame.
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


# An HTTP/2 client's connection preface and an empty SETTINGS frame (RFC 9113, 3.4): every
# HTTP/2 server, gRPC's included, answers with a SETTINGS frame of its own at once.
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS = 4


def answers(address, timeout_seconds=5.0):
    """How a task's gRPC server at "host:port" responds now: "answers" (it sent its HTTP/2
    SETTINGS frame), "refuses" (no process listens: it is gone), or "silent" (accepted by
    the kernel, or not even that, but nothing answered within `timeout_seconds`: the
    process is stopped or hung, or the network drops its packets)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)),
                                      timeout=timeout_seconds) as connection:
            connection.settimeout(timeout_seconds)
            connection.sendall(_HTTP2_PREFACE)
            header = b""
            while len(header) < 9:  # A frame header: length (3), type (1), flags, stream.
                chunk = connection.recv(9 - len(header))
                if not chunk:
                    return "refuses"  # Closed on us: not an HTTP/2 server that lives.
                header += chunk
            return "answers" if header[3] == _SETTINGS else "refuses"
    except ConnectionError:  # Refused or reset: nothing lives there.
        return "refuses"
    except OSError:  # A timeout, or a host that cannot be reached.
        return "silent"
