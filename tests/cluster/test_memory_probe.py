"""Memory measured in this process: TensorFlow's allocator and the resident set, and the
Keras callback that records them while training."""

import doctest

import numpy as np
import tensorflow as tf

import tfpar
from tfpar.cluster import memory_probe

from conftest import cpus

MIB = 1 << 20


def test_docstrings():
    assert doctest.testmod(memory_probe).failed == 0


def test_peaks_see_a_buffer_that_is_gone_and_start_again_after_a_reset():
    tfpar.reset_memory_peaks()
    before = tfpar.process_memory()
    # 64 MiB held by TensorFlow's allocator and touched, then freed.
    big = tf.random.uniform([16 * MIB])
    total = float(tf.reduce_sum(big))
    del big
    after = tfpar.process_memory()
    assert total > 0
    assert after.allocator_peak_bytes - before.allocator_bytes >= 64 * MIB
    assert after.allocator_bytes - before.allocator_bytes < 8 * MIB  # Freed.
    assert after.rss_peak_bytes >= after.rss_bytes > 0
    tfpar.reset_memory_peaks()
    again = tfpar.process_memory()
    assert again.allocator_peak_bytes < after.allocator_peak_bytes - 56 * MIB
    # The resident peak starts again from the resident set now (Linux's clear_refs).
    assert again.rss_peak_bytes <= again.rss_bytes + 8 * MIB


def test_the_callback_records_each_epochs_peak_and_the_strategys_plan():
    import keras

    strategy = tfpar.DataParallelStrategy(cpus(2))
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(4096),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(1e-3), "mse")
    x = np.ones((1024, 64), "float32")
    peaks = tfpar.MemoryPeaks()
    # The second epoch's batch is 128x the first's: its activations (512 x 4096 floats per
    # replica, 8 MiB, the layer's output and its gradient) raise that epoch's allocator peak.
    model.fit(x[:8], np.ones((8, 1)), batch_size=8, epochs=1, verbose=0, callbacks=[peaks])
    model.fit(x, np.ones((1024, 1)), batch_size=1024, epochs=1, verbose=0, callbacks=[peaks])
    first, second = peaks.epochs
    assert second.allocator_peak_bytes - first.allocator_peak_bytes >= 8 * MIB
    # Adam, 2 replicas, 4 bytes a value: weights, gradients and 2 slots on each device.
    params = 64 * 4096 + 4096 + 4096 + 1
    # Plus the update's temporaries: Adam's 3 copies of the largest variable (64 x 4096).
    assert peaks.planned == 16 * params + 4 * 3 * 64 * 4096
    # What training keeps (weights and Adam's slots) is held in the allocator after it.
    assert second.allocator_bytes >= 12 * params


def test_without_a_tfpar_strategy_there_is_no_plan():
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    peaks = tfpar.MemoryPeaks()
    model.fit(np.ones((4, 4)), np.ones((4, 2)), epochs=1, verbose=0, callbacks=[peaks])
    assert peaks.planned is None and len(peaks.epochs) == 1
