"""DataParallelStrategy: numerical equivalence with one device, checkpoints, errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar.distribute.common.cross_device import make_cross_device_ops
from tfpar.errors import BatchSizeError, CommunicationError, DeviceError
from tfpar.plan.communication import CPU_DEFAULT, select_communication

from conftest import cpus, small_model, toy_data

BATCH = 16
STEPS = 4


def _optimizer(name):
    return keras.optimizers.SGD(0.1) if name == "sgd" else keras.optimizers.Adam(0.01)


def _train(strategy, optimizer, x, y, initial):
    scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
    with scope:
        model = small_model()
        model.set_weights(initial)
        model.compile(optimizer=_optimizer(optimizer),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


@pytest.fixture(scope="session")
def reference():
    x, y = toy_data(n=BATCH * STEPS)
    initial = small_model().get_weights()
    single = {opt: _train(None, opt, x, y, initial) for opt in ("sgd", "adam")}
    return x, y, initial, single


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_replicas_equal_one_device(reference, optimizer):
    x, y, initial, single = reference
    # 2 then 4 then 2 replicas in one process: stock MirroredStrategy aborts on the
    # second size ("joining a group with size 4, but that group has size 2").
    for n in (2, 4, 2):
        weights = _train(tfpar.DataParallelStrategy(cpus(n)), optimizer, x, y, initial)
        moved = max(np.abs(w - w0).max() for w, w0 in zip(weights, initial))
        assert moved > 1e-3, "training did not change the weights"
        for got, want in zip(weights, single[optimizer]):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("communication", ["ring", "reduce_to_one", "hierarchical"])
def test_other_cpu_reductions_equal_one_device(reference, communication):
    x, y, initial, single = reference
    strategy = tfpar.DataParallelStrategy(cpus(2), communication=communication)
    for got, want in zip(_train(strategy, "sgd", x, y, initial), single["sgd"]):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_packed_ring_equals_one_device(reference):
    x, y, initial, single = reference
    strategy = tfpar.DataParallelStrategy(cpus(4), communication="ring", bytes_per_pack=256)
    for got, want in zip(_train(strategy, "adam", x, y, initial), single["adam"]):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_checkpoint_from_2_replicas_restores_under_4_and_none(tmp_path, toy):
    x, y = toy
    with tfpar.DataParallelStrategy(cpus(2)).scope():
        model = small_model()
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    expected = model.predict(x, verbose=0)
    model.save_weights(tmp_path / "w.weights.h5")
    model.save(tmp_path / "model.keras")

    with tfpar.DataParallelStrategy(cpus(4)).scope():
        four = small_model(seed=1)
        four.load_weights(tmp_path / "w.weights.h5")
        four_loaded = keras.models.load_model(tmp_path / "model.keras")
    plain = small_model(seed=2)
    plain.load_weights(tmp_path / "w.weights.h5")
    plain_loaded = keras.models.load_model(tmp_path / "model.keras")
    for restored in (four, four_loaded, plain, plain_loaded):
        np.testing.assert_allclose(restored.predict(x, verbose=0), expected, atol=1e-6)


def test_communication_choice_on_cpus():
    assert tfpar.DataParallelStrategy(cpus(2)).communication == CPU_DEFAULT
    with pytest.raises(ValueError, match="bytes_per_pack packs gradients for communication='ring'"):
        tfpar.DataParallelStrategy(cpus(2), communication="reduce_to_one", bytes_per_pack=1024)
    with pytest.raises(CommunicationError, match="NCCL"):
        tfpar.DataParallelStrategy(cpus(2), communication="nccl")
    with pytest.raises(CommunicationError, match="Unknown communication"):
        tfpar.DataParallelStrategy(cpus(2), communication="fastest")


def test_gpu_device_lists_get_nccl_ops():
    # No GPU here: build (not run) the ops TensorFlow would use for two GPUs.
    from tensorflow.python.distribute import cross_device_utils

    gpus = ("/job:localhost/replica:0/task:0/device:GPU:0",
            "/job:localhost/replica:0/task:0/device:GPU:1")
    choice = select_communication("auto", ["GPU", "GPU"])
    ops = make_cross_device_ops(choice, gpus, cross_device_utils.CollectiveKeys())
    assert isinstance(ops, tf.distribute.NcclAllReduce)


def test_bad_devices_are_rejected():
    with pytest.raises(DeviceError, match="does not exist"):
        tfpar.DataParallelStrategy(["/cpu:0", "/cpu:12"])
    with pytest.raises(DeviceError, match="twice"):
        tfpar.DataParallelStrategy(["/cpu:1", "/cpu:1"])


def test_global_batch_smaller_than_replicas(toy):
    x, y = toy
    with tfpar.DataParallelStrategy(cpus(4)).scope():
        model = small_model()
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(BatchSizeError, match=r"\(2\) is smaller than the number of replicas \(4\)"):
        model.fit(x, y, batch_size=2, verbose=0)
    unknown = tf.data.Dataset.from_tensor_slices((x, y)).batch(3).filter(lambda a, b: True)
    with pytest.raises(tf.errors.InvalidArgumentError, match="smaller than the number of replicas"):
        model.fit(unknown, verbose=0)


def test_malformed_tf_config_fails_fast(monkeypatch):
    from tfpar.cluster import TFConfigError

    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}}')
    with pytest.raises(TFConfigError, match="no 'task' field"):
        tfpar.DataParallelStrategy()
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]},'
                                    ' "task": {"type": "worker", "index": 0}}')
    with pytest.raises(ValueError, match="ParameterServerStrategy"):
        tfpar.DataParallelStrategy()


def test_single_worker_tf_config_stays_on_one_host(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["127.0.0.1:1"]},'
                                    ' "task": {"type": "worker", "index": 0}}')
    strategy = tfpar.DataParallelStrategy(cpus(2))
    assert type(strategy) is tfpar.DataParallelStrategy and strategy.num_replicas_in_sync == 2


class _FakeGPU:
    def __init__(self, index):
        self.name, self.device_type = f"/physical_device:GPU:{index}", "GPU"


def _fake_gpus(monkeypatch, physical, visible, logical_per_gpu):
    """A machine with `physical` GPUs, `visible` of them visible, each split in
    `logical_per_gpu[i]` logical GPUs (0: not split)."""
    gpus = [_FakeGPU(i) for i in range(physical)]
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda kind=None: gpus if kind == "GPU" else [])
    monkeypatch.setattr(tf.config, "get_visible_devices",
                        lambda kind=None: [gpus[i] for i in visible] if kind == "GPU" else [])
    monkeypatch.setattr(
        tf.config, "get_logical_device_configuration",
        lambda gpu: [object()] * logical_per_gpu[int(gpu.name.rsplit(":", 1)[1])] or None)


def _gpus(n):
    return [f"/job:localhost/replica:0/task:0/device:GPU:{i}" for i in range(n)]


def test_logical_gpus_of_one_physical_gpu_get_the_ring_not_nccl(monkeypatch):
    """NCCL rejects two replicas on one physical GPU; tfpar chose it anyway."""
    from tfpar import devices as devices_lib

    _fake_gpus(monkeypatch, physical=1, visible=[0], logical_per_gpu=[2])
    owners = devices_lib.physical_gpus_of(_gpus(2))
    assert owners == ["/physical_device:GPU:0"] * 2
    assert select_communication("auto", ["GPU", "GPU"], physical_gpus=owners) == "ring"
    with pytest.raises(CommunicationError, match="one replica per physical GPU"):
        select_communication("nccl", ["GPU", "GPU"], physical_gpus=owners)
    _fake_gpus(monkeypatch, physical=2, visible=[0, 1], logical_per_gpu=[0, 0])
    owners = devices_lib.physical_gpus_of(_gpus(2))
    assert select_communication("auto", ["GPU", "GPU"], physical_gpus=owners) == "nccl"
    _fake_gpus(monkeypatch, physical=2, visible=[0, 1], logical_per_gpu=[2, 0])
    assert devices_lib.logical_gpu_owners() == [
        "/physical_device:GPU:0", "/physical_device:GPU:0", "/physical_device:GPU:1"]


def test_hidden_gpus_are_not_counted_across_workers(monkeypatch):
    """Multi-worker replicas were counted from the physical GPUs, hidden ones too
    (`set_visible_devices([], "GPU")`), so NCCL was chosen for a worker with no GPU."""
    from tfpar import devices as devices_lib

    _fake_gpus(monkeypatch, physical=2, visible=[], logical_per_gpu=[0, 0])
    owners = devices_lib.logical_gpu_owners()
    assert owners == []
    assert select_communication("auto", ["GPU"] * len(owners) or ["CPU"],
                                multi_worker=True, physical_gpus=owners) == "ring"
    _fake_gpus(monkeypatch, physical=2, visible=[1], logical_per_gpu=[0, 0])
    assert devices_lib.logical_gpu_owners() == ["/physical_device:GPU:1"]


def test_a_shorter_worker_dataset_is_padded_with_empty_batches():
    from tfpar.distribute.data_parallel.multi_worker import joined

    def dataset_fn(context):
        return tf.data.Dataset.from_tensor_slices(
            (np.ones((6, 3), "float32"), np.arange(6))).batch(3)

    seen = []

    def longest_of_all(length):
        seen.append(length)
        return 4

    padded = joined(dataset_fn, longest_of_all)(tf.distribute.InputContext())
    assert seen == [2] and int(padded.cardinality()) == 4
    assert [len(y) for _, y in padded] == [3, 3, 0, 0]
    unknown = joined(dataset_fn, lambda length: tf.data.UNKNOWN_CARDINALITY)(None)
    assert int(unknown.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    assert [len(y) for _, y in unknown] == [3, 3]
