"""Synchronous mirrored data parallelism, on one host or across TF_CONFIG workers."""

import functools
import math

import tensorflow as tf

from tfpar import devices as devices_lib
from tfpar.contract import StrategyHooks
from tfpar.distribute.common import device_memory as memory
from tfpar.distribute.common import group_keys
from tfpar.distribute.common import owner_values
from tfpar.distribute.common import rendezvous
from tfpar.distribute.common.cross_device import (install_launchers, make_cross_device_ops,
                                                 routed_all_reduce)
from tfpar.distribute.context import sequence_split
from tfpar.distribute.data_parallel import local_sgd, multi_worker, stock_arguments
from tfpar.distribute.data_parallel.input_checks import check_first_batch
from tfpar.distribute.zero import owner_checkpoint
from tfpar.distribute.zero import zero_collectives
from tfpar.distribute.zero import zero_owners
from tfpar.distribute.zero import zero_pacing
from tfpar.distribute.zero import zero_sharding as sharded
from tfpar.errors import DeviceError
from tfpar.keras import context_layers
from tfpar.keras import hooks as keras_hooks
from tfpar.keras import internals
from tfpar.keras import local_steps
from tfpar.keras import models as keras_models
from tfpar.keras import tf_runtime
from tfpar.keras import zero_optimizers as keras_sharded
from tfpar.plan import memory as plan_memory
from tfpar.plan import sharding
from tfpar.plan.communication import (COMMUNICATIONS, PACKING,
                                      check_bytes_per_pack, check_compression,
                                      check_sharded_communication, select_communication)


class DataParallelStrategy(sharded.ZeroHooks, StrategyHooks, tf.distribute.MirroredStrategy):
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
        CPU path measured: "reduce_to_one"), "nccl", "ring", "reduce_to_one",
        "hierarchical" or "halving_doubling" (replicas exchange in pairs: log2(n)
        steps for buffers up to 64 KiB, 2 log2(n) above, where a ring takes 2 (n-1);
        `tfpar.plan.halving_doubling`; not with `shard` yet). Across workers,
        "hierarchical" sums within each host, then one slice per replica across the
        hosts, then puts the slices together within each host (`tfpar.plan.host_hierarchy`;
        a host is the host part of a task's address; as many replicas on every host; not
        with `shard` yet); on one host it is TensorFlow's `HierarchicalCopyAllReduce`.
      bytes_per_pack: for ring and halving-doubling all-reduce, pack gradients into chunks of about
        this many bytes (0: one collective per gradient). None: 0 on one host
        (packing measured no gain there), 4 MiB across workers (measured ~15%
        faster steps than unpacked; see BUILD_NOTES.md). Under `shard`, the size of
        the buckets gradients are reduce-scattered in, with any `communication`
        (None: 25 MiB; 0: one bucket).
      cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`; by
        default TF_CONFIG is read. With more than one worker (chief + workers)
        the strategy trains synchronously across them, and `devices` must be None.
      timeout_seconds: across workers, a collective that waits longer than this
        for a peer fails with a `ClusterError` naming the workers that did not
        arrive (dead or stuck) instead of hanging. None: 600 s (as PyTorch's
        watchdog); `math.inf`: wait forever.
      shard: ZeRO sharding of the training state over the replicas. None: every
        replica keeps everything. "optimizer" (stage 1): each replica keeps the
        optimizer state of its share of the variables and updates only those.
        "gradients" (stage 2): also, gradients are reduce-scattered, each replica
        keeping its share. "parameters" (stage 3): also, each variable lives on its
        owner only and is read from it where a layer uses it (across workers, a
        broadcast whose gradient is reduced back). Whole variables are shared out
        (see `tfpar.plan.sharding`); checkpoints hold full, unsharded state.
      cross_device_ops: as for `tf.distribute.MirroredStrategy` (one host): a
        `tf.distribute.CrossDeviceOps`, used as given in place of `communication`
        (`NcclAllReduce`, `HierarchicalCopyAllReduce` and `ReductionToOneDevice` are
        "nccl", "hierarchical" and "reduce_to_one"; others work without `shard`).
      communication_options: as for `tf.distribute.MultiWorkerMirroredStrategy`: a
        `tf.distribute.experimental.CommunicationOptions`, read as `communication`
        (its implementation), `bytes_per_pack` and `timeout_seconds` (0: wait forever).
        Both also work in the stock strategies' positions.
      reshard_after_forward: under shard="parameters", free the weights a replica read
        from their owners after each layer's forward pass and read them again for its
        backward pass (FSDP's default): one layer's gathered weights are held at a time,
        for one more forward computation of each layer (it is recomputed, as under
        `keras.RematScope(mode="full")`; layers with other state or random draws keep
        their reads instead). None: True under shard="parameters". False: every read is
        kept from the forward to the backward pass (faster, the memory of unsharded
        weights).
      compression: "fp16" or "bf16": the replicas' gradients summed in that type on the
        wire (half the bytes), as PyTorch DDP's compression hooks do: each replica casts
        its float gradients (float16: divided by the number of replicas first, so the
        sum stays in range), the sum is cast back. None: full precision. With
        shard="optimizer" or "gradients" (ZeRO-1/2) each gradient's sum on its owner
        is made in that type too; not with shard="parameters" yet.
      sync_every: periodic averaging (local SGD): each replica steps on its own
        gradient (N x its part of the global loss's: with a mean loss, its own
        examples' mean) with its own optimizer state, and the replicas' weights are
        averaged every `sync_every` optimizer steps and when `fit` returns: one
        all-reduce of the weights per n steps in place of one of the gradients per
        step (PyTorch's post-local SGD). 1 (default): gradients summed every step.
        Not with `shard`, `compression` or `gradient_accumulation_steps`.
      sync_optimizer_state: under `sync_every` > 1, average the optimizer's float state
        (Adam's moments, momentum) with the weights. Default False: each replica keeps
        its own, as PyTorch's model averager does.
      context_parallel: C > 1 splits every sequence of the batch over the C replicas
        (context parallelism, for sequences longer than one device's activations hold):
        each holds two of 2C chunks of every example's positions (an early and a late
        one, so that causal attention costs every replica alike), its layers run on its
        positions, and attention gathers the keys and values of the whole sequence from
        the others (Llama 3's all-gather context parallelism), attending to them a block
        of keys at a time with a recomputing backward. Inputs whose second axis
        is the sequence (the first input's static length, a multiple of 2C) are split;
        the loss is normalized over every replica's tokens, gradients summed as in data
        parallelism. Keras' attention, keras-hub's transformer layers and position
        embeddings learn the split (`tfpar.keras.context_layers`); a model with a layer
        that mixes positions otherwise (pooling, convolutions, recurrence) is refused
        before its first step. `predict` returns each sequence whole. For now C is the
        number of replicas (across workers, every worker's: each reads every batch).

    Examples:
      >>> import keras, numpy as np, tfpar
      >>> strategy = tfpar.DataParallelStrategy()
      >>> with strategy.scope():
      ...     model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
      ...     model.compile("sgd", "sparse_categorical_crossentropy")
      >>> _ = model.fit(np.zeros((8, 2)), np.zeros(8), batch_size=4, verbose=0)
    """

    # Read by the Keras seam (tfpar.keras.replicas): losses normalized over the global
    # batch, BatchNorm statistics averaged over replicas, gradient accumulation.
    _tfpar_exact_replicas = True
    _tfpar_mirrored = True

    def __new__(cls, devices=None, communication="auto", bytes_per_pack=None,
                cluster_resolver=None, timeout_seconds=None, shard=None,
                reshard_after_forward=None, cross_device_ops=None,
                communication_options=None, compression=None, sync_every=1,
                sync_optimizer_state=False, context_parallel=1):
        if cls is DataParallelStrategy:
            cluster_resolver = stock_arguments.positional(
                devices, communication, cluster_resolver, None, None)[2]
            if multi_worker.cluster_worker_count(cluster_resolver) > 1:
                cls = MultiWorkerDataParallelStrategy
        return super().__new__(cls)

    def __init__(self, devices=None, communication="auto", bytes_per_pack=None,
                 cluster_resolver=None, timeout_seconds=None, shard=None,
                 reshard_after_forward=None, cross_device_ops=None,
                 communication_options=None, compression=None, sync_every=1,
                 sync_optimizer_state=False, context_parallel=1):
        # One construction path for one host and for workers; what differs is in the
        # `_tfpar_*` steps that MultiWorkerDataParallelStrategy overrides.
        devices, communication, cluster_resolver, cross_device_ops, communication_options = (
            stock_arguments.positional(devices, communication, cluster_resolver,
                                       cross_device_ops, communication_options))
        reduction = stock_arguments.resolve(
            communication, bytes_per_pack, timeout_seconds, cross_device_ops,
            communication_options,
            multi_worker=isinstance(self, tf.distribute.MultiWorkerMirroredStrategy),
            shard=shard)
        communication, bytes_per_pack, timeout_seconds = (
            reduction.communication, reduction.bytes_per_pack, reduction.timeout_seconds)
        self._given_cross_device_ops = reduction.given_ops
        self._tfpar_shard_stage = sharding.check_shard(shard)
        self.shard = shard
        self.compression = check_compression(compression, shard)
        check_sharded_communication(
            communication, shard,
            multi_worker=isinstance(self, tf.distribute.MultiWorkerMirroredStrategy))
        self.sync_every = local_sgd.check_sync_every(sync_every, shard, compression)
        self.sync_optimizer_state = bool(sync_optimizer_state)
        self.context_parallel = sequence_split.check_context_parallel(
            context_parallel, sync_every=self.sync_every)
        self.reshard_after_forward = sharding.check_reshard(shard, reshard_after_forward)
        self._dp_regathered_models = set()  # ids of the models made to regather.
        if self.reshard_after_forward or self.context_parallel > 1:
            keras_hooks.install_model_call_hook()
        self._dp_context_prepared = set()  # ids of the models taught the split sequence.
        self._dp_cluster_resolver = (
            cluster_resolver or tf.distribute.cluster_resolver.TFConfigClusterResolver())
        # Under shard=..., tfpar packs gradients itself (in these buckets), whatever the
        # reduction.
        self._zero_bucket_bytes = check_bytes_per_pack(
            bytes_per_pack, default=sharding.DEFAULT_BUCKET_BYTES)
        extended = self._build_extended(
            devices, communication, None if self._tfpar_shard_stage else bytes_per_pack,
            timeout_seconds)
        tf.distribute.Strategy.__init__(self, extended)
        sequence_split.check_devices(self.context_parallel, self.num_replicas_in_sync)
        keras_hooks.install_exact_replicas()
        self._install_keras_hooks()
        sharded.set_up(self, self.num_replicas_in_sync, lambda: zero_collectives.ShardCollectives(
            *self._shard_collective_args(extended)))
        self._join_workers()

    # -- The steps of construction on one host --------------------------------------------

    def _build_extended(self, devices, communication, bytes_per_pack, timeout_seconds):
        resolved = devices_lib.resolve_devices(devices)
        given = self._given_cross_device_ops is not None and communication not in COMMUNICATIONS
        self.communication = communication if given else select_communication(
            communication, [devices_lib.device_type(d) for d in resolved],
            physical_gpus=devices_lib.physical_gpus_of(resolved))  # (Given: its class name.)
        if self.context_parallel > 1 and communication == "auto" \
                and self.communication == "reduce_to_one":
            self.communication = "ring"  # (A root device does not gather; collectives do.)
        bytes_per_pack = check_bytes_per_pack(bytes_per_pack, default=0)
        if bytes_per_pack and self.communication not in PACKING:
            raise ValueError(
                f"bytes_per_pack packs gradients for communication='ring' or "
                f"'halving_doubling', but this strategy uses {self.communication!r}. Pass one "
                f"of them or drop bytes_per_pack.")
        # Read by MirroredExtended when it makes its CollectiveKeys.
        tf_runtime.set_collective_key_base(self, group_keys.next_key_base())
        return _DataParallelExtended(self, resolved, self.communication, bytes_per_pack,
                                     self._given_cross_device_ops, self._collective_key_base,
                                     gathers=self.context_parallel > 1)

    def _install_keras_hooks(self):
        keras_hooks.install_crash_safe_backups()

    def _shard_collective_args(self, extended):
        return (sharding.collectives_for(self.communication),
                tf_runtime.collective_keys(extended), extended.worker_devices)

    def _join_workers(self):
        """Nothing to agree on with other workers on one host."""

    @property
    def cluster_resolver(self):
        """The cluster's resolver; on one host, that of the one-task cluster.

        As `tf.distribute.MultiWorkerMirroredStrategy` without TF_CONFIG (task type
        and id None), where a stock `MirroredStrategy` has None: programs written for
        several workers ask it who saves (`task_type in (None, "chief")`).
        """
        return self._dp_cluster_resolver

    @property
    def _tfpar_xla_unit(self):
        # jit_compile=True: each replica's model call compiled by XLA on its device
        # (`tfpar.keras.xla_calls`); the reductions stay outside it.
        return "replica" if self.context_parallel == 1 else None

    def _tfpar_xla_refusal(self, model):
        # Asked by the Keras seam before Keras compiles a step with jit_compile=True.
        if self.context_parallel > 1:
            return (f"DataParallelStrategy(context_parallel={self.context_parallel}) cannot "
                    f"train {model.name!r} with jit_compile=True: its attention exchanges "
                    f"keys and values across devices inside the model's call, which XLA "
                    f"cannot compile on CPUs. Compile with jit_compile=False.")
        return None

    def _tfpar_memory_config(self, optimizer_slots=2):
        # Read by tfpar.plan.estimate_memory.
        return plan_memory.MemoryConfig(
            "sharded" if self.shard else "data", self.num_replicas_in_sync, shard=self.shard,
            optimizer_slots=optimizer_slots,
            reshard_after_forward=self.reshard_after_forward or self._tfpar_shard_stage < 3,
            gradient_window_bytes=self._zero_bucket_bytes
            if zero_pacing.paces_gradients(self) else 0)

    def _tfpar_before_model_call(self, model, args, kwargs):
        # Asked by the Keras seam before a model made under this strategy runs.
        if (self.context_parallel > 1 and id(model) not in self._dp_context_prepared
                and not keras_models.any_symbolic_tensors(args, kwargs)):
            # (At its first run; not as a graph is built.)
            for layer, attribute, function in context_layers.prepare(model):
                keras_hooks.patch_object(layer, attribute, function)
            self._dp_context_prepared.add(id(model))
        if self.reshard_after_forward and id(model) not in self._dp_regathered_models:
            keras_sharded.regather_in_backward(model)
            self._dp_regathered_models.add(id(model))

    def memory_report(self, model, optimizer=None):
        """Bytes each replica's device holds for training `model` (a built model; after a
        step for the gradients of stages 2-3), as a `tfpar.plan.MemoryEstimate`, to
        compare with `tfpar.plan.estimate_memory(model, strategy)`. `optimizer`: the one
        a custom loop trains with (default: the compiled one). See
        `tfpar.distribute.common.device_memory` for what is measured."""
        devices = self.extended.worker_devices
        stage = self._tfpar_shard_stage
        sizes = [memory.num_bytes(v) for v in model.trainable_weights]
        shard = self._tfpar_step_shapes.gradient_bytes or max(self._tfpar_shard_owners.loads)
        gradients = [sum(sizes) if stage < 2 else shard] * len(devices)
        # Stage 3: the largest variable a replica reads from another owner.
        held = [memory.resident_bytes(self, [v], devices) for v in model.trainable_weights]
        gather = [max([size for size, on in zip(sizes, held) if not on[i]] + [0])
                  if stage == 3 else 0 for i in range(len(devices))]
        config = self._tfpar_memory_config(plan_memory.compiled_optimizer_slots(model))
        return memory.measure(self, model, optimizer or getattr(model, "optimizer", None),
                              config, devices, gradients, gather)

    @property
    def _tfpar_context_shards(self):
        # Read by the Keras seam's layers in a replica: the sequence is split over them.
        return self._dp_sequence_shards if self.context_parallel > 1 else None

    @functools.cached_property
    def _dp_sequence_shards(self):
        return sequence_split.SequenceShards(self.context_parallel)

    @property
    def _tfpar_compression(self):
        # Read by the Keras seam: the replicas' gradients summed in this type.
        return self.compression

    @property
    def _tfpar_sync_every(self):
        # Read by the Keras seam (tfpar.keras.local_steps): replicas step alone between
        # averagings.
        return self.sync_every

    @property
    def _tfpar_sync_optimizer_state(self):
        return self.sync_optimizer_state

    def _tfpar_average_replicas(self, variables):
        # Asked by the Keras seam in cross-replica context, every sync_every steps.
        return local_sgd.average_replicas(self, variables)

    def average_replicas(self, model, optimizer=None):
        """Under `sync_every=n`, sets every replica's weights (and, with
        `sync_optimizer_state=True`, `optimizer`'s state; default: the compiled one) to
        their mean over the replicas now: `fit` does it when it returns; a custom loop calls
        it after its last step, before saving. Nothing to do when n is 1."""
        local_steps.average_now(model, optimizer)

    def _options_repr(self):
        options = "".join(f", {name}={getattr(self, name)!r}"
                          for name in ("shard", "compression") if getattr(self, name))
        if self.context_parallel > 1:
            options += f", context_parallel={self.context_parallel}"
        if self.sync_every > 1:
            options += f", sync_every={self.sync_every}"
        return options

    def __repr__(self):
        return (f"DataParallelStrategy(replicas={self.num_replicas_in_sync}, "
                f"communication={self.communication!r}{self._options_repr()})")


@internals.overrides
class _DataParallelExtended(zero_owners.OwnerPlacedVariables, tf_runtime.mirrored_extended()):
    """MirroredExtended with tfpar's reduction choice and batch checks."""

    def __init__(self, container_strategy, devices, communication, bytes_per_pack,
                 given_ops=None, key_base=None, gathers=False):
        self._dp_communication = communication
        self._dp_gathers = gathers
        self._dp_bytes_per_pack = bytes_per_pack
        self._dp_key_base = key_base
        self._given_cross_device_ops = given_ops  # A user's cross_device_ops, used as given.
        super().__init__(container_strategy, devices=devices)

    def _initialize_strategy(self, devices):
        super()._initialize_strategy(devices)
        tf_runtime.set_cross_device_ops(
            self, self._given_cross_device_ops or make_cross_device_ops(
                self._dp_communication, tf_runtime.replica_devices(self),
                tf_runtime.collective_keys(self), self._dp_bytes_per_pack, self._dp_key_base,
                gathers=self._dp_gathers))

    def _experimental_distribute_dataset(self, dataset, options):
        context_parallel = self._container_strategy().context_parallel
        if context_parallel > 1:
            dataset = sequence_split.split_sequences(dataset, context_parallel)
        dataset = check_first_batch(dataset, len(tf_runtime.replica_devices(self)))
        return super()._experimental_distribute_dataset(dataset, options)

    def _zero_local_replicas(self):
        return tf_runtime.replica_devices(self), 0


class MultiWorkerDataParallelStrategy(DataParallelStrategy, tf.distribute.MultiWorkerMirroredStrategy):
    """DataParallelStrategy across workers; made by `DataParallelStrategy()` in a cluster.

    It is also a `tf.distribute.MultiWorkerMirroredStrategy`, so Keras takes its
    multi-worker paths (gathering predictions across workers, for example).
    """

    _tfpar_multi_worker = True
    # Read by the Keras seam: optimizer updates one variable after another, so that a
    # worker holds one update's temporaries at a time (`tfpar.keras.replicas`): its peak on
    # the 100.7M MLP fell from 1,568-1,585 to 1,248-1,264 MiB. (On one host, measured with
    # 8 Dense(1024) layers on 2 logical CPUs, it rose from 204 to 304 MiB: the all-reduced
    # gradients waited for their turn. Not used there.)
    _tfpar_updates_in_turn = True

    @property
    def _tfpar_gathers_parameters(self):
        # Stage 3: a replica reads another worker's variables through collectives.
        return self._tfpar_shard_stage == 3

    def _build_extended(self, devices, communication, bytes_per_pack, timeout_seconds):
        if devices is not None:
            raise DeviceError(
                "devices cannot be chosen across workers: each worker uses all its GPUs, or "
                "its CPU. Pass devices=None.")
        # The GPUs this worker's replicas will use: visible ones, split as configured.
        gpus = devices_lib.logical_gpu_owners()
        self.communication = select_communication(
            communication, ["GPU"] * len(gpus) or ["CPU"], multi_worker=True,
            physical_gpus=gpus)
        self.timeout_seconds = multi_worker.collective_timeout(timeout_seconds)
        self._worker_options = tf_runtime.collective_options(
            bytes_per_pack=check_bytes_per_pack(bytes_per_pack,
                                                multi_worker.MULTI_WORKER_PACK_BYTES),
            timeout_seconds=None if self.timeout_seconds == math.inf else self.timeout_seconds,
            implementation=multi_worker.implementation(self.communication))
        tf_runtime.set_collective_key_base(self, group_keys.next_key_base(across_workers=True))
        extended = multi_worker.MultiWorkerExtended(
            self, cluster_resolver=self._dp_cluster_resolver,
            communication_options=self._worker_options)
        replicas = tf_runtime.num_replicas_in_sync(extended)
        install_launchers(
            tf_runtime.cross_device_ops(extended), replicas,
            tf_runtime.collective_keys(extended), self._worker_options,
            tf_runtime.first_local_replica(extended),
            routed_all_reduce(self.communication, replicas, self._collective_key_base,
                              multi_worker.hosts_of_replicas(self._dp_cluster_resolver,
                                                             replicas)))
        return extended

    def _install_keras_hooks(self):
        keras_hooks.install_multi_worker_callbacks()
        keras_hooks.install_cluster_error_explanation()

    def _shard_collective_args(self, extended):
        return (sharding.collectives_for(
                    self.communication, across_workers=True,
                    pair_groups=group_keys.pairs_fit(self.num_replicas_in_sync)),
                tf_runtime.collective_keys(extended), extended.worker_devices,
                self._worker_options.timeout_seconds, self._collective_key_base)

    def _join_workers(self):
        """Every worker made the same strategy (checked through the cluster)."""
        self._dp_peers = multi_worker.Peers(self._dp_cluster_resolver)
        self._dp_datasets = 0  # Made by distribute_datasets_from_function, numbered alike.
        self._dp_backups = 0  # Backups resumed from (sharded), numbered alike.
        self._dp_saves = 0  # Sharded weights written by their owners, numbered alike.
        rendezvous.check_same_strategies(
            self._dp_peers, group_keys.cluster_index(self._collective_key_base),
            f"{self!r} bytes_per_pack={self._worker_options.bytes_per_pack}/"
            f"{self._zero_bucket_bytes}", self._dp_check_seconds)

    @property
    def _dp_check_seconds(self):
        # How long a worker waits for the others to make the same strategy or dataset.
        return min(self.timeout_seconds, multi_worker.STRATEGY_CHECK_SECONDS)

    @property
    def _tfpar_every_worker_saves(self):
        # Read by the Keras seam: saving sharded state gathers it from every worker.
        return bool(self._tfpar_shard_stage)

    def _tfpar_check_backup_everywhere(self, path):
        # Asked by the Keras seam before a sharded run resumes from a backup.
        self._dp_backups += 1
        rendezvous.check_backup_everywhere(self._dp_peers, f"backup/{self._dp_backups}",
                                           path, self._dp_check_seconds)

    def _tfpar_owner_checkpoint(self):
        # Asked by the Keras seam when a model is saved in Keras' sharded format: under
        # shard=... each worker writes the state it owns.
        if not self._tfpar_shard_stage:
            return None
        self._dp_saves += 1
        return owner_checkpoint.OwnerCheckpoint(self, self._dp_peers, self._dp_check_seconds,
                                                self._dp_saves)

    @property
    def _tfpar_held_elsewhere(self):
        # Asked by the Keras seam when a model loads Keras' sharded weights: a weight held
        # by another worker's replica (stage 3) is not read.
        if not self._tfpar_shard_stage:
            return None
        return owner_checkpoint.held_elsewhere(self._tfpar_shard_owners)

    def _tfpar_broadcast_from_chief(self, variables):
        # Asked by the Keras seam when BackupAndRestore resumes: the chief restored.
        owner_values.broadcast_from_first_replica(self, variables)

    def _tfpar_explain_timeout(self, error):
        # Asked by the Keras seam when fit, evaluate or predict ends with a timed-out collective.
        return rendezvous.explain_timeout(error, self._dp_peers, self.timeout_seconds)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """As stock; workers whose datasets differ in length finish an epoch together."""
        self._dp_datasets += 1
        key = f"dataset/{self._dp_datasets}"

        def longest_of_all(length):
            return rendezvous.longest(self._dp_peers, key, length,
                                      self._dp_check_seconds)
        return super().distribute_datasets_from_function(
            multi_worker.joined(dataset_fn, longest_of_all), options)

    def reduce(self, reduce_op, value, axis):
        # Keras' multi-worker path reduces scalar step outputs (loss, metrics) with
        # axis=0, which fails on a scalar; the mean over replicas is what it means.
        if axis is not None and multi_worker.rank(value) == 0:
            axis = None
        return super().reduce(reduce_op, value, axis)

    def __repr__(self):
        workers = tf_runtime.num_workers(self.extended)
        return (f"DataParallelStrategy(workers={workers}, "
                f"replicas={self.num_replicas_in_sync}, communication={self.communication!r}"
                f"{self._options_repr()})")
