"""tfpar strategies stand in for the stock ones: the stock classes' public API, walked.

Every public name of the stock strategy (and of its `extended`) is classified: a
property whose value must equal the stock one (or differs on purpose, with the
reason, as in the README's table), a method whose results are compared with the
stock strategy's on the same probe, or a TF1-only method (graph sessions) that
must behave as the stock one does. A name that TensorFlow adds later fails the
walk until it is classified.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import tfpar

from conftest import cpus
from workers.api_walk import classify, get, outcome

# Public strategy and extended methods of TF1 graph-session programs: in TF2 they
# raise, or run as in the stock class; compared by outcome (result or error type).
TF1_ONLY = {"configure", "experimental_run", "group", "make_dataset_iterator",
            "make_input_fn_iterator", "unwrap", "update_config_proto",
            "experimental_make_numpy_dataset", "experimental_run_steps_on_iterator",
            "broadcast_to", "update_non_slot", "non_slot_devices"}

# Differences on purpose, as (stock class, name) -> why. The README's table says the same.
INTENDED = {
    ("MirroredStrategy", "cluster_resolver"):
        "a resolver of the one-task cluster, as MultiWorkerMirroredStrategy has, so that "
        "multi-worker programs run unchanged on one host",
    ("CollectiveAllReduceStrategy", "experimental_between_graph"):
        "one host is one in-graph program, as MirroredStrategy",
}


def _pairs():
    """(stock, tfpar) strategies of equal replica count, made fresh."""
    os.environ.pop("TF_CONFIG", None)
    return {
        "DataParallel/Mirrored": (tf.distribute.MirroredStrategy(cpus(2)),
                                  tfpar.DataParallelStrategy(cpus(2))),
        "DataParallel/MultiWorkerMirrored": (tf.distribute.MultiWorkerMirroredStrategy(),
                                             tfpar.DataParallelStrategy(cpus(1))),
        "ModelParallel/OneDevice": (tf.distribute.OneDeviceStrategy("/cpu:0"),
                                    tfpar.ModelParallelStrategy(cpus(2))),
        "Pipeline/Mirrored": (tf.distribute.MirroredStrategy(cpus(1)),
                              tfpar.PipelineStrategy(cpus(2))),
    }


@pytest.fixture(scope="session")
def pairs():
    return _pairs()


PAIRS = ["DataParallel/Mirrored", "DataParallel/MultiWorkerMirrored",
         "ModelParallel/OneDevice", "Pipeline/Mirrored"]


# -- probes: the same program on both strategies, results compared ------------------

def _values(strategy):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant([float(ctx.replica_id_in_sync_group + 1),
                                 float(ctx.num_replicas_in_sync)]))


def _local(strategy, value):
    return [np.asarray(v).tolist() for v in strategy.experimental_local_results(value)]


def _dataset():
    return tf.data.Dataset.range(8).map(lambda i: tf.cast(i, tf.float32)).batch(4)


def _first(strategy, distributed):
    return _local(strategy, strategy.run(lambda x: x * 2.0, args=(next(iter(distributed)),)))


def _variable(strategy, **kwargs):
    with strategy.scope():
        return tf.Variable(3.0, **kwargs)


def _run_in_function(strategy):
    @tf.function
    def step():
        return strategy.run(
            lambda: tf.distribute.get_replica_context().all_reduce("sum", 1.0))
    return strategy.reduce("sum", step(), axis=None).numpy().item()


PROBES = {
    "experimental_distribute_values_from_function": lambda s: _local(s, _values(s)),
    "experimental_local_results": lambda s: _local(s, _values(s)),
    "gather": lambda s: s.gather(_values(s), axis=0).numpy().tolist(),
    "reduce": lambda s: [s.reduce(op, _values(s), axis=None).numpy().tolist()
                         for op in ("sum", "mean")],
    "run": _run_in_function,
    "experimental_distribute_dataset": lambda s: _first(s, s.experimental_distribute_dataset(
        _dataset())),
    "distribute_datasets_from_function": lambda s: _first(
        s, s.distribute_datasets_from_function(lambda ctx: _dataset().unbatch().batch(
            ctx.get_per_replica_batch_size(4)))),
    "experimental_distribute_datasets_from_function": lambda s: _first(
        s, s.experimental_distribute_datasets_from_function(lambda ctx: _dataset())),
    "scope": lambda s: (lambda v: (v.numpy().item(), type(v).__name__, str(v.aggregation),
                                   str(v.synchronization)))(_variable(s)),
    "colocate_vars_with": lambda s: _colocated(s),
    "extended.colocate_vars_with": lambda s: _colocated(s),
    "extended.reduce_to": lambda s: _local(s, s.extended.reduce_to(
        "sum", _values(s), destinations=_variable(s))),
    "extended.batch_reduce_to": lambda s: [_local(s, r) for r in s.extended.batch_reduce_to(
        "mean", [(_values(s), _variable(s))] * 2)],
    "extended.update": lambda s: (lambda v: (
        s.extended.update(v, lambda var, d: var.assign_add(d), args=(2.0,)),
        _local(s, v))[1])(_variable(s)),
    "extended.read_var": lambda s: s.extended.read_var(_variable(s)).numpy().item(),
    "extended.value_container": lambda s: (lambda v: s.extended.value_container(v) is v)(
        _variable(s)),
    "extended.variable_created_in_scope": lambda s: [
        s.extended.variable_created_in_scope(_variable(s)),
        s.extended.variable_created_in_scope(tf.Variable(1.0))],
    "extended.call_for_each_replica": lambda s: _in_cross_replica_step(s),
}


def _colocated(strategy):
    with strategy.scope():
        anchor = tf.Variable(1.0)
        with strategy.extended.colocate_vars_with(anchor):
            other = tf.Variable(2.0)
    return [v.device for v in strategy.experimental_local_results(other)] == [
        v.device for v in strategy.experimental_local_results(anchor)]


def _in_cross_replica_step(strategy):
    @tf.function
    def step():
        return strategy.extended.call_for_each_replica(
            lambda: tf.distribute.get_replica_context().replica_id_in_sync_group + 1)
    return strategy.reduce("sum", step(), axis=None).numpy().item()


@pytest.mark.parametrize("pair", PAIRS)
def test_every_stock_name_is_classified_and_present(pairs, pair):
    stock, ours = pairs[pair]
    properties, methods = classify(stock)
    unclassified = {m for m in methods
                    if m not in PROBES and m.split(".")[-1] not in TF1_ONLY}
    assert not unclassified, f"stock {pair} methods with no probe: {sorted(unclassified)}"
    missing = [name for name in properties | methods if not _has(ours, name)]
    assert not missing, f"{type(ours).__name__} lacks stock {sorted(missing)}"


def _has(strategy, dotted):
    try:
        get(strategy, dotted)
    except AttributeError:
        return False
    return True


@pytest.mark.parametrize("pair", PAIRS)
def test_properties_equal_the_stock_ones(pairs, pair):
    stock, ours = pairs[pair]
    properties, _ = classify(stock)
    different = _differences(stock, ours, properties, lambda name: lambda s: get(s, name))
    different = {name: d for name, d in different.items()
                 if (type(stock).__name__, name.split(".")[-1]) not in INTENDED}
    assert not different, f"{pair}: stock vs tfpar {different}"


@pytest.mark.parametrize("pair", PAIRS)
def test_methods_give_the_stock_results(pairs, pair):
    stock, ours = pairs[pair]
    _, methods = classify(stock)

    def probe(name):
        if name.split(".")[-1] in TF1_ONLY:
            return lambda s: get(s, name)()
        return PROBES[name]
    different = _differences(stock, ours, methods, probe)
    assert not different, f"{pair}: stock vs tfpar {different}"


def _differences(stock, ours, names, probe):
    """{name: (stock outcome, tfpar outcome)} where `probe(name)(strategy)` differs."""
    different = {}
    for name in sorted(names):
        expected, got = outcome(lambda: probe(name)(stock)), outcome(lambda: probe(name)(ours))
        if expected != got:
            different[name] = (expected, got)
    return different


def test_without_tf_config_data_parallel_has_the_one_task_resolver():
    """The multi-worker tutorial's `strategy.cluster_resolver.task_type` on one host."""
    os.environ.pop("TF_CONFIG", None)
    strategy = tfpar.DataParallelStrategy(cpus(2))
    resolver = strategy.cluster_resolver
    assert (resolver.task_type, resolver.task_id, resolver.cluster_spec().as_dict()) == (
        None, None, {})
    assert strategy.extended.should_checkpoint and strategy.extended.should_save_summary
