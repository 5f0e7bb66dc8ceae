"""Hierarchical all-reduce over hosts: which replicas meet where, and the bytes (plain Python).

`DataParallelStrategy(communication="hierarchical")` across workers on several hosts sums in
three steps (`tfpar.distribute.common.hierarchical_reduce` carries them out):

1. the replicas of each host sum the whole buffer among themselves;
2. the i-th replica of every host sums the i-th of L slices of it across the hosts, so each
   host's link carries 2 (H-1)/H of the buffer in all, split over its L replicas;
3. the replicas of each host put their slices together again (a sum of zero-padded slices).

A flat ring over all H x L replicas crosses between hosts on every step of its 2 (HL - 1);
here only step 2 does, on 2 (H - 1) steps. A host is the host part of a task's address in
the cluster (`host:port`): tasks that share it share a machine.

    >>> layout = plan([0, 0, 1, 1])
    >>> layout.hosts, layout.per_host
    ([[0, 1], [2, 3]], 2)
    >>> layout.cross_group(1)
    [1, 3]
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """Replicas by host: `hosts[h]` the ranks on host h, in rank order, `per_host` of each."""

    hosts: list
    per_host: int

    def place(self, rank):
        """(host index, index among the host's replicas) of replica `rank`."""
        for host, ranks in enumerate(self.hosts):
            if rank in ranks:
                return host, ranks.index(rank)
        raise ValueError(f"No replica {rank} among {self.hosts}.")

    def cross_group(self, local):
        """The ranks that sum slice `local` across hosts: the `local`-th of every host."""
        return [ranks[local] for ranks in self.hosts]

    @property
    def hierarchical(self):
        """Whether the three steps differ from one all-reduce over every replica."""
        return len(self.hosts) > 1 and self.per_host > 1


def plan(host_of_rank):
    """The `HostLayout` of replicas whose hosts are `host_of_rank` (a host id per rank).

    Every host must hold as many replicas: step 2 pairs them up by their index there.
    """
    hosts = {}
    for rank, host in enumerate(host_of_rank):
        hosts.setdefault(host, []).append(rank)
    counts = sorted({len(ranks) for ranks in hosts.values()})
    if len(counts) > 1:
        raise ValueError(
            f"communication='hierarchical' needs as many replicas on every host; these "
            f"hosts hold {', '.join(str(len(r)) for r in hosts.values())}. Use "
            f"communication='ring', or as many workers (and GPUs) per host.")
    return HostLayout(list(hosts.values()), counts[0] if counts else 0)


def host_of_address(address):
    """The host part of a task address: "10.0.0.5:2222" -> "10.0.0.5", "[::1]:2222" ->
    "[::1]"."""
    return address.rsplit(":", 1)[0]


def replica_hosts(task_addresses, replicas_per_task):
    """A host id per replica rank, the ranks numbered task by task (`task_addresses` in
    the order the collective numbers its tasks), each task holding `replicas_per_task`.

    >>> replica_hosts(["a:1", "a:2", "b:1"], 2)
    ['a', 'a', 'a', 'a', 'b', 'b']
    """
    return [host_of_address(a) for a in task_addresses for _ in range(replicas_per_task)]


def slice_elements(elements, per_host):
    """Elements of each of the `per_host` slices of an `elements` buffer (the last padded)."""
    return -(-elements // per_host)


def bytes_sent(nbytes, hosts, per_host):
    """Bytes one replica sends to sum an `nbytes` buffer: a ring within its host (twice,
    steps 1 and 3), and a ring of its slice across the hosts (step 2).

    >>> bytes_sent(1200, 2, 2)
    3000.0
    """
    within = 2 * (per_host - 1) / per_host * nbytes
    across = 2 * (hosts - 1) / hosts * nbytes / per_host
    return 2 * within + across


def bytes_between_hosts(nbytes, hosts, per_host):
    """Bytes that leave each host to sum an `nbytes` buffer (step 2, its replicas together):
    2 (H-1)/H of the buffer whatever `per_host`.

    >>> bytes_between_hosts(1200, 2, 4)
    1200.0
    """
    return per_host * 2 * (hosts - 1) / hosts * nbytes / per_host


def sequential_steps_between_hosts(hosts, per_host, hierarchical=True):
    """Message steps that cross between hosts, one after another: step 2's ring, against a
    flat ring over all H x L replicas, every one of whose 2 (HL - 1) steps crosses.

    >>> sequential_steps_between_hosts(8, 8), sequential_steps_between_hosts(8, 8, False)
    (14, 126)
    """
    world = hosts * per_host if not hierarchical else hosts
    return 2 * (world - 1)
