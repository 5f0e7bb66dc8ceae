"""Pipeline parallelism: micro-batches flowing through a model cut into stages.

How it works:

- *Stages.* When a model created under the scope first runs (or its weights are
  first read or written), it is cut into K contiguous stages
  (`tfpar.keras.pipeline_stages`): at `tfpar.layers.StageBoundary` markers, or into groups
  of about equal parameter count. Until then its layers' variables have a shape
  and no storage; each gets its storage on its stage's device, one copy per
  replica (`tfpar.distribute.common.layer_placement`): none is created on another device
  of the strategy first. Optimizer state is created next to its variable, and
  updates run there.
- *Training.* Keras' `fit`/`train_on_batch` call `model.train_step`; the Keras seam
  (`keras_hooks.install_train_step_hook`) hands it to this strategy, which splits
  the batch into M micro-batches and builds the schedule's forward and backward
  actions in order (`pipeline_exec.TrainStep`), sums the gradients over
  micro-batches and applies them once with the model's optimizer.
- *Evaluation, prediction, custom loops.* The placed model's `call` runs the
  micro-batches through the stages (forward only, each stage in order on its
  device); under a gradient tape each stage's backward runs on its device too.
- *Replicas.* With `num_replicas=R` the strategy is a mirrored strategy of R
  replicas; replica r runs its pipeline on devices[r*K:(r+1)*K] on B/R of the batch.
  Every variable has one copy per replica, on the device of its stage in that
  replica. The optimizer all-reduces each variable's gradient across its R copies
  with cross-device ops chosen for those R devices (NCCL when they are GPUs,
  `select_communication`), and applies the same update to every copy.
- *Stages on other processes.* With `cluster_resolver` the chief connects to a TF_CONFIG
  cluster and stages go on the worker tasks' devices (`tfpar.distribute.pipeline.workers`):
  the step is still one function, cut by TensorFlow into one part per task; activations
  and gradients go from worker to worker. A lost stage worker ends `fit` with a
  `ClusterError` that names it.
- *Saving.* Nothing of the pipeline is saved: `model.save` and checkpoints write a
  plain Keras model (one copy of each variable) that loads anywhere.

Limits: subclassed models have no graph to cut and are refused; a model whose
class overrides `train_step` is refused by `fit` with a clear error (put custom
loss logic in `compute_loss`, which is pipelined); `jit_compile=True` is refused;
masked mean losses with M > 1 are refused. BatchNorm computes its statistics per
micro-batch (as GPipe does); each micro-batch updates the moving statistics (with R
replicas, by the mean over replicas).
"""

# tfpar's own private attributes (_tfpar_*) on Keras objects.
# pylint: disable=protected-access

import contextlib
import threading
import types

import tensorflow as tf

from tfpar import devices as devices_lib
from tfpar.distribute.common import group_keys
from tfpar.distribute.common import layer_timing
from tfpar.distribute.common.cross_device import make_cross_device_ops
from tfpar.distribute.common.layer_placement import PlacingStrategy, claim_model, mark_placed
from tfpar.distribute.common.placed_call import canonical_device
from tfpar.distribute.pipeline import execution as pipeline_exec
from tfpar.distribute.pipeline import mirrored_placement
from tfpar.distribute.pipeline import pipeline_reports
from tfpar.distribute.pipeline import tensor_groups
from tfpar.distribute.pipeline import tensor_parallel as tensor_parallel_lib
from tfpar.distribute.pipeline.pipeline_config import PipelineConfig
from tfpar.distribute.pipeline.pipeline_extended import _PipelineExtended
from tfpar.distribute.pipeline.weight_versions import WeightVersions
from tfpar.distribute.zero import zero_collectives, zero_sharding as sharded
from tfpar.keras import hooks as keras_hooks
from tfpar.keras import models
from tfpar.keras import pipeline_stages
from tfpar.keras import steps
from tfpar.keras import tf_runtime
from tfpar.keras import variable_birth
from tfpar.keras.replicas import own_loss_normalization, replica_id, xla_refusal
from tfpar.plan import memory as plan_memory
from tfpar.plan import schedule as schedule_lib
from tfpar.plan import sharding
from tfpar.plan.communication import MULTI_WORKER, check_compression


class PipelineStrategy(sharded.ZeroHooks, PlacingStrategy, tf.distribute.MirroredStrategy):
    """Trains a Keras model cut into stages, with micro-batches in a pipeline.

    The model (Sequential or functional) is cut into K stages on K devices; each
    batch is split into M micro-batches that flow through the stages so that the
    devices work at the same time. Gradients are summed over the micro-batches
    (they equal those of the whole batch) and applied once. With R pipeline
    replicas on R x K devices, each stage's gradients are all-reduced across its R
    copies (NCCL on GPUs).

    Args:
      devices: device names, R x K of them: replica r uses devices[r*K:(r+1)*K].
        None: all GPUs, or all logical CPUs without GPUs.
      num_micro_batches: M, micro-batches per batch (per pipeline replica).
      schedule: "gpipe" (all forwards, then all backwards), "1f1b" (one forward
        one backward: at most K micro-batches in flight per stage), "interleaved_1f1b"
        (Megatron's: `virtual_stages` chunks per device, the bubble divided by them),
        "zero_bubble_h1" (backwards split into input and weight gradients, the weight
        part filling the bubble), "2bw" (1F1B with PipeDream-2BW's two weight versions:
        each step's gradients are computed on the weights before the previous update and
        applied to the latest ones, W(t+1) = W(t) - lr * g(W(t-1))), or a
        `tfpar.plan.schedule.Schedule` of your own (validated by a dry run before it runs).
      remat: recompute each stage's activations in its backward instead of
        keeping them (GPipe's rematerialization).
      offload_activations: with remat, where each stage keeps its micro-batches' inputs
        between their forward and backward (what remat keeps): False, on the stage's
        device; True, in the host memory of the stage's task (its CPU:0: for a GPU stage,
        off the GPU; for a CPU stage, the same memory); or a device name, e.g. the chief's
        CPU for stages on worker processes. Each input is copied there after its forward
        and fetched back when its backward starts (DeepSpeed's CPU checkpointing).
      num_replicas: R, pipeline replicas (data parallelism over pipelines).
      shard: ZeRO over each stage's R replicas (DeepSpeed's pipeline with ZeRO; needs
        R >= 2). None: every copy of a stage keeps all its state. "optimizer" (stage 1):
        each variable of a stage has one owner among the stage's R devices
        (`tfpar.plan.sharding`, even bytes per stage), which alone keeps its optimizer
        state, sums its gradient (on its device) and updates it; the updated values are
        copied into the other copies. "gradients" (stage 2): also, each device keeps only
        its own variables' reduced gradients. "parameters" (stage 3): also, each variable
        lives on its owner only, and each of the stage's devices reads the stage's weights
        from their owners once per step, a copy every micro-batch reads (kept for the
        step, as `DataParallelStrategy(reshard_after_forward=False)`). Checkpoints hold
        full state.
      num_stages: K; None: len(devices) / num_replicas. With
        `tfpar.layers.StageBoundary` markers the model must make K stages (K x v).
      virtual_stages: v, model chunks per device (interleaved schedules): the model is
        cut into K x v chunks, chunk c on stage c % K.
      balance_by: what the cut evens out between stages (without StageBoundary
        markers): "params" (parameters, frozen ones included) or "time" (each layer's
        forward and backward timed on one micro-batch, the first layer without the input
        gradient it never sends; on a CPU the strategy does not use).
      cluster_resolver: stages on other processes: a `tf.distribute.cluster_resolver`
        (e.g. `TFConfigClusterResolver()`) of a cluster whose worker tasks serve
        (`python -m tfpar.cluster.server`, started by `tfpar launch --workers N --coordinator`)
        while this process, the chief, runs the program. The strategy connects to the
        cluster (TensorFlow's remote eager runtime); with `devices=None` it puts one stage
        on each worker task (its first GPU, else its CPU:0), in task order. `devices` may
        also name other tasks' devices ('/job:worker/replica:0/task:1/device:CPU:0'), as
        they may after you connect yourself (`tf.config.experimental_connect_to_cluster`).
        With R > 1 replicas across processes, this process needs R logical CPUs
        (`tfpar.virtual_cpus(R)`): each feeds one replica. A stage worker that dies ends `fit`, `evaluate` or
        `predict` with a `ClusterError` naming it; rerun with
        `keras.callbacks.BackupAndRestore` to resume.
      tensor_parallel: T, the devices each stage is split over (Megatron's tensor
        parallelism inside a stage; `tfpar.distribute.pipeline.tensor_parallel`). The
        devices are then R x K x T, replica-major, then stage: stage s of replica r on
        `devices[(r*K + s)*T:][:T]`. Needs `layout_map`; not yet with cluster_resolver,
        balance_by="time" or schedule="2bw". With num_replicas and shard, each shard's
        state is divided over its R copies as any stage variable's (Megatron x DeepSpeed).
      layout_map: with tensor_parallel, a `keras.distribution.LayoutMap`, as written for
        `keras.distribution.ModelParallel`: a Dense kernel laid out (None, "model") is split
        by columns (its bias follows), ("model", None) by rows; an EinsumDense kernel by
        columns along a split output axis, by rows along a split contracted one. Its device mesh, if any,
        must agree on the "data", "pipe" and "model" axes' sizes (R, K, T).
      compression: "fp16" or "bf16": the replicas' gradient sums (each stage's over its R
        copies) made in that type, as `DataParallelStrategy(compression=...)` makes them
        (with shard="optimizer" or "gradients" too). None: full precision.
      connect_timeout_seconds: how long the workers get to start listening.
      stage_timeout_seconds: with stages on other processes, how long a stage worker may
        stay silent (its gRPC server not answering: stopped, hung, or cut off) during
        `fit`, `evaluate` or `predict` before a message names it and this process is
        ended (SIGTERM): TensorFlow would wait for it without end. None: wait.

    Raises:
      ScheduleError: `num_micro_batches` < 1, an unknown `schedule`, or a `Schedule`
        that does not fit or fails its dry run (the message shows where).
      DeviceError: bad devices, R x K is not the number of devices, or R > 1 with
        devices of other processes.
      TFConfigError: with `cluster_resolver`, a cluster without workers, or this process
        is not its chief.
      ClusterError: with `cluster_resolver`, a worker does not listen within
        `connect_timeout_seconds`.
      ValueError: `layout_map` without `tensor_parallel` > 1 or the reverse, a layout map
        whose mesh disagrees with R, K or T, or tensor parallelism with what it does not
        run with yet. (A layout it cannot run is a PlacementError when the model is placed,
        naming the layer and the key.)

    Examples:
      >>> import keras, numpy as np, tfpar
      >>> strategy = tfpar.PipelineStrategy(["/cpu:0", "/cpu:1"], num_micro_batches=4)
      >>> with strategy.scope():
      ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
      ...                               keras.layers.Dense(3)])
      ...     model.compile("sgd", "mse")
      >>> _ = model.fit(np.zeros((16, 4)), np.zeros((16, 3)), batch_size=8, verbose=0)
      >>> print(strategy.schedule_table())  # doctest: +SKIP

      Two stages, each split over 2 devices (a Megatron MLP per stage):

      >>> layout_map = keras.distribution.LayoutMap(None)
      >>> layout_map[".*mlp_in/kernel"] = (None, "model")   # column
      >>> layout_map[".*mlp_out/kernel"] = ("model", None)  # row
      >>> strategy = tfpar.PipelineStrategy(["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"],
      ...                                   num_stages=2, tensor_parallel=2,
      ...                                   layout_map=layout_map, num_micro_batches=2)
      >>> with strategy.scope():
      ...     model = keras.Sequential([
      ...         keras.Input((4,)), keras.layers.Dense(8, name="embed"),
      ...         keras.layers.Dense(32, activation="relu", name="mlp_in"),
      ...         keras.layers.Dense(8, name="mlp_out"), tfpar.layers.StageBoundary(name="cut"),
      ...         keras.layers.Dense(3, name="head")])
      ...     model.compile("adam", "mse")
      >>> _ = model.fit(np.zeros((16, 4)), np.zeros((16, 3)), batch_size=8, verbose=0)
      >>> strategy.stages(model)
      [['embed', 'mlp_in', 'mlp_out'], ['cut', 'head']]
      >>> [tuple(w.shape) for w in model.get_layer("mlp_in").weights]  # Whole, for Keras.
      [(8, 32), (32,)]

      One stage per worker process (`tfpar launch --workers 2 --coordinator -- python
      train.py`, train.py running on the chief):

      >>> import tensorflow as tf
      >>> resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()  # doctest: +SKIP
      >>> strategy = tfpar.PipelineStrategy(num_micro_batches=4,  # doctest: +SKIP
      ...                                   cluster_resolver=resolver)
      >>> strategy.stage_devices  # doctest: +SKIP
      (('/job:worker/replica:0/task:0/device:CPU:0', '/job:worker/replica:0/task:1/device:CPU:0'),)
    """

    # Read by the Keras seam (tfpar.keras.replicas): evaluate's losses normalized over the
    # global batch, BatchNorm statistics averaged over pipeline replicas, gradient
    # accumulation. The train step weighs its micro-batches itself.
    _tfpar_exact_replicas = True
    _tfpar_mirrored = True

    def __init__(self, devices=None, num_micro_batches=4, schedule="gpipe", remat=False,
                 num_replicas=1, num_stages=None, virtual_stages=1, balance_by="params",
                 cluster_resolver=None, connect_timeout_seconds=60.0,
                 stage_timeout_seconds=120.0, offload_activations=False, shard=None,
                 tensor_parallel=1, layout_map=None, compression=None):
        config = PipelineConfig.resolve(
            devices=devices, num_micro_batches=num_micro_batches, schedule=schedule,
            remat=remat, num_replicas=num_replicas, num_stages=num_stages,
            virtual_stages=virtual_stages, balance_by=balance_by,
            cluster_resolver=cluster_resolver, connect_timeout_seconds=connect_timeout_seconds,
            stage_timeout_seconds=stage_timeout_seconds,
            offload_activations=offload_activations, shard=shard,
            tensor_parallel=tensor_parallel, layout_map=layout_map)
        self.shard, self._tfpar_shard_stage = config.shard, config.shard_stage
        self.compression = check_compression(compression, config.shard)
        self._schedule, self._remat, self._offload = (
            config.schedule, config.remat, config.offload_activations)
        self._balance_by, self._timing_device = config.balance_by, config.timing_device
        self._micro_batch_rows = None  # Timing's micro-batch: the first batch's, else 32.
        # The cluster's tasks when stages are on other processes, else None.
        self._workers, self._stage_timeout_seconds = config.workers, config.stage_timeout_seconds
        self._tensor_parallel, self._layout_map = config.tensor_parallel, config.layout_map
        self._grid, self._tp_grid, self._display = config.grid, config.tp_grid, config.display
        self._default_home = tuple(row[0] for row in self._grid)  # Metrics, the optimizer's.
        self._lock = threading.RLock()
        self._tp_substitutes = {}  # id(split variable) -> its shards.
        self._tp_reductions = {}  # T devices of several processes -> their CrossDeviceOps.
        self._tensor_groups = {}  # A stage's T devices -> their TensorGroup.
        # Read by MirroredExtended.
        self._key_base = group_keys.next_key_base()
        tf_runtime.set_collective_key_base(self, self._key_base)
        # What MirroredStrategy.__init__ does, with this strategy's extended for its own.
        tf.distribute.Strategy.__init__(self, _PipelineExtended(
            self, self._grid, config.reduction_grid, config.replica_devices))
        # ZeRO over each stage's replicas: owners even out bytes per stage (the devices of
        # a variable's copies); each gradient summed on its owner's device, each updated
        # weight copied from there (this program drives every stage device).
        self._zero_bucket_bytes = sharding.DEFAULT_BUCKET_BYTES
        sharded.set_up(self, config.num_replicas,
                       lambda: zero_collectives.ShardCollectives("placed"),
                       group_of=mirrored_placement.devices_of)
        self._install_keras_hooks()

    def _install_keras_hooks(self):
        keras_hooks.install_variable_births()
        keras_hooks.install_model_call_hook()
        keras_hooks.install_train_step_hook()
        keras_hooks.install_exact_replicas()
        keras_hooks.install_crash_safe_backups()
        if self._workers is not None:
            keras_hooks.install_cluster_error_explanation()

    def __repr__(self):
        virtual = self._schedule.virtual_stages
        return (f"PipelineStrategy(stages={self.num_stages}, micro_batches="
                f"{self.num_micro_batches}, schedule={self._schedule.name!r}, "
                f"{f'virtual_stages={virtual}, ' if virtual > 1 else ''}"
                f"remat={self._remat}, "
                f"{f'offload_activations={self._offload!r}, ' if self._offload else ''}"
                f"replicas={len(self._grid)}{f', shard={self.shard!r}' if self.shard else ''}"
                f"{f', compression={self.compression!r}' if self.compression else ''}"
                f"{f', tensor_parallel={self._tensor_parallel}' if self._tensor_parallel > 1 else ''})")

    @property
    def num_stages(self):
        """K, the stages each pipeline replica is cut into."""
        return self._schedule.num_stages

    @property
    def num_micro_batches(self):
        """M, the micro-batches each replica's batch is split into."""
        return self._schedule.num_micro_batches

    @property
    def schedule(self):
        """The validated `tfpar.plan.schedule.Schedule` every step runs."""
        return self._schedule

    @property
    def stage_devices(self):
        """`stage_devices[r][s]`: the device of stage s in pipeline replica r (canonical)."""
        return self._grid

    @property
    def tensor_parallel(self):
        """T, the devices each stage is split over (1: no tensor parallelism)."""
        return self._tensor_parallel

    @property
    def tensor_parallel_devices(self):
        """`tensor_parallel_devices[r][s]`: the T devices of stage s in pipeline replica r
        (canonical); the first is `stage_devices[r][s]`."""
        return self._tp_grid

    def chunk_devices(self, replica=0):
        """The device of each model chunk in pipeline replica `replica` (one chunk per
        stage, or `virtual_stages` per stage, chunk c on stage c % K)."""
        row = self._grid[replica]
        return [row[self._schedule.rank_of(c)] for c in range(self._schedule.num_chunks)]

    @property
    def communication(self):
        """{stage: the all-reduce its gradients use across replicas} ("nccl" on GPUs; "ring"
        across processes on CPUs)."""
        return self.extended.stage_communication

    @property
    def tensor_communication(self):
        """How each tensor-parallel group sums in a traced step (`tensor_communication[r][s]`:
        replica r's stage s): "all_reduce" (the stage runs replicated, its sums all-reduced
        by peer collectives: NCCL on GPUs, a ring on CPUs, in one process or across
        processes)."""
        return [["all_reduce"] * len(row) for row in self._tp_grid]

    def _tfpar_memory_config(self, optimizer_slots=2):
        # Read by tfpar.plan.estimate_memory (which cuts the variables into balanced
        # stages: the model's own cut when its layers weigh alike).
        if self._tensor_parallel > 1:
            raise NotImplementedError(
                f"tfpar.plan.estimate_memory does not plan a tensor-parallel pipeline yet "
                f"(tensor_parallel={self._tensor_parallel}: its split layers' bytes are "
                f"divided over each stage's devices, the rest is not). Estimate the pipeline "
                f"without it and divide the split layers' share by {self._tensor_parallel}.")
        return plan_memory.MemoryConfig(
            "pipeline", self.num_stages, shard=self.shard, optimizer_slots=optimizer_slots,
            num_replicas=len(self._grid), reshard_after_forward=False)

    def memory_report(self, model, optimizer=None):
        """Bytes each device holds for training `model` (placing it now if it was not yet),
        as a `tfpar.plan.MemoryEstimate` whose devices are `stage_devices` in order
        (replica r's stage s at r * K + s), to compare with
        `tfpar.plan.estimate_memory(model, strategy)`. Weights and optimizer state: the
        variables resident on each device. Gradients: each stage's variables' on each of its
        devices, their owner's only under shard="gradients" and "parameters". Gather
        (shard="parameters"): the stage's variables a device reads from other owners, all
        kept from the forward to the backward pass. `optimizer`: the one a custom loop
        trains with (default: the compiled one)."""
        return pipeline_reports.memory_report(self, model, optimizer)

    def schedule_table(self):
        """The schedule as a time-step x stage grid (e.g. `1F0`), with its bubble fraction."""
        return schedule_lib.format_table(self._schedule)

    def stages(self, model):
        """The layer names of each stage of `model` (placing it now if it was not yet)."""
        self._place(model)
        return [stage.layer_names for stage in model._tfpar_pipeline.stages]

    def trace(self, path, model, x, y=None, sample_weight=None, warmup_steps=1,
              profilers=None):
        """Profiles a real training step of `model` on one batch; writes its timeline.

        Runs `warmup_steps` steps (at least 1: the first one builds the step), then
        one under TensorFlow's profiler, and times each action (e.g. `1F0`) on its
        device from its ops. Writes a Chrome trace to `path` (open it in
        chrome://tracing or Perfetto) and a picture next to it (`path` with a `.png`
        suffix). The model trains on the batch, as with `model.train_on_batch`.

        Stages on other tasks (worker processes) are recorded by their own profilers:
        serve each with `python -m tfpar.cluster.server --profiler_port=P` and pass
        `profilers={"worker:1": "host:P"}`.

        Returns:
          The Chrome trace events (a list of dicts).
        """
        return pipeline_reports.trace(self, path, model, x, y, sample_weight,
                                      warmup_steps, profilers)

    def _name(self, canonical):
        return self._display.get(canonical, canonical)

    def _tfpar_watching(self):
        # Entered by the Keras seam around fit, evaluate and predict.
        if self._workers is None:
            return contextlib.nullcontext()
        return self._workers.watching([d for row in self._grid for d in row],
                                      self._stage_timeout_seconds)

    def _tfpar_explain_lost_task(self, error):
        # Asked by the Keras seam when fit, evaluate or predict ends with a TensorFlow error.
        if self._workers is None:
            return None
        return self._workers.explain(error, [d for row in self._grid for d in row])

    # -- Placement ---------------------------------------------------------------------

    def _known_home(self, layer):
        # Stages come from the whole graph (balanced cuts, or markers whose cuts are checked
        # there): a layer's variables get their storage when the model is placed.
        return None

    def _place(self, model):
        with self._lock:
            if not claim_model(
                    self, model, getattr(model, "_tfpar_pipeline", None) is not None,
                    "it cannot be cut into stages"):
                return
            program = pipeline_stages.build_program(
                model, self._schedule.num_chunks,
                self._time_layer if self._balance_by == "time" else None)
            planned = (tensor_parallel_lib.plan_layers(program, self._layout_map,
                                                       self._tensor_parallel)
                       if self._tensor_parallel > 1 else {})  # Refusals, before any storage.
            with tf.init_scope(), self._creating_variables():
                if planned:
                    program.stages = tensor_parallel_lib.split_program(
                        program, planned, self._shard_homes, self._split_devices,
                        self._tensor_group)
                    self._tp_substitutes.update(program.substitutes)
                for stage in program.stages:
                    devices = [row[self._schedule.rank_of(stage.index)] for row in self._grid]
                    for variable in stage.placed_variables:
                        mirrored_placement.move_copies(variable, devices)
                for variables, device in pipeline_stages.pinned_variables(program):
                    for variable in variables:
                        mirrored_placement.move_copies(variable, [device] * len(self._grid))
                self.extended.follow_colocated(getattr(model, "optimizer", None))
            object.__setattr__(model, "_tfpar_pipeline", program)
            object.__setattr__(model, "_tfpar_original_call", model.call)
            keras_hooks.patch_object(model, "call", types.MethodType(_pipelined_call, model))
            mark_placed(self, model)

    def _shard_homes(self, chunk):
        """For each of chunk's T devices, its device in every replica."""
        rank = self._schedule.rank_of(chunk)
        return [[row[rank][t] for row in self._tp_grid] for t in range(self._tensor_parallel)]

    def _split_devices(self, chunk):
        """(This replica's T devices of `chunk`, how their reductions run); asked while a
        step is built."""
        devices = self._tp_grid[replica_id()][self._schedule.rank_of(chunk)]
        communication = tensor_parallel_lib.communication_of(devices)
        if communication in MULTI_WORKER and devices_lib.spans_tasks(devices):
            # Peer collectives: one CrossDeviceOps per group, its keys the strategy's.
            if devices not in self._tp_reductions:
                self._tp_reductions[devices] = make_cross_device_ops(
                    communication, devices, tf_runtime.collective_keys(self.extended))
            return devices, self._tp_reductions[devices]
        return devices, communication

    @property
    def _tfpar_compression(self):
        # Read by the Keras seam: the replicas' gradients summed in this type.
        return self.compression

    def _tensor_group(self, devices):
        """The peer collectives of a stage's T `devices` in one replica (made once)."""
        devices = tuple(devices)
        with self._lock:
            if devices not in self._tensor_groups:
                index = [tuple(d) for row in self._tp_grid for d in row].index(devices)
                self._tensor_groups[devices] = tensor_groups.TensorGroup(
                    devices, tensor_groups.group_key_of(self._key_base, index))
            return self._tensor_groups[devices]

    def _tfpar_optimizer_variables(self, variables):
        # Asked by the Keras seam when an optimizer is built: split variables are trained
        # as their shards (placing their model first, which makes them).
        if self._tensor_parallel == 1:
            return variables
        for variable in variables:
            self._tfpar_first_use(variable)  # (Nothing unless it is pending.)
        return [s for v in variables for s in self._tp_substitutes.get(id(v), (v,))]

    def _tfpar_clip_groups(self, variables):
        # Asked by the Keras seam when an optimizer clips: a split variable's shards are
        # clipped by their joint norm, the variable's (clipnorm).
        if self._tensor_parallel == 1:
            return None
        position = {id(v): i for i, v in enumerate(variables)}
        groups = [[position[id(s)] for s in shards if id(s) in position]
                  for shards in self._tp_substitutes.values()]
        return [g for g in groups if len(g) > 1] or None

    def _time_layer(self, layer, first):
        """Seconds of `layer`'s forward and backward on one micro-batch (with the input
        gradient unless it is the model's first layer), timed on a CPU the strategy does
        not use; its variables get their storage there, and move once when placed."""
        with tf.init_scope(), self._creating_variables():
            for variable in layer.variables:
                if variable_birth.has_no_storage(variable):
                    variable_birth.materialize(variable, [self._timing_device] * len(self._grid))
        return layer_timing.layer_seconds(layer, self._micro_batch_rows or 32,
                                          self._timing_device, input_gradient=not first)

    def _tfpar_xla_refusal(self, model):
        # Asked by the Keras seam before Keras compiles a step with jit_compile=True.
        return xla_refusal(model, "PipelineStrategy", "its stages run",
                           len({d for row in self._grid for d in row}))

    def _tfpar_step_refusal(self, model, step_function):
        # Asked by the Keras seam before Keras builds a train/test/predict step.
        if getattr(step_function, "__name__", "") != "train_step":
            return None
        if steps.is_keras_train_step(type(model).train_step):
            return None  # Keras' step, which the seam hands to this strategy.
        return (f"PipelineStrategy builds the training step of {model.name!r} itself (micro-"
                f"batches in schedule order), but {type(model).__name__} overrides train_step, "
                f"which would run outside the schedule (no interleaved forward and backward "
                f"passes). Move the custom logic into compute_loss (pipelined, with "
                f"self.compute_loss semantics) and drop the train_step override, or train "
                f"it with tfpar.ModelParallelStrategy.")

    # -- Training (called by the Keras seam for model.train_step) -----------------------

    def _tfpar_train_step(self, model, data):
        if self._micro_batch_rows is None:  # Known now, for balance_by="time".
            first = next((t for t in tf.nest.flatten(data) if isinstance(t, tf.Tensor)), None)
            if first is not None and first.shape.rank and first.shape[0] is not None:
                self._micro_batch_rows = max(1, int(first.shape[0]) // self.num_micro_batches)
        self._place(model)
        replica = replica_id()
        x, y, sample_weight = steps.unpack_x_y_sample_weight(data)
        devices = self.chunk_devices(replica)
        # Stage 3: each replica reads a stage's weights from their owners once per step, not
        # in every micro-batch. (Split variables under tensor parallelism: per micro-batch.)
        step = pipeline_exec.TrainStep(model, model._tfpar_pipeline, devices,
                                       self._schedule, self._remat, replica, len(self._grid),
                                       offload_devices=self._offload_devices(devices),
                                       copy_weights_once=(self._tfpar_shard_stage == 3
                                                          and self._tensor_parallel == 1),
                                       input_device=self.extended.worker_devices[replica])
        versions = self._weight_versions(model)
        if versions is not None:
            versions.use_older(model.optimizer.iterations)
        with own_loss_normalization():
            loss, y_pred, grads = step(x, y, sample_weight)
        # The replicas' losses add up to the global batch's (their shares are global);
        # the seam reports their sum.
        steps.track_loss(model, loss, x)
        if versions is not None:
            with tf.control_dependencies(pipeline_exec.tensors_of(grads)):
                versions.use_current()
        if model.trainable_weights:
            model.optimizer.apply_gradients(zip(
                grads, model._tfpar_pipeline.optimizer_variables(model.trainable_weights)))
        if versions is not None:
            versions.mark_saved(model.optimizer.iterations)
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _offload_devices(self, devices):
        """Where each chunk on `devices` keeps its inputs for the backward, or None."""
        if not self._offload:
            return None
        if self._offload is True:
            return [devices_lib.host_of(d) for d in devices]
        return [canonical_device(self._offload)] * len(devices)

    def _weight_versions(self, model):
        """PipeDream-2BW's older weights of `model` (None unless the schedule has two
        weight versions), made on the first step."""
        if self._schedule.weight_versions == 1 or not model.trainable_weights:
            return None
        versions = getattr(model, "_tfpar_weight_versions", None)
        if versions is None or not versions.covers(model.trainable_weights):
            versions = WeightVersions(model.trainable_weights)
            object.__setattr__(model, "_tfpar_weight_versions", versions)
        return versions


def _pipelined_call(model, inputs, training=None, mask=None, **kwargs):
    """The placed model's `call`: micro-batches through the stages (forward)."""
    if (mask is not None or kwargs or models.in_symbolic_scope()
            or models.any_symbolic_tensors((inputs,))):
        return model._tfpar_original_call(inputs, training=training, mask=mask, **kwargs)
    strategy = model._tfpar_placed_by
    if strategy.tensor_parallel > 1 and tf_runtime.tape_recording():
        raise ValueError(
            f"{model.name!r} was called under a GradientTape (a custom training loop) on a "
            f"tensor-parallel pipeline, which trains its split layers' shards, not the "
            f"whole variables a custom loop would differentiate. Train it with model.fit "
            f"(or train_on_batch), or use tensor_parallel=1 for custom loops.")
    replica = replica_id()
    return pipeline_exec.forward(model._tfpar_pipeline, strategy.chunk_devices(replica),
                                 strategy.num_micro_batches, inputs, training)

