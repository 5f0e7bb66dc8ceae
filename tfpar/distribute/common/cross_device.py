"""Builds the cross-device reduction ops for a chosen communication."""

import tensorflow as tf

from tfpar import devices as devices_lib
from tfpar.distribute.common import hierarchical_reduce, pair_exchanges
from tfpar.keras import tf_runtime
from tfpar.plan import communication as comm
from tfpar.plan import host_hierarchy


def install_launchers(ops, num_replicas, collective_keys, options, first_replica,
                      route=None):
    """Gives TensorFlow's collective all-reduce `ops` (this process's replicas, the first of
    them replica `first_replica` of `num_replicas`) tfpar's launchers: the timeout of
    `options` on the first collective of each traced function only
    (`tf_runtime.replace_launchers`), and with `route` (`routed_all_reduce`) dense
    all-reduces its way."""
    tf_runtime.replace_launchers(ops, num_replicas, collective_keys, options, first_replica,
                                 route)
    return ops


def routed_all_reduce(communication, num_replicas, key_base, host_of_rank=None):
    """How a strategy's replicas' dense all-reduces go when tfpar carries them out itself:
    halving-doubling's pairs (`pair_exchanges.Exchanges`), the three steps over hosts
    (`hierarchical_reduce.HostHierarchy`, with each replica's host in `host_of_rank`), or
    None: TensorFlow's collective."""
    if communication == comm.HALVING_DOUBLING:
        return pair_exchanges.Exchanges(num_replicas, key_base)
    if communication == comm.HIERARCHICAL and host_of_rank is not None:
        return hierarchical_reduce.HostHierarchy(host_hierarchy.plan(host_of_rank), key_base)
    return None


def make_cross_device_ops(communication, devices, collective_keys, bytes_per_pack=0,
                          key_base=None, gathers=False):
    """Returns a `tf.distribute.CrossDeviceOps` for a concrete communication.

    Over devices of several processes only collectives reduce (TensorFlow's in-process
    NCCL ops and a root device are never used there): "nccl" is the collective's NCCL
    implementation, "ring" its ring; anything else is refused.

    Args:
      communication: a concrete choice from `tfpar.plan.communication`
        (not "auto": resolve it with `select_communication` first).
      devices: canonical device names, one per replica.
      collective_keys: the strategy's `CollectiveKeys`, shared with its other
        collectives so that instance keys never collide.
      bytes_per_pack: for "ring" and "halving_doubling", concatenate gradients into
        packs of about this many bytes (0: one collective per tensor).
      key_base: the strategy's block of group keys ("halving_doubling" only: its pairs'
        groups are keyed from it).
      gathers: the replicas also all-gather (context parallelism): only collectives do,
        so "nccl" is the collective's NCCL implementation (TensorFlow's in-process NCCL
        ops reduce only), and a root device or a copy hierarchy is refused.
    """
    if gathers and communication not in (comm.NCCL, comm.RING):
        raise ValueError(
            f"Context parallelism gathers keys and values between the replicas, which "
            f"TensorFlow's collectives do: communication='ring' (or 'nccl' on GPUs, "
            f"'auto'), not {communication!r}.")
    if communication == comm.HALVING_DOUBLING:
        if key_base is None:
            raise ValueError("communication='halving_doubling' reduces the replicas of a "
                             "DataParallelStrategy only; here use 'auto' or 'ring'.")
        return install_launchers(
            tf_runtime.ring_all_reduce(devices, bytes_per_pack, collective_keys),
            len(devices), collective_keys, tf_runtime.ring_options(bytes_per_pack), 0,
            routed_all_reduce(communication, len(devices), key_base))
    if devices_lib.spans_tasks(devices) or gathers:
        if communication not in (comm.NCCL, comm.RING):  # (TensorFlow's collectives.)
            raise ValueError(f"Devices of several processes reduce by collectives only, not "
                             f"{communication!r}: {', '.join(devices)}.")
        return tf_runtime.ring_all_reduce(devices, bytes_per_pack, collective_keys,
                                          implementation=communication)
    if communication == comm.NCCL:
        return tf.distribute.NcclAllReduce()
    if communication == comm.HIERARCHICAL:
        return tf.distribute.HierarchicalCopyAllReduce()
    if communication == comm.REDUCE_TO_ONE:
        return tf.distribute.ReductionToOneDevice()
    if communication == comm.RING:
        return tf_runtime.ring_all_reduce(devices, bytes_per_pack, collective_keys)
    raise ValueError(f"No cross-device ops for communication {communication!r}.")
