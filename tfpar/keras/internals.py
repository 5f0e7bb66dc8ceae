"""Every Keras and TensorFlow private that tfpar touches, read so that a change fails closed.

tfpar is tested at both ends of the ranges in `TESTED_WITH` (setup.py declares them).
Private modules, classes and functions are imported with `symbol("keras.src....")`, and
private attributes of Keras or TensorFlow objects are read with `attr(obj, name)`.
Both raise `InternalsError` naming the installed versions and the tested range when the
private is gone, so a changed Keras stops tfpar with a clear message instead of
silently changing what it computes. `MANIFEST` lists every private; a test checks
each one against the installed versions and checks that tfpar reads no other. A private
that only newer releases have is listed in `SINCE`, with what older ones mean instead.

Beyond reads: a private written is written with `set_attr` (it must be there already); a
private that a tfpar subclass overrides is listed in `OVERRIDES` and its class decorated
with `overrides` (checked when the class is made); and every Keras attribute that
`hooks._wrap_once` wraps is listed in `WRAPS` and got through `wrapped`. Each fails closed.

    >>> symbol("keras.src.models.functional.Functional").__name__
    'Functional'
"""

import functools
import importlib

from tfpar.errors import InternalsError

# (oldest, newest) release of each that the suite runs on; setup.py allows [oldest, next
# minor after newest).
TESTED_WITH = {"keras": ("3.10.0", "3.15.1"), "tensorflow": ("2.19.0", "2.21.0")}

# Private modules, classes and functions (dotted paths), and what tfpar uses them for.
SYMBOLS = {
    # Keras
    "keras.src.backend.common.global_state.get_global_attribute":
        "the layer being built (Keras' name-scope stack), for where its variables are born",
    "keras.src.backend.common.global_state.set_global_attribute":
        "suspend a StatelessScope while a split weight's shards are made (their storage now)",
    "keras.src.backend.common.stateless_scope.get_stateless_scope":
        "the StatelessScope to suspend and put back",
    "keras.src.backend.common.keras_tensor.any_symbolic_tensors": "skip symbolic calls",
    "keras.src.backend.common.stateless_scope.in_stateless_scope":
        "skip Keras' symbolic build (where a variable without storage reads as its initializer)",
    "keras.src.backend.common.symbolic_scope.in_symbolic_scope": "skip shape inference",
    "keras.src.saving.saving_lib":
        "is_memory_sufficient wrapped: a tfpar model's .keras weights go through a file",
    "keras.src.saving.saving_lib._save_state":
        "Keras' own walk of a model's state, into the store of a sharded save by its owners",
    "keras.src.saving.saving_lib._load_state":
        "Keras' own walk of a model's state, from a store that reads values when used "
        "(ZeRO-3 across workers: each worker reads what it keeps)",
    "keras.src.saving.saving_lib._raise_loading_failure": "that walk's errors, as Keras raises",
    "keras.src.saving.saving_lib.ShardedH5IOStore":
        "subclassed so that Keras' walk takes the owners' store (which keeps none of its "
        "state), and read lazily on load",
    "keras.src.saving.saving_lib.H5IOStore": "each owner's shard files, in Keras' h5 layout",
    "keras.src.backend.common.remat": "RematScope's layer calls under model.fit on TensorFlow",
    "keras.src.backend.common.masking.get_keras_mask": "keep masks across devices",
    "keras.src.backend.common.masking.set_keras_mask": "keep masks across devices",
    "keras.src.backend.compute_output_spec": "build a model from shapes, allocating nothing",
    "keras.src.backend.tensorflow.core.Variable":
        "atomic updates under parameter servers; variables laid out on a device mesh",
    "keras.src.distribution.distribution_lib":
        "Distribution.scope() sets the distribution through this module's function",
    "keras.src.backend.tensorflow.distribution_lib":
        "keras.distribution's unfinished TensorFlow backend, completed on DTensor",
    "keras.src.backend.tensorflow.numpy": "flip on a device mesh (AUC), as a gather",
    "keras.src.backend.tensorflow.numpy.flip": "flip on a device mesh (AUC), as a gather",
    "keras.src.backend.tensorflow.random": "dropout masks on a device mesh, drawn whole",
    "keras.src.backend.tensorflow.random.dropout": "dropout masks on a device mesh, drawn whole",
    "keras.src.backend.tensorflow.optimizer.TFOptimizer": "optimizer updates of sharded variables",
    "keras.src.backend.tensorflow.trainer.TFEpochIterator":
        "the look-ahead iterator over arrays made when first read (tfpar.keras.look_ahead)",
    "keras.src.trainers.data_adapters.array_data_adapter.ArrayDataAdapter":
        "data Keras batches from arrays: a dataset only its epoch iterator reads",
    "keras.src.backend.tensorflow.trainer.TensorFlowTrainer": "fit/evaluate/predict dispatch",
    "keras.src.losses.loss": "global normalization of mean losses over replicas",
    "keras.src.losses.loss.apply_mask": "weights of masked losses",
    "keras.src.losses.loss.squeeze_or_expand_to_same_rank": "weights of losses",
    "keras.src.losses.loss.unscale_loss_for_distribution": "the loss tracker's value",
    "keras.src.losses.loss.scale_loss_for_distribution": "losses added in call, in batch parts",
    "keras.src.models.functional.Functional": "cut functional models into stages",
    "keras.src.models.functional.operation_fn": "run one node of a functional graph",
    "keras.src.models.functional.unpack_singleton": "a functional model's outputs",
    "keras.src.optimizers.base_optimizer.BaseOptimizer": "optimizer state of sharded variables",
    "keras.src.trainers.data_adapters.array_slicing.train_validation_split": "validation_split",
    "keras.src.trainers.data_adapters.get_data_adapter": "Keras' input handling",
    "keras.src.trainers.trainer.Trainer": "which models override compute_loss",
    # TensorFlow
    "tensorflow.python.distribute.collective_all_reduce_strategy.CollectiveAllReduceExtended":
        "multi-worker data parallelism",
    "tensorflow.python.distribute.collective_util.CommunicationImplementation":
        "ring or NCCL across workers",
    "tensorflow.python.distribute.collective_util.Options": "collective options",
    "tensorflow.python.eager.context.context":
        "the coordination service's key-value store: workers check they will meet",
    "tensorflow.python.distribute.coordinator.cluster_coordinator._is_ps_failure":
        "TensorFlow's own reading of an error as a lost parameter server",
    "tensorflow.python.distribute.coordinator.values.PerWorkerDistributedIterator":
        "one iterator per worker, each over its own shard",
    "tensorflow.python.distribute.coordinator.values.deserialize_dataset_from_graph":
        "a chief's dataset rebuilt on each worker",
    "tensorflow.python.distribute.coordinator.values.serialize_dataset_to_graph":
        "a chief's dataset sent to each worker",
    "tensorflow.python.distribute.cross_device_ops.CollectiveAllReduce": "ring all-reduce",
    "tensorflow.python.distribute.cross_device_utils.CollectiveReplicaLauncher":
        "subclassed: collectives timed once per function; dense all-reduces by "
        "halving-doubling",
    "tensorflow.python.training.saving.saveable_object_util.TrackableSaveable":
        "a TensorFlow checkpoint's restore of an object saved as several slices under one "
        "name (a tensor-parallel variable), given every slice",
    "tensorflow.python.distribute.values.PerReplica":
        "a tensor-parallel group's partial sums, reduced by collectives across processes",
    "tensorflow.python.distribute.device_util.canonicalize": "canonical device names",
    "tensorflow.python.distribute.distribute_lib.UpdateContext": "optimizer updates on a device",
    "tensorflow.python.distribute.mirrored_strategy.MirroredExtended": "mirrored strategies",
    "tensorflow.python.distribute.one_device_strategy.OneDeviceExtended": "model parallelism",
    "tensorflow.python.distribute.sharded_variable.ShardedVariable": "sharded ps variables",
    "tensorflow.python.distribute.values.DistributedVariable": "mirrored variables",
    "tensorflow.python.distribute.values_util.get_current_replica_id_as_int": "replica id",
    "tensorflow.python.eager.context.get_server_def":
        "the cluster a pipeline's chief is connected to (its stage workers' addresses)",
    "tensorflow.python.eager.record.could_possibly_record": "is a gradient tape recording",
    "tensorflow.python.eager.record.stop_recording":
        "a recomputed layer's forward pass, off the tape (ZeRO-3 across workers)",
    "tensorflow.python.ops.resource_variable_ops.ResourceVariable": "move mirrored copies",
}

# Private attributes of Keras and TensorFlow objects that tfpar reads or sets, and on what.
ATTRIBUTES = {
    "is_memory_sufficient": "keras.src.saving.saving_lib (wrapped)",
    "_aggregate_additional_loss": "keras.Model",
    "_assert_compile_called": "keras.Model",
    "_call_has_training_arg": "keras.layers.Layer",
    "_call_has_mask_arg": "keras.layers.Layer",
    "_compile_loss": "keras.Model (compiled)",
    "_compile_metrics": "keras.Model (compiled)",
    "_compute_loss": "keras.Model",
    "_flat_losses": "the compiled loss of a keras.Model",
    "_flatten_layers": "keras.layers.Layer",
    "_input_spec": "keras.layers.Layer (written: a row layer of a block run replicated takes "
                   "its device's slice, narrower than its spec)",
    "_query_dense": "keras.layers.MultiHeadAttention (its projections, split by heads)",
    "_key_dense": "keras.layers.MultiHeadAttention",
    "_value_dense": "keras.layers.MultiHeadAttention",
    "_output_dense": "keras.layers.MultiHeadAttention",
    "_dropout": "keras.layers.MultiHeadAttention (its rate: a share of the heads would draw "
                "another dropout mask)",
    "_use_gate": "keras.layers.MultiHeadAttention (gated attention, since Keras 3.14)",
    "_inverse_sqrt_key_dim": "keras.layers.MultiHeadAttention (its scores' scale: context "
                             "parallelism's blockwise attention)",
    "_inv_norm_factor": "keras-hub's LlamaAttention (its scores' scale: context parallelism's "
                        "blockwise attention)",
    "_sliding_window": "keras.layers.MultiHeadAttention (sliding-window attention, since "
                       "Keras 3.15: not under context parallelism yet)",
    "_flatten_metrics_in_order": "keras.Model",
    "_get_own_losses": "keras.layers.Layer",
    "_clear_losses": "keras.layers.Layer",
    "_get_regularization_losses": "keras.layers.Layer",
    "_inbound_nodes": "keras.layers.Layer",
    "_keras_history": "KerasTensor of a functional graph",
    "_build_shapes_dict": "keras.layers.Layer",
    "_set_mask_metadata": "keras.layers.Layer (a split layer's output mask, as __call__ sets it)",
    "_initial_epoch": "keras.Model",
    "_load_model": "keras.callbacks.BackupAndRestore",
    "_save_model": "keras.callbacks.BackupAndRestore",
    "_weights_path": "keras.callbacks.BackupAndRestore",
    "_prev_weights_path": "keras.callbacks.BackupAndRestore",
    "_training_metadata_path": "keras.callbacks.BackupAndRestore",
    "_prev_training_metadata_path": "keras.callbacks.BackupAndRestore",
    "_jit_compile": "keras.Model (compiled)",
    "_maybe_symbolic_build": "TensorFlowTrainer",
    "_make_function": "TensorFlowTrainer",
    "_get_variable_index": "keras.optimizers.Optimizer",
    "_accumulated_gradients": "keras.optimizers.Optimizer (gradient accumulation)",
    "_clip_gradients": "keras.optimizers.Optimizer",
    "_iterations": "keras.optimizers.Optimizer",
    "_distributed_tf_update_step": "TFOptimizer",
    "_all_reduce_sum_gradients": "TFOptimizer",
    "_distribution_strategy": "TFOptimizer (the strategy it was made under)",
    "_use_weight_decay": "keras.optimizers.Optimizer",
    "_model_variables_moving_average": "keras.optimizers.Optimizer (use_ema's averages)",
    "_trainable_variables": "keras.optimizers.Optimizer (the variables it was built for)",
    "_update_model_variables_moving_average": "keras.optimizers.Optimizer (use_ema)",
    "_overwrite_model_variables_with_average_value": "keras.optimizers.Optimizer (use_ema)",
    "_loss_tracker": "keras.Model (compiled)",
    "_losses": "keras.layers.Layer (losses added by its last call)",
    "_nodes_by_depth": "keras Functional",
    "_outputs_struct": "keras Functional",
    "_run_through_graph": "keras Function",
    "_seed_generators": "keras.layers.Layer",
    "_remat_mode": "keras Operation (written: ZeRO-3 recomputes a layer to gather its "
                   "weights again for the backward pass)",
    "_should_eval": "keras.Model",
    "_standardize_inputs": "keras Functional",
    "_symbolic_build": "keras.Model",
    "_functional": "keras.Sequential (built)",
    "_distribute_strategy": "keras.Model; TFEpochIterator (the strategy it distributes for)",
    "_current_iterator": "keras EpochIterator (written: the iterator made for a pending one)",
    "_value": "keras.Variable",
    "_initializer": "keras.Variable (a variable without storage yet)",
    "_initialize": "keras.Variable on TensorFlow (its storage, laid out on a device mesh)",
    "_layout": "keras.Variable (its keras.distribution layout, which optimizer state takes)",
    "_shape": "keras.Variable (made from a value: its shape, before Keras sets it)",
    "_initialize_with_initializer": "keras.Variable (where it gets its storage)",
    "_deferred_initialize": "keras.Variable (storage for one made in a StatelessScope)",
    "_direct_assign": "keras.Variable (a write that needs its storage first)",
    "_restore_from_tensors": "keras.Variable (a TensorFlow checkpoint restored across tasks)",
    "_local_names": "TrackableSaveable (the local name of each of its restored tensors)",
    "_trackable": "TrackableSaveable (the object it restores)",
    "_dense_var_to_tensor": "tf.Variable (a stage-3 variable across workers read from its owner)",
    "_unique_id": "tf.Variable",
    "_get_replica_id_in_sync_group": "CollectiveAllReduceExtended (a worker's first replica)",
    "_values": "tf.distribute DistributedVariable",
    "_distributed_container": "the handle of a tf.distribute variable's copy",
    "_num_workers": "CollectiveAllReduceExtended",
    "_collective_keys": "MirroredExtended",
    "_cross_device_ops": "MirroredExtended",
    "_communication_options": "MirroredExtended",
    "_devices": "MirroredExtended; CollectiveAllReduce (its replicas' devices)",
    "_launchers": "CollectiveAllReduce (written: launchers timed once per traced function, "
                  "whose dense all-reduces may go by halving-doubling)",
    "_container_strategy": "tf.distribute.StrategyExtended",
    "_local_results": "tf.distribute.StrategyExtended",
    "_device": "OneDeviceExtended",
    "_num_replicas_in_sync": "CollectiveAllReduceExtended",
    "_cluster": "ClusterCoordinator (its workers)",
    "_moments": "keras.layers.BatchNormalization (a sync part's batch moments)",
    "_type_spec": "a coordinator RemoteValue (a per-worker iterator's spec)",
    "_add_control_input": "tf.Operation (a zero-bubble W's ops deferred to its turn)",
    "_collective_key_base": "MirroredStrategy (written: the strategy's own block of group keys, "
                            "which MirroredExtended reads when it is made)",
    "_to_backend_mesh": "keras.src.backend.tensorflow.distribution_lib (written: on DTensor)",
    "_to_backend_layout": "keras.src.backend.tensorflow.distribution_lib (written: on DTensor)",
}

# Privates of TensorFlow and Keras classes that tfpar's subclasses override, on what, and why.
# Each class that overrides one is decorated with `overrides`, which checks at class definition
# that a TensorFlow or Keras base still has it: renamed, the override would never be called.
OVERRIDES = {
    "_create_variable": "MirroredExtended, CollectiveAllReduceExtended, OneDeviceExtended: "
                        "where each variable is born (placement, sharding, mirrored copies)",
    "_initialize_strategy": "MirroredExtended: tfpar's cross-device ops (group keys, packing, "
                            "a pipeline's per-stage reductions)",
    "_experimental_distribute_dataset": "MirroredExtended, CollectiveAllReduceExtended: a first "
                                        "batch that does not split into replicas fails clearly",
    "_validate_colocate_with_variable": "MirroredExtended (data parallelism, pipelines), "
                                        "CollectiveAllReduceExtended: optimizer state "
                                        "colocated with a sharded variable",
    "_reduce_to": "CollectiveAllReduceExtended: reductions of values kept by one replica",
    "_batch_reduce_to": "MirroredExtended: a pipeline's gradients reduced stage by stage",
    "_get_cross_device_ops": "MirroredExtended: each pipeline stage's own cross-device ops",
    "_update": "OneDeviceExtended: an optimizer update on its variable's device",
    "_all_gather": "CollectiveReplicaLauncher: a gather's timeout on the first collective of "
                   "a traced function only (TensorFlow holds a thread per timed collective)",
    "_read_variable_op": "dtensor.DVariable: a mesh variable read where it is laid out",
    "_dense_var_to_tensor": "tf.Variable: a stage-3 variable across workers read from its owner",
}

# Attributes of Keras and TensorFlow classes and modules that tfpar wraps (`hooks._wrap_once`
# replaces each by a wrapper once), public ones included: (owner, attribute) -> why. The owner
# is named by its `__name__` (a class's, or a module's dotted one).
_TRAINER, _TF_VARIABLE = "TensorFlowTrainer", "Variable"
WRAPS = {
    # Only before Keras 3.14 (WRAPS_BEFORE): activity-regularizer losses are batch sums there.
    ("TensorFlowTrainer", "_aggregate_additional_loss"):
        "losses marked as batch sums are not scaled by replicas or micro-batch shares",
    ("keras.src.saving.saving_lib", "is_memory_sufficient"): "a tfpar model's weights via a file",
    ("keras.src.saving.saving_lib", "save_weights_only"):
        "ZeRO across workers: a sharded save ('*.weights.json') written by the owners",
    ("keras.src.saving.saving_lib", "load_weights_only"):
        "ZeRO-3 across workers: a sharded load ('*.weights.json') reads what each keeps",
    ("BackupAndRestore", "_save_model"): "backups committed whole; written by the chief only",
    ("BackupAndRestore", "_load_model"): "every worker takes the chief's restored state",
    ("BackupAndRestore", "on_train_begin"): "a committed backup finished after a kill",
    ("BackupAndRestore", "on_train_end"): "the chief only deletes the backup",
    ("ModelCheckpoint", "_save_model"): "checkpoints written by the chief only",
    ("Model", "__call__"): "a placing strategy sees a model before it runs; mesh calls",
    ("Model", "train_step"): "a pipeline builds the whole training step",
    ("Layer", "__call__"): "eager calls of a layer on a device mesh; before Keras 3.14 also "
                           "its activity-regularizer losses marked as sums over the batch",
    ("Layer", "add_loss"): "losses added in call, per replica",
    ("Layer", "_get_own_losses"): "losses added in call, per replica",
    ("Layer", "_clear_losses"): "losses added in call, per replica",
    ("BatchNormalization", "build"): "moving statistics aggregated by mean over replicas",
    ("BatchNormalization", "call"): "ps training: one worker at a time updates the statistics",
    ("BatchNormalization", "_moments"): "ps training: a sync part's batch moments",
    ("LossScaleOptimizer", "apply"): "ps training: one worker at a time updates the scale",
    **{(_TRAINER, name): "fit/evaluate/predict: ps loops, cluster errors explained, meshes"
       + (", replicas averaged after fit (sync_every)" if name == "fit" else "")
       for name in ("fit", "evaluate", "predict")},
    **{(_TRAINER, name): "refused under parameter servers (the chief does not train)"
       for name in ("train_on_batch", "test_on_batch", "predict_on_batch")},
    **{(_TRAINER, f"make_{kind}_function"): "a model on a device mesh runs compiled on DTensor"
       for kind in ("train", "test", "predict")},  # (predict: also jit_compile per replica)
    (_TRAINER, "__init__"): "a model announced to the placing strategy it is made under",
    (_TRAINER, "_maybe_symbolic_build"): "a model built from one replica's batch",
    ("TFEpochIterator", "_get_iterator"): "arrays: an iterator made when first read",
    ("TFEpochIterator", "_enumerate_iterator"): "arrays: an iterator made when first read",
    (_TRAINER, "_make_function"): "jit_compile refused clearly before the first step",
    (_TRAINER, "predict_step"): "context parallelism: each example's sequence predicted whole",
    ("keras.src.losses.loss", "reduce_weighted_values"): "mean losses over the global batch",
    ("keras.src.losses.loss", "unscale_loss_for_distribution"): "the loss tracker's value",
    ("keras.src.losses.loss", "scale_loss_for_distribution"): "losses added in call, in parts",
    ("keras.src.backend.common.remat", "remat"): "remat with keyword arguments (ZeRO-3)",
    ("BaseOptimizer", "build"): "optimizer state built for its shards",
    ("BaseOptimizer", "save_own_variables"): "sharded optimizer state saved whole",
    ("BaseOptimizer", "load_own_variables"): "sharded optimizer state loaded where owned",
    ("BaseOptimizer", "_update_model_variables_moving_average"):
        "ZeRO: each owner updates the moving averages (use_ema) it owns",
    ("BaseOptimizer", "finalize_variable_values"):
        "ZeRO: weights take their averages (use_ema) from their owners",
    ("TFOptimizer", "_backend_update_step"): "ZeRO: each replica updates the shards it owns",
    ("TFOptimizer", "_backend_apply_gradients"):
        "gradient accumulation outside a cond; clipping after the sum over replicas",
    ("BaseOptimizer", "_clip_gradients"): "deferred: tfpar clips the global gradient",
    ("TFOptimizer", "_overwrite_model_variables_with_average_value"):
        "EMA overwrite in replica context (Keras runs it in a cond)",
    ("TFOptimizer", "_apply_weight_decay"): "ZeRO: each owner decays the variables it owns; "
                                             "parameter servers: sharded variables decayed "
                                             "shard by shard",
    ("LossScaleOptimizer", "_tf_apply"): "a step skipped when any replica overflows",
    ("TFOptimizer", "_distributed_tf_update_step"): "updates in turn; sharded ps updates",
    ("TFOptimizer", "_all_reduce_sum_gradients"): "gradients reduced where they are",
    ("TFOptimizer", "add_variable_from_reference"): "optimizer state of sharded ps variables",
    (_TF_VARIABLE, "assign_add"): "atomic updates under parameter servers",
    (_TF_VARIABLE, "assign_sub"): "atomic updates under parameter servers",
    (_TF_VARIABLE, "__array__"): "a sharded ps variable read whole",
    (_TF_VARIABLE, "_initialize"): "storage laid out on a device mesh",
    (_TF_VARIABLE, "_initialize_with_initializer"): "a variable born on its device",
    (_TF_VARIABLE, "_deferred_initialize"): "a variable born on its device",
    (_TF_VARIABLE, "_direct_assign"): "a variable stored before it is written",
    (_TF_VARIABLE, "_restore_from_tensors"):
        "a TensorFlow checkpoint restored across tasks: the restored tensor takes its shape",
    ("TrackableSaveable", "restore"):
        "a tensor-parallel variable restored from its shards' slices, each on its owner",
    ("keras.src.backend.tensorflow.numpy", "flip"): "flip on a device mesh, as a gather",
    ("keras.src.backend.tensorflow.random", "dropout"): "dropout masks on a mesh, drawn whole",
    ("keras.src.distribution.distribution_lib", "set_distribution"):
        "a DataParallel distribution follows tfpar's DataParallelStrategy",
    ("keras.distribution", "set_distribution"):
        "a DataParallel distribution follows tfpar's DataParallelStrategy",
}

# Wraps installed only on releases before these (what they fix is Keras' own after).
WRAPS_BEFORE = {
    ("TensorFlowTrainer", "_aggregate_additional_loss"): ("keras", "3.14.0"),
}

# Privates that only newer releases have: name -> (package, first release with it, what
# `attr` gives on older ones, where tfpar does what those releases do).
SINCE = {
    # Keras 3.14 added gated attention to MultiHeadAttention (read in the 3.13.2 and 3.14.0
    # wheels); before, no attention is gated.
    "_use_gate": ("keras", "3.14.0", False),
    # Keras 3.15 gave every variable its own layout (optimizer state takes its variable's);
    # before, the distribution's LayoutMap decides for each, as tfpar then does.
    "_layout": ("keras", "3.15.0", None),
    # Keras 3.15 gave MultiHeadAttention a sliding window; before, none has one.
    "_sliding_window": ("keras", "3.15.0", None),
}

MANIFEST = {**SYMBOLS, **ATTRIBUTES, **OVERRIDES}


def release(version):
    """(3, 15, 1) for "3.15.1" (and "3.15.1rc0", "2.21.0-dev")."""
    import re

    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def installed(package):
    """The installed release of "keras" or "tensorflow", e.g. (3, 15, 1)."""
    module = importlib.import_module(package)
    return release(module.__version__)


def _tested_range(package):
    oldest, newest = TESTED_WITH[package]
    return f"{oldest} to {newest}"


def _versions():
    import keras
    import tensorflow as tf

    return (f"installed: Keras {keras.__version__}, TensorFlow {tf.__version__}; tfpar is "
            f"tested with Keras {_tested_range('keras')} and TensorFlow "
            f"{_tested_range('tensorflow')}")


def _missing(what):
    return InternalsError(
        f"tfpar relies on {what}, which this Keras/TensorFlow does not have ({_versions()}). "
        f"Install a tested pair (pip install \"keras>={TESTED_WITH['keras'][0]},"
        f"<={TESTED_WITH['keras'][1]}\" \"tensorflow>={TESTED_WITH['tensorflow'][0]},"
        f"<={TESTED_WITH['tensorflow'][1]}\") or a tfpar release made for yours.")


@functools.lru_cache(maxsize=None)
def symbol(path):
    """The private module, class or function at dotted `path` (listed in SYMBOLS)."""
    if path not in SYMBOLS:
        raise KeyError(f"{path} is not in tfpar's manifest of privates (internals.SYMBOLS).")
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for name in parts[split:]:
                value = getattr(value, name)
        except AttributeError:
            break
        return value
    raise _missing(f"the private {path}")


_NOTHING = object()


def attr(obj, name):
    """`obj.name` for a private attribute listed in ATTRIBUTES; InternalsError if missing."""
    if name not in ATTRIBUTES:
        raise KeyError(f"{name} is not in tfpar's manifest of privates (internals.ATTRIBUTES).")
    value = getattr(obj, name, _NOTHING)
    if value is _NOTHING:
        if name in SINCE:
            package, first, before = SINCE[name]
            if installed(package) < release(first):
                return before
        raise _missing(f"the private attribute {type(obj).__name__}.{name}")
    return value


def set_attr(obj, name, value, like=None, set_by=None):
    """Writes the private attribute `obj.name` (listed in ATTRIBUTES), which must exist
    already: a renamed private fails closed instead of being written for nothing. When `obj`
    does not have it yet, it is checked on `like` (an object of the kind that has it), or in
    `set_by` (the Keras or TensorFlow method tfpar does the work of), which must set it."""
    if set_by is not None:
        if name not in ATTRIBUTES:
            raise KeyError(f"{name} is not in tfpar's manifest of privates "
                           f"(internals.ATTRIBUTES).")
        check(_sets(set_by, name), f"{set_by.__qualname__} setting self.{name}")
    else:
        attr(obj if like is None else like, name)
    setattr(obj, name, value)


@functools.lru_cache(maxsize=None)
def _source_has(function, text):
    import inspect

    return text in inspect.getsource(function)


def _sets(function, name):
    return _source_has(function, f"self.{name} =")


def delegates(cls, method, text):
    """Whether `cls.method`'s source contains `text` (the call it hands the work on with)."""
    function = getattr(cls, method, None)
    try:
        return function is not None and _source_has(function, text)
    except (OSError, TypeError):  # (No source to read: fail closed.)
        return False


def _owner_name(owner):
    """How WRAPS names a class or module: its `__name__` (a module's is dotted)."""
    return owner.__name__


def wrapped(owner, name):
    """`owner.name`, which tfpar is about to wrap (listed in WRAPS); InternalsError if
    missing, so that a renamed attribute is not wrapped for nothing."""
    key = (_owner_name(owner), name)
    if key not in WRAPS:
        raise KeyError(f"{key} is not in tfpar's manifest of wrapped attributes "
                       f"(internals.WRAPS).")
    value = getattr(owner, name, _NOTHING)
    if value is _NOTHING:
        raise _missing(f"{key[0]}.{name}, which it wraps")
    return value


def _is_tfpar(cls):
    return cls.__module__.split(".")[0] == "tfpar"


def own_privates(cls):
    """The private members (not dunders, not tfpar's own `_tfpar_` ones) that `cls` and the
    tfpar classes it inherits from define, and the TensorFlow or Keras bases it has."""
    names = {name for c in cls.__mro__ if _is_tfpar(c) for name in vars(c)
             if name.startswith("_") and not name.startswith(("__", "_tfpar_"))
             and name != "_abc_impl"}  # (Set by ABCMeta on every class.)
    return names, [c for c in cls.__mro__ if not _is_tfpar(c) and c is not object]


def overridden(cls):
    """The privates that `cls` (a tfpar class) defines over a TensorFlow or Keras base's."""
    names, bases = own_privates(cls)
    return {name for name in names if any(name in vars(base) for base in bases)}


overriding = set()  # Names of the classes `overrides` checked (a test reads it).


def overrides(cls):
    """Class decorator for a tfpar subclass of a TensorFlow or Keras class: every private it
    overrides (listed in OVERRIDES) must still be defined by one of its TensorFlow or Keras
    bases, else InternalsError: a renamed private would leave the override never called.
    On a tfpar mixin (no such base) it declares the mixin's overrides, which are checked on
    each decorated class that mixes it in."""
    names, bases = own_privates(cls)
    if not bases:  # A tfpar mixin: checked with each TensorFlow class that mixes it in.
        overriding.add(f"{cls.__module__}.{cls.__qualname__}")
        return cls
    unlisted = sorted(overridden(cls) - set(OVERRIDES))
    if unlisted:
        raise KeyError(f"{cls.__name__} overrides {unlisted}, not in tfpar's manifest of "
                       f"privates (internals.OVERRIDES).")
    for name in sorted(names & set(OVERRIDES)):
        if not any(name in vars(base) for base in bases):
            owners = ", ".join(base.__name__ for base in bases[:2])
            raise _missing(f"the private {name} of {owners}, which tfpar's {cls.__name__} "
                           f"overrides")
    overriding.add(f"{cls.__module__}.{cls.__qualname__}")
    return cls


def check(condition, what):
    """Fails closed when a private no longer has the shape tfpar reads it in."""
    if not condition:
        raise _missing(what)
