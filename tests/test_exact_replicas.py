"""DataParallelStrategy equals one device where Keras' per-replica habits would not:
uneven splits, masked and sample-weighted mean losses, BatchNorm statistics, gradient
accumulation (the Keras seam, tfpar/keras/replicas.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar.distribute.input_checks import check_first_batch

from conftest import call_loss_model, cpus

EXAMPLES = 40


def _data(kind):
    rng = np.random.default_rng(1)
    if kind == "tokens":
        x = rng.integers(1, 6, (EXAMPLES, 7))
        x[np.arange(EXAMPLES) % 3 != 0, 3:] = 0  # Two thirds of the rows are short.
        return x, rng.integers(0, 3, (EXAMPLES, 7))
    return rng.normal(size=(EXAMPLES, 4)).astype("float32"), rng.integers(0, 3, EXAMPLES)


def _model(kind):
    keras.utils.set_random_seed(0)
    if kind == "tokens":
        return keras.Sequential([keras.Input((7,)), keras.layers.Embedding(6, 4, mask_zero=True),
                                 keras.layers.SimpleRNN(5, return_sequences=True),
                                 keras.layers.Dense(3)])
    if kind == "batchnorm":
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(5),
                                 keras.layers.BatchNormalization(synchronized=True),
                                 keras.layers.Dense(3)])
    if kind == "batchnorm_local":
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(5),
                                 keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])


CASES = {
    # name: (data kind, model kind, loss reduction, batch size, sample weights, optimizer)
    "masked_sequence_loss": ("tokens", "tokens", "sum_over_batch_size", 16, False, None),
    "mean_with_sample_weight": ("dense", "dense", "mean_with_sample_weight", 16, True, None),
    "sample_weight": ("dense", "dense", "sum_over_batch_size", 16, True, None),
    "batch_not_divisible": ("dense", "dense", "sum_over_batch_size", 18, False, None),
    "synchronized_batchnorm": ("dense", "batchnorm", "sum_over_batch_size", 16, False, None),
    "gradient_accumulation": ("dense", "dense", "sum_over_batch_size", 8, False, 2),
}


def _run(strategy, case):
    data_kind, model_kind, reduction, batch, weighted, accumulation = CASES[case]
    x, y = _data(data_kind)
    weights = np.random.default_rng(3).uniform(0.1, 2, EXAMPLES).astype("float32")
    with strategy.scope() if strategy else tf.distribute.get_strategy().scope():
        model = _model(model_kind)
        model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=accumulation),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                 reduction=reduction))
    history = model.fit(x, y, sample_weight=weights if weighted else None, batch_size=batch,
                        epochs=2, shuffle=False, verbose=0)
    return (model.get_weights(), history.history["loss"],
            model.evaluate(x, y, batch_size=batch, verbose=0))


_references = {}


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_replicas_equal_one_device(case, replicas):
    if case not in _references:
        _references[case] = _run(None, case)
    weights, losses, evaluated = _references[case]
    got_weights, got_losses, got_evaluated = _run(tfpar.DataParallelStrategy(cpus(replicas)), case)
    assert max(np.abs(w - w0).max() for w, w0 in zip(weights, _model(CASES[case][1]).get_weights())) > 1e-3
    for got, want in zip(got_weights, weights):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got_losses, losses, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got_evaluated, evaluated, atol=1e-5, rtol=1e-5)


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
    lambda: tfpar.DataParallelStrategy(cpus(2)),
    lambda: tfpar.ModelParallelStrategy(cpus(2)),
    lambda: tfpar.PipelineStrategy(cpus(2), num_micro_batches=2),
], ids=["data", "model", "pipeline"])
def test_jit_compile_is_refused_before_the_first_step(make):
    """XLA compiles Keras' whole step for one device: the run failed deep inside TF
    ("resource located in device CPU:1") or, in a pipeline, XLA was silently dropped."""
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


@pytest.mark.parametrize("replicas", [2, 4])
def test_each_replica_trains_on_its_own_call_losses(replicas):
    """A layer's call losses are one list shared by the replicas: after a sync point
    (the global loss normalization) a replica read another replica's losses."""
    x, y = _data("dense")

    def run(strategy):
        with strategy.scope() if strategy else tf.distribute.get_strategy().scope():
            model = call_loss_model()
            model.compile(keras.optimizers.SGD(0.1),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(x[:32], y[:32], batch_size=16, epochs=2, shuffle=False, verbose=0)
        return model.get_weights(), history.history["loss"], model.evaluate(
            x[:32], y[:32], batch_size=16, verbose=0)

    want, got = run(None), run(tfpar.DataParallelStrategy(cpus(replicas)))
    for g, w in zip(got[0], want[0]):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5)
