"""A private network for a local cluster. No TensorFlow here.

TensorFlow's gRPC servers listen on every interface, whatever host the cluster
spec names: TF 2.21 binds "[::]:port" (measured with `ss -ltn`: `*:port`) and has
no option to choose the address, and they do not authenticate callers. Anyone who
reaches a port can run graphs as the user. When every task is on this machine, the
launcher closes that door another way: it moves itself, before starting any task,
into a new network namespace (Linux user namespaces, no root needed) where the only
interface is loopback. Its tasks reach each other on 127.0.0.1; nothing outside the
namespace reaches them, and they cannot reach the outside network either.

    >>> from tfpar.cluster.network import is_loopback
    >>> is_loopback("127.0.0.1"), is_loopback("10.0.0.5")
    (True, False)
"""

import ctypes
import fcntl
import ipaddress
import os
import socket
import struct
import sys

AUTO, PRIVATE, HOST = "auto", "private", "host"
MODES = (AUTO, PRIVATE, HOST)

_CLONE_NEWUSER = 0x10000000  # linux/sched.h
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1  # linux/sockios.h, if.h


def is_loopback(host):
    """Whether `host` names this machine's loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def enter_private_network():
    """Moves this process into a new network namespace with only loopback, up.

    Processes it starts afterwards share the namespace. The user and group ids stay
    the same (mapped to themselves in a new user namespace). Call it while the
    process has one thread (Linux refuses a user namespace to a threaded process).

    Raises:
      OSError: when the system does not allow it (not Linux, or unprivileged user
        namespaces disabled, e.g. kernel.unprivileged_userns_clone=0 or an
        AppArmor restriction), saying why.
    """
    if not sys.platform.startswith("linux"):
        raise OSError("private networks need Linux network namespaces")
    uid, gid = os.getuid(), os.getgid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"cannot create a user and network namespace: "
                             f"{os.strerror(errno)}")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, _SIOCGIFFLAGS, request)[:18])[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))


def choose_network(mode, host, enter=enter_private_network):
    """Applies `--network=mode` for tasks on `host`; returns (mode used, a note to print).

    "private": the tasks run in a private network (fails if that is not possible);
    "host": they share the machine's network; "auto": private when every task is on
    loopback and the system allows it, else host, with a note on what is exposed.
    """
    if mode not in MODES:
        raise ValueError(f"--network must be one of {', '.join(MODES)}. Received: {mode!r}")
    exposed = ("TensorFlow's servers listen on all interfaces without authentication: "
               "keep the cluster's ports unreachable from untrusted networks "
               "(docs/guides/multi-worker.md, Security)")
    if mode == HOST:
        return HOST, exposed
    if not is_loopback(host):
        if mode == PRIVATE:
            raise ValueError(
                f"--network=private keeps tasks on loopback, but --host={host} is meant to "
                f"be reached from elsewhere. Use --host=127.0.0.1, or --network=host.")
        return HOST, exposed
    try:
        enter()
    except OSError as error:
        if mode == PRIVATE:
            raise ValueError(f"--network=private: {error}. Use --network=host (see "
                             f"docs/guides/multi-worker.md, Security).") from None
        return HOST, f"no private network ({error}); {exposed}"
    return PRIVATE, ("tasks run in a private network (loopback only): nothing outside can "
                     "reach their servers, and they cannot reach the network. Pass "
                     "--network=host if the job needs it (downloads, remote storage)")
