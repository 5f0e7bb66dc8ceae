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
import functools
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


# Simulated hosts' links: host i > 0 is 10.77.i.2, joined to host 0 (10.77.i.1) by a virtual
# link of its own; host 0 answers at 10.77.1.1 and forwards between the others.
SIMULATED_PREFIX = "10.77"


def simulated_host_address(index):
    """The address of simulated host `index` (0 is the launcher's own namespace).

    >>> [simulated_host_address(i) for i in range(3)]
    ['10.77.1.1', '10.77.1.2', '10.77.2.2']
    """
    return f"{SIMULATED_PREFIX}.1.1" if index == 0 else f"{SIMULATED_PREFIX}.{index}.2"


def _unshare_network():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"cannot create a network namespace: {os.strerror(errno)}")


def _join(path):
    """In a child before exec: joins the network namespace at `path` (/proc/PID/ns/net)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"cannot join the network namespace {path}: "
                                 f"{os.strerror(errno)}")
    finally:
        os.close(fd)


_CAP_NET_ADMIN = 12  # linux/capability.h
_CAPABILITY_VERSION_3 = 0x20080522
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE = 47, 2  # linux/prctl.h


def _keep_network_capability():
    """In a child before exec: keeps CAP_NET_ADMIN through exec (an ambient capability).
    The launcher has every capability in its user namespace, but a program it execs as a
    user other than root there loses them: `ip` could then not make the hosts' links."""
    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # (effective, permitted, inheritable) x 2 words
    if libc.capget(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capget failed")
    data[2] |= 1 << _CAP_NET_ADMIN
    if libc.capset(header, data) != 0 or libc.prctl(
            _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE, _CAP_NET_ADMIN, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"cannot keep CAP_NET_ADMIN for `ip`: {os.strerror(errno)}")


def _in_host(path):
    """In a child before exec: on the host whose namespace is at `path` (None: here), with
    CAP_NET_ADMIN kept for the program it runs."""
    if path is not None:
        _join(path)
    _keep_network_capability()


class SimulatedHosts:
    """`count` hosts on this machine, each a network namespace with its own address.

    Host 0 is this process's namespace (the launcher's private network, which it must be
    in: `enter_private_network`); each other host is a new namespace, kept by a sleeping
    process, joined to host 0 by a virtual ethernet link (iproute2's `ip`), with its own
    loopback and a route to every other host through host 0; with `link_mbit`, each end of
    a link sends at most that many Mbit/s (`tc`'s token bucket), as a network card does
    (a virtual link alone is as fast as memory). Tasks started with
    `joiner(i)` as their pre-exec step run on host i: they bind and connect there, and
    reach the others' addresses over the links, as on separate machines.
    """

    def __init__(self, count, link_mbit=None):
        import shutil
        import subprocess

        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 250:
            raise ValueError(f"--hosts must be an integer from 1 to 250. Received: {count!r}")
        if count > 1 and shutil.which("ip") is None:
            raise OSError("simulated hosts need iproute2's `ip` command on the PATH")
        if link_mbit is not None:
            if isinstance(link_mbit, bool) or not isinstance(link_mbit, (int, float)) \
                    or not link_mbit > 0:
                raise ValueError(f"--link_mbit must be a rate in Mbit/s > 0. Received: "
                                 f"{link_mbit!r}")
            if count > 1 and shutil.which("tc") is None:
                raise OSError("a link rate needs iproute2's `tc` command on the PATH")
        self.link_mbit = link_mbit
        self.count = count
        self.addresses = [simulated_host_address(i) for i in range(count)] if count > 1 \
            else ["127.0.0.1"]
        self._holders = []
        try:
            for index in range(1, count):
                holder = subprocess.Popen(["sleep", "infinity"], preexec_fn=_unshare_network,
                                          stdin=subprocess.DEVNULL)
                self._holders.append(holder)
                self._link(index, holder.pid)
            if count > 2:  # Host 0 carries the traffic between the others.
                with open("/proc/sys/net/ipv4/ip_forward", "w") as f:
                    f.write("1")
        except BaseException:
            self.close()
            raise

    def _link(self, index, pid):
        import subprocess

        net = f"/proc/{pid}/ns/net"
        here, there = (f"{SIMULATED_PREFIX}.{index}.1", f"{SIMULATED_PREFIX}.{index}.2")
        steps = [
            (None, ["ip", "link", "add", f"tfpar{index}", "type", "veth", "peer", "name",
                    "eth0", "netns", str(pid)]),
            (None, ["ip", "addr", "add", f"{here}/24", "dev", f"tfpar{index}"]),
            (None, ["ip", "link", "set", f"tfpar{index}", "up"]),
            (net, ["ip", "link", "set", "lo", "up"]),
            (net, ["ip", "addr", "add", f"{there}/24", "dev", "eth0"]),
            (net, ["ip", "link", "set", "eth0", "up"]),
            (net, ["ip", "route", "add", "default", "via", here]),
        ]
        if self.link_mbit is not None:  # Each end sends at most the rate, as a real NIC.
            shape = ["root", "tbf", "rate", f"{self.link_mbit:g}mbit", "burst", "256kb",
                     "latency", "100ms"]
            steps += [(None, ["tc", "qdisc", "add", "dev", f"tfpar{index}", *shape]),
                      (net, ["tc", "qdisc", "add", "dev", "eth0", *shape])]
        for namespace, command in steps:
            done = subprocess.run(command, capture_output=True, text=True, timeout=30,
                                  preexec_fn=functools.partial(_in_host, namespace))
            if done.returncode != 0:
                raise OSError(f"simulated host {index}: `{' '.join(command)}` failed: "
                              f"{done.stderr.strip()}")

    def joiner(self, index):
        """The pre-exec step that puts a child process on host `index` (None for host 0)."""
        if index == 0:
            return None
        return functools.partial(_join, f"/proc/{self._holders[index - 1].pid}/ns/net")

    def close(self):
        """Ends the hosts' namespaces (once their last process has exited)."""
        for holder in self._holders:
            holder.kill()
            holder.wait()
        self._holders = []
