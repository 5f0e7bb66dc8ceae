"""Synchronous data parallelism across TF_CONFIG workers (collective all-reduce)."""

import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy
from tensorflow.python.distribute import collective_util
from tensorflow.python.distribute.cluster_resolver import tfconfig_cluster_resolver

from tfpar import keras_seam
from tfpar.distribute.cluster import cluster_config
from tfpar.distribute import group_keys
from tfpar.distribute.data_parallel import (
    DataParallelStrategy, check_bytes_per_pack, check_first_batch)
from tfpar.errors import DeviceError
from tfpar.plan.communication import NCCL, RING, select_communication

_IMPLEMENTATIONS = {
    NCCL: collective_util.CommunicationImplementation.NCCL,
    RING: collective_util.CommunicationImplementation.RING,
}


# Packing gradients into ~4 MiB collectives cut the 2-worker step time by ~15%
# against one collective per gradient (benchmarks/multi_worker.py).
MULTI_WORKER_PACK_BYTES = 4 << 20


def cluster_worker_count(cluster_resolver=None):
    """Training tasks (chief + workers) in the cluster; 0 when there is no cluster.

    TF_CONFIG is validated here, so a malformed one fails fast with a clear error.
    """
    config = cluster_config(cluster_resolver)
    if config is None:
        return 0
    if config.num_ps:
        raise ValueError(
            "The cluster has parameter-server ('ps') tasks, which DataParallelStrategy does not "
            "use: use tfpar.ParameterServerStrategy, or remove 'ps' from TF_CONFIG.")
    return config.num_workers


class MultiWorkerDataParallelStrategy(DataParallelStrategy, tf.distribute.MultiWorkerMirroredStrategy):
    """DataParallelStrategy across workers; made by `DataParallelStrategy()` in a cluster.

    It is also a `tf.distribute.MultiWorkerMirroredStrategy`, so Keras takes its
    multi-worker paths (gathering predictions across workers, for example).
    """

    _tfpar_multi_worker = True

    def __init__(self, devices=None, communication="auto", bytes_per_pack=None,
                 cluster_resolver=None, timeout_seconds=None):
        if devices is not None:
            raise DeviceError(
                "devices cannot be chosen across workers: each worker uses all its GPUs, or "
                "its CPU. Pass devices=None.")
        resolver = cluster_resolver or tfconfig_cluster_resolver.TFConfigClusterResolver()
        gpus = tf.config.list_physical_devices("GPU")
        self.communication = select_communication(
            communication, ["GPU"] * len(gpus) or ["CPU"], multi_worker=True)
        options = collective_util.Options(
            bytes_per_pack=check_bytes_per_pack(bytes_per_pack, MULTI_WORKER_PACK_BYTES),
            timeout_seconds=timeout_seconds,
            implementation=_IMPLEMENTATIONS[self.communication])
        self._collective_key_base = group_keys.next_key_base()
        extended = _MultiWorkerExtended(
            self, cluster_resolver=resolver, communication_options=options)
        super(tf.distribute.MultiWorkerMirroredStrategy, self).__init__(extended)
        keras_seam.install_multi_worker_callbacks()

    def reduce(self, reduce_op, value, axis):
        # Keras' multi-worker path reduces scalar step outputs (loss, metrics) with
        # axis=0, which fails on a scalar; the mean over replicas is what it means.
        if axis is not None and _rank(value) == 0:
            axis = None
        return super().reduce(reduce_op, value, axis)

    def __repr__(self):
        return (f"DataParallelStrategy(workers={self.extended._num_workers}, "
                f"replicas={self.num_replicas_in_sync}, communication={self.communication!r})")


def _rank(value):
    if isinstance(value, tf.distribute.DistributedValues):
        value = value.values[0]
    shape = getattr(value, "shape", None)
    return None if shape is None else shape.rank


class _MultiWorkerExtended(collective_all_reduce_strategy.CollectiveAllReduceExtended):

    def _reduce_to(self, reduce_op, value, destinations, options):
        # Keras reduces a whole (x, y) data batch in one call; the stock code only
        # takes a single value across workers ("unsupported type PerReplica to a
        # Tensor", keras-team/keras#20585).
        if isinstance(value, (tuple, list, dict)):
            return tf.nest.map_structure(
                lambda v: super(_MultiWorkerExtended, self)._reduce_to(
                    reduce_op, v, destinations, options), value)
        return super()._reduce_to(reduce_op, value, destinations, options)

    def _experimental_distribute_dataset(self, dataset, options):
        dataset = check_first_batch(dataset, self._num_replicas_in_sync)
        return super()._experimental_distribute_dataset(dataset, options)
