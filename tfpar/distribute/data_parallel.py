"""Synchronous mirrored data parallelism on one host."""

import tensorflow as tf
from tensorflow.python.distribute import mirrored_strategy

from tfpar import devices as devices_lib
from tfpar.distribute import group_keys
from tfpar.distribute.cross_device import make_cross_device_ops
from tfpar.plan import batching
from tfpar.plan.communication import select_communication


class DataParallelStrategy(tf.distribute.MirroredStrategy):
    """Synchronous data parallelism: one replica per device, gradients all-reduced.

    A `tf.distribute.MirroredStrategy` whose all-reduce is chosen for the
    devices (NCCL on GPUs, a measured choice on CPUs) and whose collective keys
    are its own, so that strategies of any size coexist in one process. When
    TF_CONFIG (or `cluster_resolver`) names several workers, it is instead a
    `tf.distribute.MultiWorkerMirroredStrategy` on which Keras `fit` works.

    Args:
      devices: device names, one replica each. None: all GPUs, or all logical
        CPUs when there is no GPU.
      communication: "auto" (NCCL when every device is a GPU, else the fastest
        CPU path measured: "reduce_to_one"), "nccl", "ring", "reduce_to_one" or
        "hierarchical".
      bytes_per_pack: for ring all-reduce, pack gradients into chunks of about
        this many bytes (0: one collective per gradient). None: 0 on one host
        (packing measured no gain there), 4 MiB across workers (measured ~15%
        faster steps than unpacked; see BUILD_NOTES.md).
      cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`; by
        default TF_CONFIG is read. With more than one worker (chief + workers)
        the strategy trains synchronously across them, and `devices` must be None.
      timeout_seconds: across workers, a collective that waits longer than this
        for a peer fails (a dead peer ends training instead of hanging).

    Example:
      >>> import keras, numpy as np, tfpar
      >>> strategy = tfpar.DataParallelStrategy()
      >>> with strategy.scope():
      ...     model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
      ...     model.compile("sgd", "sparse_categorical_crossentropy")
      >>> _ = model.fit(np.zeros((8, 2)), np.zeros(8), batch_size=4, verbose=0)
    """

    def __new__(cls, devices=None, communication="auto", bytes_per_pack=None,
                cluster_resolver=None, timeout_seconds=None):
        if cls is DataParallelStrategy:
            from tfpar.distribute import multi_worker

            if multi_worker.cluster_worker_count(cluster_resolver) > 1:
                cls = multi_worker.MultiWorkerDataParallelStrategy
        return super().__new__(cls)

    def __init__(self, devices=None, communication="auto", bytes_per_pack=None,
                 cluster_resolver=None, timeout_seconds=None):
        bytes_per_pack = check_bytes_per_pack(bytes_per_pack, default=0)
        resolved = devices_lib.resolve_devices(devices)
        self.communication = select_communication(
            communication, [devices_lib.device_type(d) for d in resolved])
        # Read by MirroredExtended when it makes its CollectiveKeys.
        self._collective_key_base = group_keys.next_key_base()
        if bytes_per_pack and self.communication != "ring":
            raise ValueError(
                f"bytes_per_pack packs gradients for communication='ring', but this strategy "
                f"uses {self.communication!r}. Pass communication='ring' or drop bytes_per_pack.")
        extended = _DataParallelExtended(
            self, resolved, self.communication, bytes_per_pack)
        super(tf.distribute.MirroredStrategy, self).__init__(extended)

    def __repr__(self):
        return (f"DataParallelStrategy(replicas={self.num_replicas_in_sync}, "
                f"communication={self.communication!r})")


class _DataParallelExtended(mirrored_strategy.MirroredExtended):
    """MirroredExtended with tfpar's reduction choice and batch checks."""

    def __init__(self, container_strategy, devices, communication, bytes_per_pack):
        self._tfpar_communication = communication
        self._tfpar_bytes_per_pack = bytes_per_pack
        super().__init__(container_strategy, devices=devices)

    def _initialize_strategy(self, devices):
        super()._initialize_strategy(devices)
        self._cross_device_ops = make_cross_device_ops(
            self._tfpar_communication, self._devices, self._collective_keys,
            self._tfpar_bytes_per_pack)

    def _experimental_distribute_dataset(self, dataset, options):
        dataset = check_first_batch(dataset, len(self._devices))
        return super()._experimental_distribute_dataset(dataset, options)


def check_bytes_per_pack(bytes_per_pack, default):
    """Validates `bytes_per_pack`; None becomes `default`."""
    if bytes_per_pack is None:
        return default
    if not isinstance(bytes_per_pack, int) or isinstance(bytes_per_pack, bool) or bytes_per_pack < 0:
        raise ValueError(
            f"bytes_per_pack must be an integer >= 0 (or None). Received: {bytes_per_pack!r}")
    return bytes_per_pack


def check_first_batch(dataset, num_replicas):
    """Fails fast when a dataset's global batch cannot feed every replica.

    A static batch dimension is checked now. Otherwise the first batch is checked
    when it is read (later batches may be a legitimate last partial batch).
    """
    if num_replicas < 2:
        return dataset
    first = tf.nest.flatten(dataset.element_spec)[0]
    shape = getattr(first, "shape", None)
    if shape is None or shape.rank in (None, 0):
        return dataset
    if shape[0] is not None:
        batching.check_global_batch(int(shape[0]), num_replicas)
        return dataset
    message = (
        f"The global batch size is smaller than the number of replicas ({num_replicas}): "
        f"every replica needs at least one example. Use a global batch size of at "
        f"least {num_replicas}, ideally a multiple of it, or use fewer devices.")

    def check(index, element):
        size = tf.shape(tf.nest.flatten(element)[0])[0]
        ok = tf.logical_or(index > 0, size >= num_replicas)
        with tf.control_dependencies([tf.debugging.Assert(ok, [message, "Got:", size])]):
            return tf.nest.map_structure(
                lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t, element)

    return dataset.enumerate().map(check)

