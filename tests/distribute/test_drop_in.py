"""tfpar strategies stand in for the stock ones: the stock classes' public API, walked.

Every public name of the stock strategy (and of its `extended`) is classified: a
property whose value must equal the stock one (or differs on purpose, with the
reason, as in the data-parallel guide's table), a method whose results are compared with the
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

# Differences on purpose, as (stock class, name) -> why. The data-parallel guide's table says the same.
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


# -- constructor arguments: the stock strategies' own, by name and by position --------------

def _stock_parameters(cls):
    import inspect

    return [name for name in inspect.signature(cls.__init__).parameters if name != "self"]


def test_every_stock_constructor_argument_is_accepted_by_data_parallel():
    import inspect

    ours = inspect.signature(tfpar.DataParallelStrategy.__init__).parameters
    for cls in (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy):
        missing = [name for name in _stock_parameters(cls) if name not in ours]
        assert not missing, (cls.__name__, missing)


def _trained_weights(strategy):
    import keras

    x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.5), "sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


@pytest.mark.parametrize("make_ops, named", [
    (tf.distribute.HierarchicalCopyAllReduce, "hierarchical"),
    (tf.distribute.ReductionToOneDevice, "reduce_to_one"),
    (lambda: tf.distribute.ReductionToOneDevice(reduce_to_device="/cpu:1"), "reduce_to_one"),
])
def test_cross_device_ops_as_mirrored_strategy_takes_them(make_ops, named):
    """MirroredStrategy(devices, cross_device_ops): by name and by position, and fit trains
    as under the stock strategy with the same ops."""
    ops = make_ops()
    by_name = tfpar.DataParallelStrategy(cpus(2), cross_device_ops=ops)
    by_position = tfpar.DataParallelStrategy(cpus(2), make_ops())
    for strategy in (by_name, by_position):
        assert strategy.communication == named
    stock = _trained_weights(tf.distribute.MirroredStrategy(cpus(2), cross_device_ops=ops))
    for got, want in zip(_trained_weights(by_name), stock):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_cross_device_ops_tfpar_has_no_name_for_are_used_as_given():
    class Counting(tf.distribute.ReductionToOneDevice):
        calls = 0

        def reduce_implementation(self, *args, **kwargs):
            Counting.calls += 1
            return super().reduce_implementation(*args, **kwargs)

    strategy = tfpar.DataParallelStrategy(cpus(2), cross_device_ops=Counting())
    assert strategy.communication == "Counting"
    got = _trained_weights(strategy)
    assert Counting.calls >= 1  # fit's gradients were summed by it.
    # (Compared with tfpar's own reduction: a stock MirroredStrategy with its default ops,
    # made after the other tests' strategies, failed with a collective key clash.)
    for got, want in zip(got, _trained_weights(tfpar.DataParallelStrategy(cpus(2)))):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="cannot use Counting as given. Pass communication="):
        tfpar.DataParallelStrategy(cpus(2), cross_device_ops=Counting(), shard="optimizer")


def test_communication_options_as_multi_worker_mirrored_strategy_takes_them():
    options = tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=1024, timeout_seconds=0,
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    from tfpar.distribute.data_parallel import stock_arguments

    reduction = stock_arguments.resolve("auto", None, None, communication_options=options)
    assert (reduction.communication, reduction.bytes_per_pack) == ("ring", 1024)
    assert reduction.timeout_seconds == float("inf")  # Stock: 0 disables the timeout.
    strategy = tfpar.DataParallelStrategy(cpus(2), communication_options=options)
    assert strategy.communication == "ring"
    # Positionally (MultiWorkerMirroredStrategy(cluster_resolver, communication_options)).
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({}), task_type="worker", task_id=0)
    strategy = tfpar.DataParallelStrategy(resolver, options)
    assert strategy.communication == "ring" and strategy.num_replicas_in_sync == len(
        tf.config.list_logical_devices("CPU"))
    # AUTO keeps tfpar's choice; the weights train as under the stock strategy.
    auto = tfpar.DataParallelStrategy(
        cpus(2), communication_options=tf.distribute.experimental.CommunicationOptions())
    assert auto.communication == "reduce_to_one"
    ring = tfpar.DataParallelStrategy(cpus(2), communication_options=options)
    default = _trained_weights(tfpar.DataParallelStrategy(cpus(2)))
    for got, want in zip(_trained_weights(ring), default):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kwargs, error, fragment", [
    (dict(cross_device_ops="nccl"), TypeError, "must be a tf.distribute.CrossDeviceOps"),
    (dict(communication_options={"bytes_per_pack": 4}), TypeError,
     "must be a tf.distribute.experimental.CommunicationOptions"),
    (dict(communication="ring", cross_device_ops=tf.distribute.ReductionToOneDevice()),
     ValueError, "communication='ring' and cross_device_ops both say how to reduce"),
    (dict(bytes_per_pack=64, communication_options=tf.distribute.experimental
          .CommunicationOptions(bytes_per_pack=128)), ValueError, "pass one of them"),
    (dict(communication="reduce_to_one", communication_options=tf.distribute.experimental
          .CommunicationOptions(implementation="ring")), ValueError,
     "communication_options.implementation both say"),
    (dict(cross_device_ops=tf.distribute.NcclAllReduce()), Exception,
     "communication='nccl'"),
])
def test_stock_arguments_that_cannot_hold_say_what_to_change(kwargs, error, fragment):
    with pytest.raises(error, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        tfpar.DataParallelStrategy(cpus(2), **kwargs)


def test_cross_device_ops_across_workers_is_refused_before_any_connection():
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}),
        task_type="worker", task_id=0)
    with pytest.raises(ValueError, match="cross_device_ops only works on one host"):
        tfpar.DataParallelStrategy(cluster_resolver=resolver,
                                   cross_device_ops=tf.distribute.ReductionToOneDevice())
