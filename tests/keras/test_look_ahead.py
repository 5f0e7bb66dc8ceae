"""Keras' look-ahead iterator over arrays is made when an epoch first reads it, under
tfpar's strategies only (tfpar.keras.look_ahead): the distributed iterators made are
counted at the strategy's distributed dataset, for tfpar's strategy and for stock
MirroredStrategy on the same calls, and the trained weights are the same."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar

X = np.random.default_rng(0).normal(size=(48, 4)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")


def _stock():
    # (Reduced on one device, as tfpar's default on CPUs: a stock strategy's collectives
    # would take instance keys that earlier tests' strategies in this process took.)
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                          cross_device_ops=tf.distribute.ReductionToOneDevice())


def _counting(strategy, made):
    """`strategy` whose distributed datasets count the iterators made of them in `made`."""
    distribute = strategy.experimental_distribute_dataset

    class Counted:
        def __init__(self, dataset):
            self._dataset = dataset

        def __iter__(self):
            made.append(1)
            return iter(self._dataset)

    strategy.experimental_distribute_dataset = lambda *a, **k: Counted(distribute(*a, **k))
    return strategy


def _iterators_made(strategy, data, **fit):
    """How many distributed iterators fit (2 epochs), evaluate and predict each made, and
    the weights after fit."""
    made, counts = [], []
    strategy = _counting(strategy, made)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, "relu"),
                                  keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for call in (lambda: model.fit(*data, batch_size=16, epochs=2, verbose=0, shuffle=False,
                                   **fit),
                 lambda: model.evaluate(*data, batch_size=16, verbose=0),
                 lambda: model.predict(data[0], batch_size=16, verbose=0)):
        before = len(made)
        call()
        counts.append(len(made) - before)
    return counts, model.get_weights()


@pytest.mark.parametrize("fit", [{}, {"steps_per_epoch": 3}], ids=["whole_epochs", "steps"])
def test_over_arrays_no_iterator_is_made_that_no_epoch_reads(fit):
    stock, stock_weights = _iterators_made(_stock(), (X, Y), **fit)
    ours, weights = _iterators_made(tfpar.DataParallelStrategy(["/cpu:0", "/cpu:1"]), (X, Y),
                                    **fit)
    # Stock Keras makes one after each epoch for the next: with steps_per_epoch=None the
    # next epoch makes its own instead, and the last one's is left unread either way; and
    # in fit and evaluate one for its symbolic build to read a batch (tfpar reads the
    # dataset's shapes). Here each epoch reads one, made when it does.
    assert stock == ([5, 3, 2] if not fit else [4, 3, 2]), stock
    assert ours == [2, 1, 1], ours
    for got, want in zip(weights, stock_weights):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_dataset_of_the_users_keeps_keras_timing():
    """Making an iterator of a shuffled dataset takes a seed from it: a user's dataset gets
    its iterators when Keras makes them."""
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
    stock, _ = _iterators_made(_stock(), (dataset,))
    ours, _ = _iterators_made(tfpar.DataParallelStrategy(["/cpu:0", "/cpu:1"]), (dataset,))
    # (Less the iterators of stock's symbolic builds, in fit and evaluate.)
    assert ours == [4, 2, 2] and stock == [5, 3, 2], (ours, stock)
