"""What the Keras seam (tfpar/keras/replicas.py) changes under replicas, beyond the numbers
the conformance suite compares with one device (tests/conformance: uneven splits, masked
and sample-weighted mean losses, call losses, gradient accumulation, each on 2 and 4
replicas): BatchNorm copies, multi-worker input left for FILE sharding, XLA refused, Keras'
sum over replicas in `strategy.run` + `apply_gradients`."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar.distribute.data_parallel.input_checks import check_first_batch

from conftest import cpus

EXAMPLES = 40


def _data(kind="dense"):
    rng = np.random.default_rng(1)
    return rng.normal(size=(EXAMPLES, 4)).astype("float32"), rng.integers(0, 3, EXAMPLES)


def _model(kind="batchnorm_local"):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(5),
                             keras.layers.BatchNormalization(), keras.layers.Dense(3)])


def test_batchnorm_statistics_are_the_same_on_every_replica_and_saved(tmp_path):
    """Keras' moving statistics are per replica (aggregation NONE); under tfpar every
    replica holds the mean of the replicas' updates, so what predict uses is what is saved."""
    strategy = tfpar.DataParallelStrategy(cpus(2))
    x, y = _data("dense")
    with strategy.scope():
        model = _model("batchnorm_local")
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    batchnorm = model.layers[1]
    for variable in (batchnorm.moving_mean, batchnorm.moving_variance):
        copies = [v.numpy() for v in strategy.experimental_local_results(variable.value)]
        assert np.abs(copies[0] - np.zeros_like(copies[0])).max() > 1e-4 or (
            variable is batchnorm.moving_variance)
        np.testing.assert_array_equal(copies[0], copies[1])
    # Rows 8..15 of a batch go to replica 1: the same statistics as replica 0's.
    predicted = model.predict(x, batch_size=16, verbose=0)
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    np.testing.assert_allclose(loaded.predict(x, batch_size=16, verbose=0), predicted,
                               atol=1e-6)


def test_multi_worker_input_is_left_for_file_sharding():
    """Across workers the first-batch check must not rewrite the pipeline: enumerate()
    or scan() there make tf.data fall back from FILE to DATA sharding."""
    dataset = tf.data.Dataset.range(10).batch(3)
    assert check_first_batch(dataset, 4, in_pipeline=False) is dataset
    assert check_first_batch(dataset, 4) is not dataset  # One host: checked in the pipeline.


@pytest.mark.parametrize("make", [
    lambda: tfpar.PipelineStrategy(cpus(2), num_micro_batches=2),
], ids=["pipeline"])
def test_jit_compile_is_refused_before_the_first_step(make):
    """XLA compiles Keras' whole step for one device: the run failed deep inside TF
    ("resource located in device CPU:1") or, in a pipeline, XLA was silently dropped.
    (Data parallelism compiles each replica's model call, model parallelism each placed
    layer's: tests/keras/test_xla_calls.py.)"""
    strategy = make()
    x, y = _data("dense")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5), keras.layers.Dense(3)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=True)
    initial = model.get_weights()
    with pytest.raises(ValueError, match="jit_compile=True.*on 2 devices.*jit_compile=False"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    for got, want in zip(model.get_weights(), initial):
        np.testing.assert_array_equal(got, want)
    assert model.jit_compile  # Not switched off behind the user's back.


@pytest.mark.parametrize("shard", [None, "optimizer", "gradients", "parameters"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_apply_gradients_in_run_sums_as_keras_defines_it(shard, graph):
    """Keras 3.15.1's tensorflow/optimizer_distribute_test.py under tfpar: a gradient made in
    each replica is summed (test_single_step); one tensor made outside `run`, which every
    replica passes, is counted once in a plain step (test_ema: one device's step), and
    summed by accumulation, whose accumulators hold each replica's own gradients
    (test_gradient_accumulation). Under ZeRO each owner sums what it receives: a shared
    tensor too, and its accumulators hold the sums."""
    strategy = tfpar.DataParallelStrategy(cpus(2), shard=shard)
    start = [[1.0, 2.0], [3.0, 4.0]]
    shared = tf.constant([[1.0, 1.0], [2.0, 2.0]])
    for accumulation, made_in_run in ((3, False), (None, False), (None, True)):
        with strategy.scope():
            v = keras.Variable(start)
            optimizer = keras.optimizers.SGD(1.0, gradient_accumulation_steps=accumulation)

        def replica_step():
            grads = tf.constant([[1.0, 1.0], [2.0, 2.0]]) if made_in_run else shared
            optimizer.apply_gradients([(grads, v)])

        step = lambda: strategy.run(replica_step)  # noqa: E731
        step = tf.function(step) if graph else step
        for i in range(accumulation or 1):
            np.testing.assert_array_equal(v.numpy(), start)
            step()
            if accumulation and i < accumulation - 1 and shard is None:
                np.testing.assert_array_equal(
                    optimizer._accumulated_gradients[0].numpy(),
                    (i + 1) * shared.numpy())  # Replica 0's own, as Keras keeps them.
        summed = [[-1.0, 0.0], [-1.0, 0.0]]  # The sum over 2 replicas of (the mean) g.
        once = [[0.0, 1.0], [1.0, 2.0]]
        counted_once = not accumulation and not made_in_run and shard is None
        np.testing.assert_array_equal(v.numpy(), once if counted_once else summed)
        assert int(optimizer.iterations.numpy()) == 1
