import subprocess
import sys

import pytest

import tfpar
from tfpar.devices import resolve_devices
from tfpar.errors import DeviceError, InitializationError

from conftest import NUM_CPUS


def test_virtual_cpus_same_count_is_a_noop():
    assert len(tfpar.virtual_cpus(NUM_CPUS)) == NUM_CPUS


def test_virtual_cpus_after_start_says_why():
    with pytest.raises(InitializationError, match=r"before TensorFlow initializes.*4 logical"):
        tfpar.virtual_cpus(NUM_CPUS + 1)


def test_virtual_cpus_one_core_each_in_fresh_process():
    code = ("import tfpar, tensorflow as tf; print(len(tfpar.virtual_cpus(3, one_core_each=True)),"
            "tf.config.threading.get_intra_op_parallelism_threads(),"
            "tf.config.threading.get_inter_op_parallelism_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["3", "1", "3"]


def test_virtual_cpus_rejects_bad_n():
    with pytest.raises(ValueError, match="n >= 1"):
        tfpar.virtual_cpus(0)


def test_resolve_devices_canonical():
    assert resolve_devices(["/cpu:1", "CPU:0"]) == (
        "/job:localhost/replica:0/task:0/device:CPU:1",
        "/job:localhost/replica:0/task:0/device:CPU:0")
    assert len(resolve_devices(None)) == NUM_CPUS


@pytest.mark.parametrize("devices,message", [
    (["/cpu:0", "/cpu:9"], r"'/cpu:9' does not exist.*virtual_cpus"),
    (["/gpu:0"], r"'/gpu:0' does not exist"),
    (["/cpu:0", "/device:CPU:0"], r"listed twice"),
    ([], r"empty"),
    (["nonsense"], r"Malformed device|names no device type"),
])
def test_bad_device_lists(devices, message):
    with pytest.raises(DeviceError, match=message):
        resolve_devices(devices)


@pytest.mark.parametrize("device, host", [
    ("/job:worker/replica:0/task:1/device:GPU:3", "/job:worker/replica:0/task:1/device:CPU:0"),
    ("/gpu:0", "/job:localhost/replica:0/task:0/device:CPU:0"),
    ("/cpu:2", "/job:localhost/replica:0/task:0/device:CPU:0"),
])
def test_the_host_of_a_device_is_its_tasks_cpu(device, host):
    """Where PipelineStrategy(offload_activations=True) keeps a stage's inputs."""
    from tfpar.devices import host_of
    assert host_of(device) == host
    strategy = tfpar.PipelineStrategy(["/cpu:0", "/cpu:1"], remat=True, offload_activations=True)
    assert strategy._offload_devices([device]) == [host]
