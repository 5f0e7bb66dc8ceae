"""What the Keras seam asks of a strategy: every hook, with what it means and its default.

tfpar's strategies inherit `StrategyHooks` and override the hooks they need; any other
strategy (stock `tf.distribute`, or none) answers with the defaults. The seam and the
planner read hooks only through `hooks_of(strategy)`, so a misspelt hook is an
AttributeError, not a behaviour silently turned off (`tests/test_contract.py` checks that
every hook a strategy defines, and every hook the seam reads, is declared here).
Plain Python: the planner (`tfpar.plan`) imports it too.

    >>> import tensorflow as tf
    >>> hooks_of(tf.distribute.get_strategy())._tfpar_shard_stage
    0
"""


class StrategyHooks:
    """The strategy side of the contract between tfpar's strategies and its Keras seam.

    Flags (class attributes) say what the strategy is; methods are asked at given points;
    a hook left None means "do what Keras does".
    """

    # -- What the strategy is ------------------------------------------------------------
    # Replicas each run Keras' own step on a part of the batch: losses normalized over the
    # global batch, BatchNorm statistics averaged, call losses per replica.
    _tfpar_exact_replicas = False
    # A mirrored strategy of tfpar's (data parallelism, pipelines): gradient accumulation
    # outside Keras' cond, each replica's gradients its own tensors.
    _tfpar_mirrored = False
    # Replicas on several TF_CONFIG workers: file-writing callbacks on the chief only.
    _tfpar_multi_worker = False
    # Parameter-server training: fit, evaluate and predict through a ClusterCoordinator.
    _tfpar_parameter_server = False
    # Optimizer updates one variable after another (a device holds one update's temporaries).
    _tfpar_updates_in_turn = False
    # A replica's gradients live on its layers' devices (pipelines, model parallelism).
    _tfpar_replica_spans_devices = False
    # ZeRO stage (0: unsharded, 1 optimizer state, 2 gradients, 3 parameters).
    _tfpar_shard_stage = 0
    # Under stage 3 across workers: a variable read is a gather from its owner.
    _tfpar_gathers_parameters = False
    # Saving sharded state fetches it from every worker: all of them save together.
    _tfpar_every_worker_saves = False
    # Made by tfpar for a keras.distribution.DataParallel (tfpar.use_keras_distribution).
    _tfpar_from_keras = False
    # jit_compile=True compiles, instead of Keras' whole step (`tfpar.keras.xla_calls`),
    # each replica's model call ("replica") or each placed layer's call ("layer"); None:
    # Keras' own (refused by `_tfpar_xla_refusal` where it cannot run).
    _tfpar_xla_unit = None
    # ZeRO's owners of each variable's state (`tfpar.distribute.zero.zero_owners.ShardOwners`).
    _tfpar_shard_owners = None
    # ZeRO's collectives across workers
    # (`tfpar.distribute.zero.zero_collectives.ShardCollectives`).
    _tfpar_shard_collectives = None

    # -- Asked at given points (None: Keras' own behaviour) ---------------------------------
    # (variable, callers) -> the devices of a variable's storage, before it is made.
    _tfpar_variable_home = None
    # (variable) -> None: a variable without storage is used for the first time.
    _tfpar_first_use = None
    # (model) -> None: a Keras model was created under the strategy's scope.
    _tfpar_model_created = None
    # (model, args, kwargs) -> None: before every call of a model made under the scope.
    _tfpar_before_model_call = None
    # (model, data) -> logs: the strategy builds the training step itself (pipelines).
    _tfpar_train_step = None
    # (model) -> an error message, or None: refuse `jit_compile=True` before a step.
    _tfpar_xla_refusal = None
    # (model, step_function) -> an error message, or None: refuse a step before it is built.
    _tfpar_step_refusal = None
    # (optimizer, grads, variables, learning_rate, ...) -> None: ZeRO's sharded update.
    _tfpar_sharded_update = None
    # (optimizer, ...) -> ZeRO's gradient accumulation
    # (`tfpar.distribute.zero.zero_update.Accumulation`).
    _tfpar_accumulation = None
    # (optimizer) -> each optimizer variable's whole value in turn, fetched from its owner.
    _tfpar_full_optimizer_state = None
    # (variables) -> None: BackupAndRestore resumed on the chief; the others take its values.
    _tfpar_broadcast_from_chief = None
    # "fp16", "bf16" or None: the type the replicas' gradients are summed in
    # (`tfpar.keras.compression`).
    _tfpar_compression = None
    # Optimizer steps between averagings of the replicas' weights (periodic averaging,
    # `tfpar.distribute.data_parallel.local_sgd`): 1 sums the gradients every step; n > 1
    # lets each replica step on its own gradients, averaging every n steps and after fit.
    _tfpar_sync_every = 1
    # Whether those averagings take the optimizer's float state too.
    _tfpar_sync_optimizer_state = False
    # (variables) -> None, in cross-replica context: each variable's copies on the
    # replicas set to their mean.
    _tfpar_average_replicas = None
    # () -> who writes which variable of a sharded save, or None (`tfpar.keras.owner_saving`;
    # `tfpar.distribute.zero.owner_checkpoint.OwnerCheckpoint`).
    _tfpar_owner_checkpoint = None
    # In a replica: what it holds of each sequence under context parallelism (a
    # `tfpar.distribute.context.sequence_split.SequenceShards`), else None.
    _tfpar_context_shards = None
    # (keras variable) -> whether it is a stand-in of a weight another worker holds (ZeRO-3
    # across workers: a load reads only what is kept), or None.
    _tfpar_held_elsewhere = None
    # (path) -> None: check that every worker sees the backup directory (a shared disk).
    _tfpar_check_backup_everywhere = None
    # () -> a context manager entered around fit, evaluate and predict.
    _tfpar_watching = None
    # (error) -> a clearer error, or None: fit/evaluate/predict ended with a lost task.
    _tfpar_explain_lost_task = None
    # (error) -> a clearer error, or None: a collective timed out.
    _tfpar_explain_timeout = None
    # (optimizer_slots=2) -> tfpar.plan.MemoryConfig describing the strategy's layout.
    _tfpar_memory_config = None
    # (variables) -> the variables an optimizer built for them keeps state for (a
    # tensor-parallel pipeline: each split variable's shards in its place).
    _tfpar_optimizer_variables = None
    # (variables) -> lists of indices into `variables` that are one Keras variable's shards
    # (a tensor-parallel pipeline), clipped by their joint norm (`clipnorm`).
    _tfpar_clip_groups = None
    # (name, model, *args, **kwargs) -> what Keras' `fit`, `evaluate` or `predict` (`name`)
    # returns, run by the strategy's own loop (parameter servers:
    # `tfpar.distribute.parameter_server.ps_loops`).
    _tfpar_run_loop = None
    # Set by ZeRO's set_up (`tfpar.distribute.zero.zero_update.StepShapes`), written by its
    # step: the gradient bytes a replica reduces per step, read by the strategy's memory
    # report.
    _tfpar_step_shapes = None


# tfpar's own attributes on Keras and TensorFlow objects (models, layers, variables) that
# the runtime sets and reads by name: an object without one is unmarked. The runtime names
# no other private attribute (`tests/test_layout.py`); the Keras seam's own marks stay in it.
MARKS = {
    "_tfpar_placed_by": "a model: the strategy that placed it",
    "_tfpar_device": "a layer placed by ModelParallelStrategy: its device",
    "_tfpar_original_call": "a placed layer, a pipelined model: its call before tfpar's",
    "_tfpar_pipeline": "a pipelined model: its stages",
    "_tfpar_weight_versions": "a pipelined model: its older weights (two weight versions)",
    "_tfpar_colocated_with": "a pipeline's optimizer state: the variable whose devices it follows",
    "_tfpar_written": "a MeshVariable: its value written in the graph being traced",
    "_tfpar_pins_device": "the class tfpar.layers.OnDevice: its layers keep their "
                          "variables on the device they name",
    "_tfpar_axes": "a MeshVariable: the mesh axis each of its dimensions is split over",
    "_tfpar_runtime": "a MeshVariable: the mesh runtime that laid it out",
    "_tfpar_home": "a tensor crossing between pipeline stages: the device the executor "
                   "anchors it on (a slice of a tensor-parallel stage's output)",
    "_tfpar_source": "such a slice: the device it was cut on, where its gradient goes back",
}

_DEFAULTS = StrategyHooks()


def hooks_of(strategy):
    """`strategy` if it is one of tfpar's, else the defaults (stock strategies, None)."""
    return strategy if isinstance(strategy, StrategyHooks) else _DEFAULTS


def declared_hooks():
    """The names of every hook, in declaration order."""
    return [name for name in vars(StrategyHooks) if name.startswith("_tfpar_")]
