"""Halving-doubling all-reduce: the plan of exchanges (pure Python) and the collectives that
carry it out on logical CPUs (`communication="halving_doubling"`)."""

import random

import numpy as np
import pytest
import tensorflow as tf
from conftest import check_routed_all_reduce, cpus, routed_all_reduce_ops

import tfpar
from tfpar.distribute.common import group_keys
from tfpar.distribute.common.pair_exchanges import Exchanges
from tfpar.keras import tf_runtime
from tfpar.plan import halving_doubling as hd


@pytest.mark.parametrize("algorithm", hd.ALGORITHMS)
def test_every_replica_ends_with_the_sum_for_any_number_of_replicas(algorithm):
    rng = random.Random(0)
    for world in range(1, 18):
        for size in (1, 3, 8, 37):
            buffers = [[rng.randint(-99, 99) for _ in range(size)] for _ in range(world)]
            want = [sum(column) for column in zip(*buffers)]
            assert hd.simulate(buffers, algorithm) == [want] * world, (world, size)


def _sent(rank, world, algorithm, nbytes):
    """Bytes replica `rank` sends, counted from its plan (a hand-over sends the buffer)."""
    chunk = -(-nbytes // hd.core_size(world))
    total = 0
    for step in hd.plan(rank, world, algorithm):
        if step.kind in (hd.GIVE, hd.GIVE_RESULT, hd.SWAP):
            total += nbytes
        elif step.kind == hd.HALVE:
            total += (step.send[1] - step.send[0]) * chunk
        elif step.kind == hd.DOUBLE:
            total += (step.keep[1] - step.keep[0]) * chunk
    return total


@pytest.mark.parametrize("world", [2, 3, 4, 6, 8, 16])
def test_the_plans_send_what_the_formulas_say_in_fewer_steps_than_a_ring(world):
    nbytes = 1 << 20
    for algorithm in hd.ALGORITHMS:
        busiest = max(_sent(r, world, algorithm, nbytes) for r in range(world))
        assert busiest == hd.bytes_sent(nbytes, world, algorithm), (world, algorithm)
        assert max(len(hd.plan(r, world, algorithm)) for r in range(world)) == \
            hd.sequential_steps(world, algorithm)
    if world == hd.core_size(world):  # A power of two: a ring's bytes, fewer steps.
        assert hd.bytes_sent(nbytes, world, hd.HALVING_DOUBLING) == \
            hd.bytes_sent(nbytes, world, "ring")
        if world > 2:
            assert hd.sequential_steps(world, hd.HALVING_DOUBLING) < \
                hd.sequential_steps(world, "ring")


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="rank must be a replica index in"):
        hd.plan(4, 4)
    with pytest.raises(ValueError, match="Unknown all-reduce algorithm 'tree'"):
        hd.plan(0, 4, "tree")
    with pytest.raises(ValueError, match="integer >= 1"):
        hd.core_size(0)


def test_exchange_group_keys_are_distinct_and_clear_of_the_strategies_blocks():
    base = group_keys.next_key_base(across_workers=True)
    keys = {group_keys.exchange_key(base, lower, level)
            for lower in range(64) for level in range(7)}
    assert len(keys) == 64 * 7
    assert min(keys) > base + 1000 and max(keys) < 2**31
    local = group_keys.next_key_base()
    assert not keys & {group_keys.exchange_key(local, lower, level)
                       for lower in range(64) for level in range(7)}


def test_strategies_without_halving_doubling_take_none_of_its_keys():
    """Only halving-doubling strategies count against its 512 per process (the suite's one
    pytest process made 514 strategies of every kind, and the next halving-doubling one was
    refused)."""
    first = group_keys.next_key_base()
    slot = group_keys.exchange_slot(first)
    for _ in range(600):  # Strategies that never exchange in pairs.
        group_keys.next_key_base()
    second = group_keys.next_key_base()
    assert group_keys.exchange_slot(second) == slot + 1
    assert group_keys.exchange_key(second, 0, 0) != group_keys.exchange_key(first, 0, 0)


@pytest.mark.parametrize("n, doubling_bytes, gathers", [
    (4, 0, 4),        # halving-doubling: 2 log2(4) exchanges per replica
    (4, 1 << 20, 2),  # recursive doubling: log2(4)
    (3, 0, 2),        # 3 = 2 + 1: the third hands over, the core of 2 halves and doubles
])
def test_routed_all_reduces_sum_on_every_replica_by_pairs(n, doubling_bytes, gathers):
    ops, devices, _ = routed_all_reduce_ops(
        n, lambda base: Exchanges(n, base, doubling_bytes=doubling_bytes))
    graph = check_routed_all_reduce(ops, n, devices)
    pairs = [op for op in graph.get_operations()
             if op.type in ("CollectiveGatherV2", "CollectiveReduceV2")]
    assert pairs and all(tf.get_static_value(op.inputs[1]) == 2 for op in pairs)  # Pairs.
    on_first = [op for op in pairs if op.type == "CollectiveGatherV2"
                and op.device == devices[0]]
    assert len(on_first) == gathers
    handed_over = [op for op in pairs if op.type == "CollectiveReduceV2"]
    assert len(handed_over) == (4 if n == 3 else 0)  # Each hand-over on both of its sides.


def test_halving_doubling_is_refused_under_shard_and_outside_data_parallelism():
    with pytest.raises(ValueError, match="communication='halving_doubling' with "
                                         "shard='optimizer' is not supported yet"):
        tfpar.DataParallelStrategy(cpus(2), communication="halving_doubling", shard="optimizer")
    strategy = tfpar.DataParallelStrategy(cpus(2), communication="halving_doubling",
                                          bytes_per_pack=1024)
    assert repr(strategy) == ("DataParallelStrategy(replicas=2, "
                              "communication='halving_doubling')")


def test_a_timeout_goes_on_the_first_collective_of_each_function_only():
    """TensorFlow holds a thread for each collective with a timeout for as long as the
    timeout (BUILD_NOTES): a Keras fit of 1,024 steps on 2 workers left 12,400 threads in
    each at the 600 s default. tfpar's launchers time the first collective each replica
    launches in a traced function, which a peer that never comes still stops."""
    devices = [tf_runtime.canonical_device(d) for d in cpus(2)]
    strategy = tfpar.DataParallelStrategy(cpus(2), communication="ring")
    keys = tf_runtime.collective_keys(strategy.extended)
    ops = tf_runtime.ring_all_reduce(devices, 0, keys)
    options = tf_runtime.collective_options(
        timeout_seconds=30.0, implementation=tf_runtime.collective_implementation("ring"))
    tf_runtime.replace_launchers(ops, 2, keys, options, 0)
    values = tf_runtime.per_replica([tf.ones([3]) * (i + 1) for i in range(2)])

    @tf.function
    def step(values):
        first = ops.batch_reduce(tf.distribute.ReduceOp.SUM, [(values, values)])[0]
        second = ops.batch_reduce(tf.distribute.ReduceOp.SUM, [(first, first)])[0]
        return list(second.values)

    np.testing.assert_allclose(step(values)[1].numpy(), [6.0] * 3)
    reduces = [op for op in step.get_concrete_function(values).graph.get_operations()
               if op.type == "CollectiveReduceV2"]
    timeouts = sorted(op.get_attr("timeout_seconds") for op in reduces)
    assert timeouts == [0.0, 0.0, 30.0, 30.0], timeouts  # One timed per replica.


@pytest.mark.parametrize("options, dtype", [(dict(compression="fp16"), "float16"),
                                            (dict(sync_every=2), "float32")])
def test_halving_doubling_carries_compressed_sums_and_periodic_averages(monkeypatch, options,
                                                                        dtype):
    """float16 gradient sums (the marked gather in float16) and local SGD's averagings go
    through the pairs; with 2 replicas a pair sums a + b as the ring does: the same bits."""
    import keras

    swapped = []
    swap = Exchanges._swap
    monkeypatch.setattr(Exchanges, "_swap", staticmethod(
        lambda mine, *args: swapped.append(mine.dtype.name) or swap(mine, *args)))

    def weights(communication):
        strategy = tfpar.DataParallelStrategy(cpus(2), communication=communication, **options)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, "tanh"),
                                      keras.layers.Dense(3)])
            model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
        x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
        model.fit(x, np.arange(64) % 3, batch_size=16, epochs=2, verbose=0, shuffle=False)
        return model.get_weights()

    paired = weights("halving_doubling")
    assert dtype in swapped, swapped  # The pairs carried the sums (traced once per replica).
    swapped.clear()
    ring = weights("ring")
    assert not swapped
    for got, want in zip(paired, ring):
        np.testing.assert_array_equal(got, want)
    initial = tfpar.DataParallelStrategy(cpus(2))  # (Trained: not the initial weights.)
    with initial.scope():
        keras.utils.set_random_seed(0)
        start = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, "tanh"),
                                  keras.layers.Dense(3)]).get_weights()
    assert max(float(np.abs(a - b).max()) for a, b in zip(paired, start)) > 1e-3
