"""Typed errors. Each message states the rule, what was received and how to fix it."""


class DeviceError(ValueError):
    """A device list names a device that does not exist, or one twice."""


class CommunicationError(ValueError):
    """An unknown or impossible all-reduce implementation was asked for."""


class BatchSizeError(ValueError):
    """A batch does not split into the replicas (or micro-batches) that share it."""


class ScheduleError(ValueError):
    """A pipeline schedule has bad arguments, misses or repeats actions, or would deadlock."""


class ClusterError(RuntimeError):
    """A task of the cluster cannot be reached, or failed in a way training cannot survive."""


class InitializationError(RuntimeError):
    """Something must happen before TensorFlow initializes its devices, and it is too late."""


class ReplicaContextError(RuntimeError):
    """A collective was called outside `strategy.run`."""


class PlacementError(ValueError):
    """Layers cannot be placed on the devices, or cut into stages, as asked."""


class InternalsError(RuntimeError):
    """A Keras or TensorFlow private that tfpar relies on is missing or has changed."""
