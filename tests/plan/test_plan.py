"""Pure planning logic: no TensorFlow needed."""

import subprocess
import sys

import pytest

from tfpar.errors import BatchSizeError, CommunicationError
from tfpar.plan.batching import check_global_batch, per_replica_batch_size
from tfpar.plan.communication import CPU_DEFAULT, select_communication


@pytest.mark.parametrize("global_batch,replicas,expected", [(64, 4, 16), (2, 2, 1), (7, 1, 7)])
def test_per_replica_batch_size(global_batch, replicas, expected):
    assert per_replica_batch_size(global_batch, replicas) == expected


def test_global_batch_smaller_than_replicas():
    with pytest.raises(BatchSizeError, match=r"global batch size \(3\) is smaller than .* \(4\)"):
        check_global_batch(3, 4)


def test_uneven_batch_names_nearest_multiples():
    with pytest.raises(BatchSizeError, match="such as 8 or 12"):
        per_replica_batch_size(10, 4)


def test_batch_must_be_int():
    with pytest.raises(BatchSizeError, match="integer"):
        check_global_batch(8.0, 2)


@pytest.mark.parametrize("requested,types,expected", [
    ("auto", ["GPU", "GPU"], "nccl"),
    ("auto", ["GPU"], "nccl"),
    ("auto", ["CPU", "CPU"], CPU_DEFAULT),
    ("auto", ["GPU", "CPU"], CPU_DEFAULT),
    ("nccl", ["gpu", "gpu"], "nccl"),
    ("ring", ["GPU", "GPU"], "ring"),
    ("reduce_to_one", ["CPU"], "reduce_to_one"),
    ("hierarchical", ["CPU", "CPU"], "hierarchical"),
])
def test_select_communication(requested, types, expected):
    assert select_communication(requested, types) == expected


def test_nccl_on_cpus_is_refused():
    with pytest.raises(CommunicationError, match="NCCL.*GPU.*CPU"):
        select_communication("nccl", ["CPU", "CPU"])


def test_unknown_communication():
    with pytest.raises(CommunicationError, match="Unknown communication 'mpi'.*'ring'"):
        select_communication("mpi", ["CPU"])


def test_import_does_not_load_tensorflow():
    code = ("import sys, tfpar, tfpar.plan.batching, tfpar.plan.communication, tfpar.errors;"
            "assert 'tensorflow' not in sys.modules, 'tensorflow imported';"
            "assert 'DataParallelStrategy' in tfpar.__all__")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("requested,types,expected", [
    ("auto", ["CPU"], "ring"), ("auto", ["GPU", "GPU"], "nccl"), ("ring", ["GPU"], "ring")])
def test_select_communication_multi_worker(requested, types, expected):
    assert select_communication(requested, types, multi_worker=True) == expected


def test_single_host_reductions_refused_across_workers():
    with pytest.raises(CommunicationError, match="'reduce_to_one' only works on one host"):
        select_communication("reduce_to_one", ["CPU"], multi_worker=True)


def test_nccl_needs_distinct_physical_gpus():
    assert select_communication("auto", ["GPU"] * 2, physical_gpus=["g0", "g1"]) == "nccl"
    assert select_communication("auto", ["GPU"] * 3, physical_gpus=["g0", "g1", "g1"]) == "ring"
    assert select_communication("auto", ["GPU"] * 2, multi_worker=True,
                                physical_gpus=["g0", "g0"]) == "ring"
    with pytest.raises(CommunicationError, match=r"logical GPUs of g1 \(NCCL refuses"):
        select_communication("nccl", ["GPU"] * 3, physical_gpus=["g0", "g1", "g1"])
