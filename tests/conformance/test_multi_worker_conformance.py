"""Multi-worker DataParallelStrategy conformance: 2 worker processes on 127.0.0.1.

One pair of processes runs expected.MULTI_WORKER_FEATURES one after another (each a harness
feature, the same model, data and seed as in-process), then trains one epoch on 4 TFRecord files
(FILE auto-shard), in file order and shuffled with a seed. The test compares each feature with the
one-device reference (or the emulation of a documented cell) and checks that the workers
together trained on every example exactly once per epoch.
"""

import collections
import json
import os
import pickle
import sys

import numpy as np
import pytest
import tensorflow as tf

import expected
import harness
import semantics

pytestmark = pytest.mark.slow

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, TESTS)
from cluster_helper import Cluster  # noqa: E402

WORKER = os.path.join(TESTS, "workers", "conformance_worker.py")
FILES, PER_FILE = 4, 12
TASKS = ["worker:0", "worker:1"]


def write_files(directory):
    rng = np.random.default_rng(8)
    for f in range(FILES):
        with tf.io.TFRecordWriter(os.path.join(directory, f"part-{f}.tfrecord")) as writer:
            for i in range(PER_FILE):
                example = tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(
                        value=rng.normal(size=4).tolist())),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 3])),
                    "id": tf.train.Feature(int64_list=tf.train.Int64List(
                        value=[f * PER_FILE + i]))}))
                writer.write(example.SerializeToString())


@pytest.fixture(scope="session")
def workers(tmp_path_factory):
    """Runs the worker pair once for the module; yields the output directory."""
    out = tmp_path_factory.mktemp("mw_out")
    files = tmp_path_factory.mktemp("mw_files")
    write_files(str(files))
    cluster = Cluster(2)
    try:
        cluster.start([WORKER, f"--out={out}", f"--files={files}",
                       "--features=" + ",".join(expected.MULTI_WORKER_FEATURES)])
        codes = cluster.wait(TASKS, timeout=420)
        assert codes == [0, 0], cluster.output()[-6000:]
        yield out
    finally:
        cluster.kill_all()


def _result(out, task, feature):
    with open(os.path.join(out, f"{task.replace(':', '-')}-{feature}.pkl"), "rb") as f:
        return pickle.load(f)


def _cells():
    for feature in expected.MULTI_WORKER_FEATURES:
        marks = []
        if (feature, expected.MULTI_WORKER) in expected.KNOWN_GAPS:
            marks.append(pytest.mark.xfail(
                strict=True, reason=expected.KNOWN_GAPS[feature, expected.MULTI_WORKER]))
        yield pytest.param(feature, marks=marks, id=feature)


@pytest.mark.parametrize("feature", list(_cells()))
def test_multi_worker_feature(workers, feature):
    spec = harness.FEATURES[feature]
    results = [_result(workers, task, feature) for task in TASKS]
    for result in results:
        assert not isinstance(result, dict), result.get("error", "") + result.get("traceback", "")
    # Both workers hold the same model.
    for w0, w1 in zip(results[0].weights, results[1].weights):
        np.testing.assert_allclose(w0, w1, atol=spec.atol, rtol=spec.rtol)
    target = expected.EXPECTED[feature, expected.MULTI_WORKER]
    if target == expected.EQUAL:
        want, parts = harness.reference(feature), harness.PARTS
    else:
        want, parts = semantics.emulated(feature, expected.MULTI_WORKER)
    for task, result in zip(TASKS, results):
        bad = harness.failures(result, want, spec.atol, spec.rtol, parts)
        assert not bad, f"{task} differs: {bad}"


@pytest.mark.parametrize("variant", ["in_order", "shuffled"])
def test_file_auto_shard_sees_every_example_once_per_epoch(workers, variant):
    seen = []
    for task in TASKS:
        with open(os.path.join(workers, f"{task.replace(':', '-')}-files.json")) as f:
            mine = json.load(f)[variant]
        assert mine, f"{task} trained on no example"
        seen += mine
    counts = collections.Counter(seen)
    assert sorted(counts) == list(range(FILES * PER_FILE)), sorted(counts)
    assert set(counts.values()) == {1}, {i: c for i, c in counts.items() if c != 1}
