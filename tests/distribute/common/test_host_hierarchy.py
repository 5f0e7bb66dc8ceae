"""Hierarchical all-reduce over hosts: the plan (pure Python) and the collectives that carry
it out on logical CPUs (`communication="hierarchical"` across workers; the workers on two
simulated hosts: tests/distribute/data_parallel/test_multi_worker.py)."""

import numpy as np
import pytest
import tensorflow as tf
from conftest import check_routed_all_reduce, routed_all_reduce_ops

from tfpar.distribute.common import group_keys
from tfpar.distribute.common.hierarchical_reduce import HostHierarchy
from tfpar.plan import communication
from tfpar.plan import host_hierarchy as hh


def _simulate(buffers, layout):
    """The three steps on numpy buffers, one per rank; (results, elements each rank sent
    within its host, and across hosts, by a ring's count of 2 (n-1)/n of the buffer)."""
    per_host, hosts = layout.per_host, len(layout.hosts)
    size = len(buffers[0])
    chunk = hh.slice_elements(size, per_host)
    padded = [np.pad(b, (0, per_host * chunk - size)) for b in buffers]
    host_sums = {h: sum(padded[r] for r in ranks) for h, ranks in enumerate(layout.hosts)}
    slices = {}
    for local in range(per_host):
        group = layout.cross_group(local)
        total = sum(host_sums[layout.place(r)[0]][local * chunk:(local + 1) * chunk]
                    for r in group)
        for r in group:
            slices[r] = total
    results = []
    for rank in range(len(buffers)):
        host, _ = layout.place(rank)
        whole = np.concatenate([slices[r] for r in layout.hosts[host]])
        results.append(whole[:size])
    within = 2 * 2 * (per_host - 1) / per_host * per_host * chunk
    across = 2 * (hosts - 1) / hosts * chunk
    return results, within, across


@pytest.mark.parametrize("hosts, per_host, size", [(2, 2, 7), (3, 2, 8), (2, 4, 9), (4, 3, 5)])
def test_every_replica_ends_with_the_sum_and_sends_what_the_formulas_say(hosts, per_host, size):
    rng = np.random.default_rng(0)
    host_of_rank = [h for h in range(hosts) for _ in range(per_host)]
    layout = hh.plan(host_of_rank)
    assert layout.hierarchical and len(layout.hosts) == hosts
    buffers = [rng.integers(-99, 99, size) for _ in host_of_rank]
    results, within, across = _simulate(buffers, layout)
    for got in results:
        np.testing.assert_array_equal(got, sum(buffers))
    nbytes = per_host * hh.slice_elements(size, per_host)  # (The padded buffer.)
    assert hh.bytes_sent(nbytes, hosts, per_host) == pytest.approx(within + across)
    # What leaves a host: its replicas' slices across, 2 (H-1)/H of the buffer in all.
    assert hh.bytes_between_hosts(nbytes, hosts, per_host) == pytest.approx(per_host * across)
    assert hh.sequential_steps_between_hosts(hosts, per_host) < \
        hh.sequential_steps_between_hosts(hosts, per_host, hierarchical=False)


def test_hosts_come_from_the_task_addresses_and_must_hold_as_many_replicas():
    assert hh.replica_hosts(["10.0.0.1:2222", "10.0.0.1:2223", "10.0.0.2:2222",
                              "10.0.0.2:2223"], 1) == ["10.0.0.1"] * 2 + ["10.0.0.2"] * 2
    layout = hh.plan(["a", "b", "a", "b"])  # Ranks of a host need not be neighbours.
    assert layout.hosts == [[0, 2], [1, 3]] and layout.place(3) == (1, 1)
    assert not hh.plan(["a", "a"]).hierarchical and not hh.plan(["a", "b"]).hierarchical
    with pytest.raises(ValueError, match="as many replicas on every host; these hosts hold "
                                         "2, 1. Use communication='ring'"):
        hh.plan(["a", "a", "b"])
    assert communication.select_communication("hierarchical", ["CPU"], multi_worker=True) \
        == "hierarchical"
    with pytest.raises(ValueError, match="communication='hierarchical' with "
                                         "shard='parameters' is not supported yet"):
        communication.check_sharded_communication("hierarchical", "parameters",
                                                   multi_worker=True)
    assert communication.check_sharded_communication("hierarchical", "parameters") \
        == "hierarchical"  # (On one host: TensorFlow's HierarchicalCopyAllReduce.)


def test_hierarchy_group_keys_sit_between_tensorflows_and_the_broadcast():
    base = group_keys.next_key_base(across_workers=True)
    keys = [group_keys.hierarchy_key(base, i) for i in range(100)]
    assert len(set(keys)) == 100 and base + 300 < min(keys)
    assert max(keys) < group_keys.broadcast_key(base)
    with pytest.raises(ValueError, match="group keys for 100 groups"):
        group_keys.hierarchy_key(base, 100)


def test_routed_all_reduces_sum_within_hosts_then_across_them():
    """4 logical CPUs as 2 hosts of 2 (ranks 0, 2 on one; 1, 3 on the other): each replica
    makes 3 sums in groups of 2 (its host, its slice across hosts, its host again), and
    every replica ends with the same sum."""
    n = 4
    ops, devices, base = routed_all_reduce_ops(
        n, lambda base: HostHierarchy(hh.plan([0, 1, 0, 1]), base))
    graph = check_routed_all_reduce(ops, n, devices)
    sums = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
    assert len(sums) == 3 * n and all(tf.get_static_value(op.inputs[1]) == 2 for op in sums)
    groups = {int(tf.get_static_value(op.inputs[2])) for op in sums}
    hosts, across = ([group_keys.hierarchy_key(base, i) for i in (0, 1)],
                     [group_keys.hierarchy_key(base, i) for i in (2, 3)])
    assert groups == set(hosts + across)
    on_first = [int(tf.get_static_value(op.inputs[2])) for op in sums
                if op.device == devices[0]]
    assert on_first == [hosts[0], across[0], hosts[0]]  # Rank 0: host 0, slice 0, host 0.


def test_docstring_examples_run():
    import doctest

    from tfpar.cluster import network

    for module in (hh, network):
        result = doctest.testmod(module)
        assert result.attempted and not result.failed, module.__name__
