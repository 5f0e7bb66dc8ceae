"""Data parallelism across TF_CONFIG workers: the cluster count and the collective extended.

`tfpar.DataParallelStrategy` (in `data_parallel_strategy.py`) becomes its multi-worker form
when the cluster has several workers; this module holds the TensorFlow glue of that form.
"""

import tensorflow as tf

from tfpar.distribute.common.cluster_config import cluster_config
from tfpar.distribute.context import sequence_split
from tfpar.distribute.data_parallel.input_checks import check_first_batch
from tfpar.distribute.zero import zero_owners
from tfpar.keras import internals
from tfpar.keras import tf_runtime
from tfpar.plan import host_hierarchy
from tfpar.plan.communication import AUTO, HALVING_DOUBLING, HIERARCHICAL, NCCL, RING


def implementation(communication):
    """TensorFlow's collective implementation for "nccl" or "ring" (and for what
    "halving_doubling" and "hierarchical" leave to TensorFlow: sparse values, gathers,
    broadcasts; "auto" for the latter, NCCL's on GPUs)."""
    return tf_runtime.collective_implementation(
        {NCCL: "nccl", RING: "ring", HALVING_DOUBLING: "ring", HIERARCHICAL: AUTO}[communication])


# Packing gradients into ~4 MiB collectives cut the 2-worker step time by ~15%
# against one collective per gradient (benchmarks/multi_worker.py).
MULTI_WORKER_PACK_BYTES = 4 << 20


# A collective that waits longer for a peer fails, naming it (PyTorch's watchdog waits
# 10 minutes too; TensorFlow's default is forever).
DEFAULT_COLLECTIVE_TIMEOUT_SECONDS = 600.0
# How long a worker waits for the others to make the same strategy at most.
STRATEGY_CHECK_SECONDS = 300.0


def collective_timeout(timeout_seconds):
    """The timeout a strategy uses: None means the default; math.inf, none."""
    if timeout_seconds is None:
        return DEFAULT_COLLECTIVE_TIMEOUT_SECONDS
    if (isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float))
            or not timeout_seconds > 0):
        raise ValueError(f"timeout_seconds must be a number of seconds > 0 (math.inf: no "
                         f"limit), or None for {DEFAULT_COLLECTIVE_TIMEOUT_SECONDS:g}s. "
                         f"Received: {timeout_seconds!r}")
    return float(timeout_seconds)


class Peers:
    """This task and the other training tasks of the cluster, by name ("worker:1")."""

    def __init__(self, cluster_resolver):
        config = cluster_config(cluster_resolver)
        self.addresses = {f"{job}:{i}": address for job in ("chief", "worker")
                          for i, address in enumerate(config.cluster.get(job, ()))}
        self.me = config.task_name
        self.peers = [name for name in self.addresses if name != self.me]


def hosts_of_replicas(cluster_resolver, num_replicas):
    """The host of each of the cluster's `num_replicas` replicas, in TensorFlow's order of
    its collective ranks (the chief's, then each worker's, the same count on each task): the
    host part of its task's address."""
    config = cluster_config(cluster_resolver)
    addresses = [a for job in ("chief", "worker") for a in config.cluster.get(job, ())]
    return host_hierarchy.replica_hosts(addresses, num_replicas // len(addresses))


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


def joined(dataset_fn, longest_of_all):
    """`dataset_fn`, its datasets padded so that every worker has as many batches.

    Each worker's dataset may hold a different number of batches. Keras takes an
    epoch's steps from the length it sees, so each worker stopped at its own count
    and the workers' collectives no longer matched. Here the workers agree on the
    longest length (`longest_of_all(local_length)`), and a shorter dataset is
    followed by empty batches up to it: every worker runs every step, each example
    is read once, and empty batches add nothing to the loss sums and example counts
    that tfpar normalizes by, so each step's gradient is that of the examples read
    in it. When a length is unknown (or batches cannot be made empty), the dataset
    says no length instead, and TensorFlow's distributed iterator (which asks all
    workers whether any has data) ends the epoch when all are done; one last step
    then runs on empty batches everywhere.
    """
    def fn(context):
        dataset = dataset_fn(context)
        local = int(dataset.cardinality())
        longest = longest_of_all(local)
        empty = _empty_batch(dataset.element_spec)
        if longest < 0 or empty is None:  # Unknown or infinite somewhere.
            return dataset if longest == tf.data.INFINITE_CARDINALITY else dataset.filter(
                lambda *element: True)
        if local < longest:
            dataset = dataset.concatenate(
                tf.data.Dataset.from_tensors(empty).repeat(longest - local))
        return dataset
    return fn


def _empty_batch(spec):
    """A batch of no examples matching `spec`, or None when one cannot be made."""
    specs = tf.nest.flatten(spec)
    if not all(isinstance(s, tf.TensorSpec) and s.shape.rank and s.shape[1:].is_fully_defined()
               for s in specs):
        return None
    return tf.nest.pack_sequence_as(
        spec, [tf.zeros([0, *s.shape[1:]], s.dtype) for s in specs])


def rank(value):
    if isinstance(value, tf.distribute.DistributedValues):
        value = value.values[0]
    shape = getattr(value, "shape", None)
    return None if shape is None else shape.rank


@internals.overrides
class MultiWorkerExtended(zero_owners.OwnerPlacedVariables,
                          tf_runtime.collective_all_reduce_extended()):

    def _reduce_to(self, reduce_op, value, destinations, options):
        # Keras reduces a whole (x, y) data batch in one call; the stock code only
        # takes a single value across workers ("unsupported type PerReplica to a
        # Tensor", keras-team/keras#20585).
        if isinstance(value, (tuple, list, dict)):
            return tf.nest.map_structure(
                lambda v: super(MultiWorkerExtended, self)._reduce_to(
                    reduce_op, v, destinations, options), value)
        return super()._reduce_to(reduce_op, value, destinations, options)

    def _experimental_distribute_dataset(self, dataset, options):
        context_parallel = self._container_strategy().context_parallel
        if context_parallel > 1:  # Every worker reads each batch, keeps its replicas' chunks.
            part = sequence_split.worker_part(dataset, context_parallel,
                                              tf_runtime.first_local_replica(self),
                                              len(self.worker_devices))
            return self._distribute_datasets_from_function(lambda _: part, options)
        dataset = check_first_batch(
            dataset, tf_runtime.num_replicas_in_sync(self), in_pipeline=False)
        return super()._experimental_distribute_dataset(dataset, options)

    def _zero_local_replicas(self):
        return self.worker_devices, tf_runtime.first_local_replica(self)
