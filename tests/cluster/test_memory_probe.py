"""Memory measured in this process: TensorFlow's allocator and the resident set, and the
Keras callback that records them while training."""

import doctest

import numpy as np
import pytest
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


# -- on CPUs where TensorFlow keeps no allocator statistics by default (oneDNN off) ----------

# Run in a fresh process: the allocator is chosen once, when TensorFlow starts.
_PROBE = """
import json, numpy as np, keras, tfpar
{setup}
tfpar.reset_memory_peaks()
big = keras.ops.ones([16 << 20])  # 64 MiB, touched, then freed.
total = float(keras.ops.sum(big))
del big
after = tfpar.process_memory()
peaks = tfpar.MemoryPeaks()
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile("sgd", "mse")
model.fit(np.ones((4, 4)), np.ones((4, 2)), epochs=1, verbose=0, callbacks=[peaks])
print(json.dumps(dict(source=after.peak_source, allocator_peak=after.allocator_peak_bytes,
                      rss_peak=after.rss_peak_bytes, peak=after.peak_bytes, text=after.format(),
                      epochs=len(peaks.epochs), epoch_source=peaks.epochs[0].peak_source)))
"""


def _probe(setup="", **env):
    import json
    import os
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items()
               if k not in (memory_probe.USE_BFC, memory_probe.BFC_LIMIT_MIB)}
    environ.update(TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2", **env)
    done = subprocess.run([sys.executable, "-c", _PROBE.format(setup=setup)], env=environ,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.one_process
def test_with_onednn_off_the_probe_turns_allocator_statistics_on_itself():
    # With oneDNN off TensorFlow's default CPU allocator keeps no statistics ("Allocator stats
    # not available"): the probe, first to start TensorFlow here, selects the BFC allocator.
    found = _probe()
    assert found["source"] == "allocator", found
    assert found["allocator_peak"] >= 64 * MIB
    assert found["epochs"] == 1 and found["epoch_source"] == "allocator"


@pytest.mark.slow
@pytest.mark.one_process
def test_without_statistics_the_probe_reports_the_resident_peak_labelled_and_never_raises():
    # TensorFlow started (an op ran) before tfpar could choose, with oneDNN off and the
    # BFC allocator refused: no allocator statistics can be had in this process.
    found = _probe(setup="keras.ops.ones([1]).numpy()", TF_CPU_ALLOCATOR_USE_BFC="false")
    assert found["source"] == "resident" and found["allocator_peak"] is None, found
    assert found["peak"] == found["rss_peak"] >= 64 * MIB
    assert found["text"].startswith("allocator statistics unavailable, resident ")
    # The callback records its epoch too, from the resident set.
    assert found["epochs"] == 1 and found["epoch_source"] == "resident"


def test_a_device_that_does_not_exist_is_still_an_error():
    with pytest.raises(ValueError, match="No matching devices"):
        tfpar.process_memory("GPU:7")
    with pytest.raises(ValueError, match="No matching devices"):
        tfpar.reset_memory_peaks("CPU:99")


def test_the_statistics_environment_keeps_what_the_user_set():
    added = memory_probe.allocator_statistics_env({})
    assert added[memory_probe.USE_BFC] == "true"
    # The BFC allocator's limit is the host's memory (TensorFlow's own default: 64 GiB).
    import os

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // MIB
    assert added[memory_probe.BFC_LIMIT_MIB] == str(physical)
    assert memory_probe.allocator_statistics_env({memory_probe.USE_BFC: "0"}) == {}
    assert memory_probe.allocator_statistics_env({memory_probe.BFC_LIMIT_MIB: "512"}) == {
        memory_probe.USE_BFC: "true"}
