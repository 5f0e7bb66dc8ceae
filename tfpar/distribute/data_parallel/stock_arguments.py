"""The constructor arguments of the strategies DataParallelStrategy stands in for.

`tf.distribute.MirroredStrategy(cross_device_ops=...)` and
`tf.distribute.MultiWorkerMirroredStrategy(communication_options=...)` are read as tfpar's
own `communication`, `bytes_per_pack` and `timeout_seconds`, so code written for the stock
strategies runs unchanged. `cross_device_ops` is used as given; tfpar's name for it (or its
class name) is the strategy's `communication`.
"""

import dataclasses
import math
from typing import Any, Optional

import tensorflow as tf

from tfpar.plan import communication as comm

# The stock CrossDeviceOps tfpar's communications are (used as the user made them: their
# packing or destination kept).
_NAMED_OPS = ((tf.distribute.NcclAllReduce, comm.NCCL),
              (tf.distribute.HierarchicalCopyAllReduce, comm.HIERARCHICAL),
              (tf.distribute.ReductionToOneDevice, comm.REDUCE_TO_ONE))
_IMPLEMENTATIONS = {"AUTO": comm.AUTO, "RING": comm.RING, "NCCL": comm.NCCL}
# (The public constructor returns an instance of another class: its type is checked.)
_OPTIONS = type(tf.distribute.experimental.CommunicationOptions())


@dataclasses.dataclass(frozen=True)
class Reduction:
    """What the strategy reduces with: a tfpar communication, with stock ops to use."""
    communication: str
    bytes_per_pack: Optional[int]
    timeout_seconds: Optional[float]
    given_ops: Any = None  # The user's tf.distribute.CrossDeviceOps, used as given.


def _named(ops):
    return next((name for cls, name in _NAMED_OPS if type(ops) is cls), None)


def _conflict(argument, stock, value):
    return ValueError(
        f"{argument}={value!r} and {stock} both say how to reduce: pass one of them.")


def resolve(communication, bytes_per_pack, timeout_seconds, cross_device_ops=None,
            communication_options=None, multi_worker=False, shard=None):
    """Returns the `Reduction` the arguments ask for, or raises a ValueError saying what to
    change.

    >>> resolve("auto", None, None, tf.distribute.HierarchicalCopyAllReduce()).communication
    'hierarchical'
    >>> options = tf.distribute.experimental.CommunicationOptions(
    ...     bytes_per_pack=1024, timeout_seconds=30,
    ...     implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    >>> r = resolve("auto", None, None, communication_options=options)
    >>> (r.communication, r.bytes_per_pack, r.timeout_seconds)
    ('ring', 1024, 30)
    """
    given = None
    if cross_device_ops is not None:
        if not isinstance(cross_device_ops, tf.distribute.CrossDeviceOps):
            raise TypeError(
                f"cross_device_ops must be a tf.distribute.CrossDeviceOps (for example "
                f"tf.distribute.NcclAllReduce()), not {type(cross_device_ops).__name__}. "
                f"Or pass communication= one of {', '.join(map(repr, comm.COMMUNICATIONS))}.")
        if multi_worker:
            raise ValueError(
                "cross_device_ops only works on one host (as for "
                "tf.distribute.MirroredStrategy). Across workers pass communication_options="
                "tf.distribute.experimental.CommunicationOptions(...) or communication=.")
        if communication != comm.AUTO:
            raise _conflict("communication", "cross_device_ops", communication)
        given, communication = cross_device_ops, _named(cross_device_ops)
        if communication is None:
            if shard:
                raise ValueError(
                    f"shard={shard!r} reduces with tfpar's own collectives, so it cannot "
                    f"use {type(cross_device_ops).__name__} as given. Pass communication= one "
                    f"of {', '.join(map(repr, comm.COMMUNICATIONS))} instead.")
            communication = type(cross_device_ops).__name__
    if communication_options is not None:
        if not isinstance(communication_options, _OPTIONS):
            raise TypeError(
                f"communication_options must be a "
                f"tf.distribute.experimental.CommunicationOptions, not "
                f"{type(communication_options).__name__}.")
        implementation = _IMPLEMENTATIONS[communication_options.implementation.name]
        if implementation != comm.AUTO:
            if communication != comm.AUTO:
                raise _conflict("communication", "communication_options.implementation",
                                communication)
            communication = implementation
        # (Stock: 0 bytes per pack means "decided automatically", tfpar's None.)
        if communication_options.bytes_per_pack:
            if bytes_per_pack is not None:
                raise _conflict("bytes_per_pack", "communication_options.bytes_per_pack",
                                bytes_per_pack)
            bytes_per_pack = communication_options.bytes_per_pack
        if communication_options.timeout_seconds is not None:
            if timeout_seconds is not None:
                raise _conflict("timeout_seconds", "communication_options.timeout_seconds",
                                timeout_seconds)
            # (Stock: 0 disables the timeout.)
            timeout_seconds = communication_options.timeout_seconds or math.inf
    return Reduction(communication, bytes_per_pack, timeout_seconds, given)


def positional(devices, communication, cluster_resolver, cross_device_ops,
               communication_options):
    """Arguments given in the stock strategies' positions, moved to tfpar's:
    `MirroredStrategy(devices, cross_device_ops)` and
    `MultiWorkerMirroredStrategy(cluster_resolver, communication_options)`.

    >>> _, communication, _, ops, _ = positional(
    ...     None, tf.distribute.ReductionToOneDevice(), None, None, None)
    >>> communication, type(ops).__name__
    ('auto', 'ReductionToOneDevice')
    """
    if isinstance(devices, tf.distribute.cluster_resolver.ClusterResolver):
        if cluster_resolver is not None:
            raise ValueError("Two cluster resolvers were given: pass one, as cluster_resolver=.")
        devices, cluster_resolver = None, devices
    if isinstance(communication, tf.distribute.CrossDeviceOps) and cross_device_ops is None:
        communication, cross_device_ops = comm.AUTO, communication
    if isinstance(communication, _OPTIONS) and communication_options is None:
        communication, communication_options = comm.AUTO, communication
    return devices, communication, cluster_resolver, cross_device_ops, communication_options
