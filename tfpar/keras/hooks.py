"""The Keras methods tfpar wraps, each once; every wrapper asks the model's strategy.

Keras 3 callbacks are not multi-worker aware: under a multi-worker strategy every
worker runs `BackupAndRestore` and `ModelCheckpoint`, and all write the same files
(seen here: `FileExistsError` on the backup directory, and h5 files written
concurrently). Weights are identical on every worker, so tfpar lets only the chief
write; every worker still reads the chief's backup when a run resumes.
"""

import contextlib
import functools
import os
import shutil
import tempfile
import threading
import weakref

from tfpar.contract import hooks_of
from tfpar.keras import internals

_lock = threading.Lock()


_ABSENT = object()
# Every replacement tfpar made in Keras or TensorFlow, in order: (owner, name, what
# `vars(owner)` held before, or _ABSENT). `remove_patches` undoes them.
_applied = []


def _replace(owner, name, value):
    _applied.append((owner, name, vars(owner).get(name, _ABSENT)))
    setattr(owner, name, value)


# Replacements on single objects (a placed layer's or a pipelined model's `call` set on the
# instance, a ZeRO-3 variable's class), in order: (weak reference to the object, name, what
# it held before, or _ABSENT). Weak: the ledger keeps no model alive. `remove_patches`
# undoes those whose object is alive.
_object_patches = []


def patch_object(obj, name, value):
    """Sets `obj`'s own attribute `name` (`"call"`, or `"__class__"` for a class of its own)
    to tfpar's `value`, bypassing Keras' attribute tracking, in the ledger."""
    with _lock:
        before = type(obj) if name == "__class__" else vars(obj).get(name, _ABSENT)
        object.__setattr__(obj, name, value)
        if len(_object_patches) % 256 == 255:  # Forget objects that are gone.
            _object_patches[:] = [p for p in _object_patches if p[0]() is not None]
        _object_patches.append((weakref.ref(obj), name, before))


def unpatch_object(obj, name):
    """Puts back what `obj.name` held before tfpar's latest `patch_object` of it."""
    with _lock:
        for index in range(len(_object_patches) - 1, -1, -1):
            ref, patched, before = _object_patches[index]
            if patched == name and ref() is obj:
                del _object_patches[index]
                _restore_object(obj, name, before)
                return
        raise ValueError(f"tfpar did not patch {name!r} of {obj!r}")


def _restore_object(obj, name, before):
    if before is _ABSENT:
        object.__delattr__(obj, name)
    else:
        object.__setattr__(obj, name, before)


# The Keras seam's own marks on Keras and TensorFlow objects, set and read by name (the
# runtime's are `tfpar.contract.MARKS`; `tests/test_contract.py` finds every `_tfpar_`
# name in one of them or among the declared hooks). A wrapper's marker says it is tfpar's
# (`_wrap_once`); the other marks carry state on the object they mark.
SEAM_MARKS = {
    "_tfpar_weights_through_a_file": "wrapper: Keras' saving memory check (sharded state)",
    "_tfpar_saved_whole": "wrapper: BackupAndRestore._save_model saving sharded state whole",
    "_tfpar_finishing_backups": "wrapper: BackupAndRestore.on_train_begin",
    "_tfpar_chief_only": "wrapper: a callback's writes, on the chief only",
    "_tfpar_restored_by_the_chief": "wrapper: BackupAndRestore._load_model across workers",
    "_tfpar_explains_cluster_errors": "wrapper: a Trainer method naming a lost peer",
    "_tfpar_sharded": "wrapper: an optimizer or saving method under ZeRO",
    "_tfpar_variable_birth": "wrapper: where a Keras variable's storage is made",
    "_tfpar_model_call_hook": "wrapper: keras.Model.__call__ (the strategy's model hook)",
    "_tfpar_train_step_hook": "wrapper: keras.Model.train_step (the strategy's step hook)",
    "_tfpar_mesh": "wrapper: a Keras function run by keras.distribution on TensorFlow",
    "_tfpar_exclusive": "wrapper: a metric's update_state, under its lock (parameter servers)",
    "_tfpar_batch_sum": "a loss: it sums over the batch (a replica's part adds up as is)",
    "_tfpar_replica_losses": "a layer: its call losses kept per replica",
    "_tfpar_ps_steps": "a model: its parameter-server step functions, by compiled state",
    "_tfpar_regathered": "a layer: gathers its weights again for its backward pass (ZeRO-3)",
    "_tfpar_distribution": "a mesh variable: the keras.distribution it was made under",
    "_tfpar_compiled_per_replica": "a model: its XLA-compiled call per replica (jit_compile)",
}


def _wrap_once(owner, name, wrap, marker):
    """Replaces `owner.name` by `wrap(original)` unless already done (the wrapper carries
    the attribute `marker`). Thread-safe. `(owner, name)` is listed in internals.WRAPS, and a
    missing attribute fails closed (InternalsError) before anything is replaced."""
    with _lock:
        original = internals.wrapped(owner, name)
        if getattr(original, marker, False):
            return
        wrapper = functools.wraps(original)(wrap(original))
        setattr(wrapper, marker, True)
        _replace(owner, name, wrapper)


def replace_attribute(owner, name, value, private=True):
    """Sets `owner.name` (a module's function) to tfpar's `value`, undone by
    `remove_patches`; a private must exist already (internals.set_attr)."""
    with _lock:
        if private:
            internals.attr(owner, name)
        _replace(owner, name, value)


def remove_patches():
    """Puts back everything tfpar replaced in Keras and TensorFlow (the wraps its strategies
    and `use_keras_distribution` installed, and what it set on single objects still alive),
    newest first: stock behaviour again. Returns how many replacements were undone. A
    strategy made afterwards installs its wraps again."""
    with _lock:
        undone = len(_applied) + len(_object_patches)
        while _object_patches:
            ref, name, before = _object_patches.pop()
            obj = ref()
            if obj is not None:
                _restore_object(obj, name, before)
        while _applied:
            owner, name, before = _applied.pop()
            if before is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
        return undone


def _is_non_chief_worker(callback):
    # Read strictly: if Keras stopped giving callbacks their model, every worker would
    # write again; fail instead.
    model = callback.model
    internals.check(model is not None, "keras.callbacks.Callback.model set during fit")
    strategy = model.distribute_strategy
    return bool(hooks_of(strategy)._tfpar_multi_worker
                and not strategy.extended.should_checkpoint)


def _chief_only(method):
    def wrapper(self, *args, **kwargs):
        if not _is_non_chief_worker(self):
            return method(self, *args, **kwargs)
        if not hooks_of(self.model.distribute_strategy)._tfpar_every_worker_saves:
            return None
        # Sharded state: saving gathers it from every worker, so every worker saves; the
        # others write to a directory thrown away after (as TensorFlow's multi-worker
        # tutorial has non-chief workers do).
        with _writing_elsewhere(self):
            return method(self, *args, **kwargs)
    return wrapper


def _set(obj, name, value):
    if name.startswith("_"):  # Keras' private: written only if it is still there.
        internals.set_attr(obj, name, value)
    else:
        setattr(obj, name, value)


@contextlib.contextmanager
def _writing_elsewhere(callback):
    """The callback's files go to a temporary directory, deleted after."""
    import keras

    names = (["backup_dir", "_weights_path", "_training_metadata_path", "_prev_weights_path",
              "_prev_training_metadata_path"]
             if isinstance(callback, keras.callbacks.BackupAndRestore) else ["filepath"])
    saved = {name: internals.attr(callback, name) if name.startswith("_")
             else getattr(callback, name) for name in names}
    directory = tempfile.mkdtemp(prefix="tfpar-not-chief-")
    try:
        for name, path in saved.items():
            _set(callback, name, os.path.join(directory, os.path.basename(str(path))))
        yield
    finally:
        for name, path in saved.items():
            _set(callback, name, path)
        shutil.rmtree(directory, ignore_errors=True)


def _restored_by_the_chief(load_model):
    def wrapper(self):
        strategy = self.model.distribute_strategy
        broadcast = hooks_of(strategy)._tfpar_broadcast_from_chief
        if broadcast is None:
            return load_model(self)
        if hooks_of(strategy)._tfpar_every_worker_saves:
            # Sharded state: each worker reads the chief's backup for what it owns.
            strategy._tfpar_check_backup_everywhere(internals.attr(self, "_weights_path"))
            return load_model(self)
        import tensorflow as tf

        model = self.model
        # The same variables on every worker before any value moves (Keras builds the
        # optimizer only when it finds a backup, which only the chief may have).
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        if strategy.extended.should_checkpoint:
            load_model(self)
        with strategy.scope():  # Made on every worker, in the same order.
            epoch = tf.Variable(0, dtype=tf.int64, trainable=False)
        epoch.assign(internals.attr(model, "_initial_epoch") or 0)
        optimizer = model.optimizer.variables if model.optimizer is not None else []
        broadcast([epoch, *model.variables, *optimizer])
        internals.set_attr(model, "_initial_epoch", int(epoch.numpy()) or None)
    return wrapper


# --- Crash-safe backups -------------------------------------------------------------
# Keras' BackupAndRestore overwrites its weights file, then its metadata, in place: a kill
# in between leaves a torn h5 file or new weights with the old epoch. Under tfpar's
# strategies (the launcher restarts killed jobs) a backup is written beside the old one,
# committed by the atomic rename of a marker, then moved into place; a restart finishes a
# committed backup and drops an uncommitted one.
_COMMIT = "tfpar-backup-committed"


def _new(path):
    # A prefix: Keras checks the weights file's suffix.
    head, tail = path.rsplit("/", 1) if "/" in path else ("", path)
    return f"{head}/tfpar-new.{tail}" if head else f"tfpar-new.{tail}"


def _is_tfpar_strategy(strategy):
    return type(strategy).__module__.startswith("tfpar.")


def _is_tfpar_model(callback):
    return _is_tfpar_strategy(callback.model.distribute_strategy)


def _backup_files(callback):
    """(path, previous-backup path) of the weights and the metadata."""
    return [(internals.attr(callback, "_weights_path"),
             internals.attr(callback, "_prev_weights_path")),
            (internals.attr(callback, "_training_metadata_path"),
             internals.attr(callback, "_prev_training_metadata_path"))]


def _finish_backup(callback):
    import tensorflow as tf

    marker = tf.io.gfile.join(callback.backup_dir, _COMMIT)
    committed = tf.io.gfile.exists(marker)
    for path, previous in _backup_files(callback):
        if not tf.io.gfile.exists(_new(path)):
            continue
        if not committed:
            tf.io.gfile.remove(_new(path))
            continue
        # Repeated after a kill here: the old file stays until the rename replaces it.
        if callback.double_checkpoint and tf.io.gfile.exists(path):
            tf.io.gfile.copy(path, previous, overwrite=True)
        tf.io.gfile.rename(_new(path), path, overwrite=True)
    if committed:
        tf.io.gfile.remove(marker)


def _saved_whole(save_model):
    def wrapper(self):
        if not _is_tfpar_model(self):
            return save_model(self)
        import tensorflow as tf

        files = _backup_files(self)
        names = ["_weights_path", "_training_metadata_path"]
        double = self.double_checkpoint
        try:  # Keras writes its own format, to the new names; _finish_backup keeps .bkp.
            for name, (path, _) in zip(names, files):
                internals.set_attr(self, name, _new(path))
            self.double_checkpoint = False
            save_model(self)
        finally:
            for name, (path, _) in zip(names, files):
                internals.set_attr(self, name, path)
            self.double_checkpoint = double
        marker = tf.io.gfile.join(self.backup_dir, _COMMIT)
        with tf.io.gfile.GFile(_new(marker), "w") as f:
            f.write("committed\n")
        tf.io.gfile.rename(_new(marker), marker, overwrite=True)
        _finish_backup(self)
    return wrapper


def _finishing_backups(on_train_begin):
    def wrapper(self, logs=None):
        if _is_tfpar_model(self) and not _is_non_chief_worker(self):
            _finish_backup(self)
        return on_train_begin(self, logs)
    return wrapper


def _weights_through_a_file(is_memory_sufficient):
    """saving_lib.is_memory_sufficient: False for a model of a tfpar strategy. Keras builds a
    `.keras` file's weights in memory (io.BytesIO) when psutil reports room for them; a
    sharded or remote-stage model's weights are fetched one variable at a time so that no
    process holds them all, and psutil does not see a memory cgroup's limit (measured: the
    capped ZeRO-3 test's model.save killed both workers). Keras' other path writes them to a
    temporary file beside the target, one variable at a time."""
    def wrapper(model):
        if _is_tfpar_strategy(getattr(model, "distribute_strategy", None)):
            return False
        return is_memory_sufficient(model)
    return wrapper


def install_streamed_saving():
    """`model.save("*.keras")` of a tfpar model writes its weights through a file. Idempotent."""
    saving_lib = internals.symbol("keras.src.saving.saving_lib")
    _wrap_once(saving_lib, "is_memory_sufficient", _weights_through_a_file,
               "_tfpar_weights_through_a_file")


def install_crash_safe_backups():
    """BackupAndRestore under tfpar's strategies commits each backup whole, and their
    `.keras` files' weights go through a file. Idempotent."""
    import keras

    install_streamed_saving()

    _wrap_once(keras.callbacks.BackupAndRestore, "_save_model", _saved_whole,
               "_tfpar_saved_whole")
    _wrap_once(keras.callbacks.BackupAndRestore, "on_train_begin", _finishing_backups,
               "_tfpar_finishing_backups")


def install_multi_worker_callbacks():
    """Makes Keras' file-writing callbacks write on the chief only, BackupAndRestore's
    backups crash-safe, and a resumed run take the chief's restored state on every worker
    (no shared filesystem needed). Idempotent."""
    import keras

    internals.attr(keras.callbacks.BackupAndRestore, "_load_model")
    install_crash_safe_backups()  # First: the chief-only check wraps the crash-safe save.
    for cls, name in [(keras.callbacks.BackupAndRestore, "_save_model"),
                      (keras.callbacks.BackupAndRestore, "on_train_end"),
                      (keras.callbacks.ModelCheckpoint, "_save_model")]:
        _wrap_once(cls, name, _chief_only, "_tfpar_chief_only")
    _wrap_once(keras.callbacks.BackupAndRestore, "_load_model", _restored_by_the_chief,
               "_tfpar_restored_by_the_chief")


def _explaining_cluster_errors(method):
    def wrapper(self, *args, **kwargs):
        import contextlib

        import tensorflow as tf

        # A strategy that can tell a task gone silent (a pipeline's stage workers) watches
        # while the call runs: TensorFlow would wait for such a task without end.
        watching = hooks_of(self.distribute_strategy)._tfpar_watching
        try:
            with watching() if watching is not None else contextlib.nullcontext():
                return method(self, *args, **kwargs)
        except tf.errors.OpError as error:
            # A timed-out collective (multi-worker strategies), or a lost task that held
            # part of the model (a pipeline's stage worker): the strategy says which.
            hooks = hooks_of(self.distribute_strategy)
            explainers = [hooks._tfpar_explain_lost_task]
            if isinstance(error, tf.errors.DeadlineExceededError):
                explainers.insert(0, hooks._tfpar_explain_timeout)
            for explain in explainers:
                explained = explain(error) if explain is not None else None
                if explained is not None:
                    raise explained from error
            raise
    return wrapper


def install_cluster_error_explanation():
    """Under a tfpar strategy whose training spans processes, fit, evaluate and predict end
    with a ClusterError that names the tasks at fault and says what to do: for a timed-out
    collective, the workers that did not arrive; for a lost task (a pipeline stage worker
    that died), that task and how to resume. Idempotent."""
    trainer = internals.symbol("keras.src.backend.tensorflow.trainer.TensorFlowTrainer")
    for name in ("fit", "evaluate", "predict"):
        _wrap_once(trainer, name, _explaining_cluster_errors, "_tfpar_explains_cluster_errors")


def install_exact_replicas():
    """Keras' loss normalization, BatchNorm statistics and gradient accumulation made exact,
    and jit_compile refused clearly, under tfpar's strategies (`tfpar.keras.replicas`).
    Idempotent."""
    from tfpar.keras import replicas

    for owner, name, wrap in replicas.patches():
        _wrap_once(owner, name, wrap, "_tfpar_exact_replicas")
    install_model_call_hook()  # (jit_compile=True: the compiled calls, `xla_calls`.)


def install_sharded_optimizers():
    """Keras optimizers keep and update their state sharded under
    `DataParallelStrategy(shard=...)` (`tfpar.keras.zero_optimizers`). Idempotent."""
    from tfpar.keras import zero_optimizers as sharded

    for owner, name, wrap in sharded.patches():
        _wrap_once(owner, name, wrap, "_tfpar_sharded")


def install_parameter_server_training():
    """Makes Keras' fit/evaluate/predict work under tfpar.ParameterServerStrategy."""
    from tfpar.keras import ps_adapters as keras_parameter_server

    for owner, name, wrap in keras_parameter_server.patches():
        _wrap_once(owner, name, wrap, "_tfpar_parameter_server")


# --- Variables born on their device -------------------------------------------------
# A strategy that places layers decides where each Keras variable gets its storage, and
# may keep it without storage until the model is placed (`tfpar.keras.variable_birth`).

def install_variable_births():
    """Keras variables ask a placing strategy in scope where they are born. Idempotent."""
    from tfpar.keras import variable_birth

    for owner, name, wrap in variable_birth.patches():
        _wrap_once(owner, name, wrap, "_tfpar_variable_birth")


# --- Model parallelism -------------------------------------------------------------
# A strategy that places layers (ModelParallelStrategy) must see a model before it
# first runs, and Keras offers no hook for that: tfpar wraps `keras.Model.__call__`
# once. The wrapper only asks the model's strategy, if it defines
# `_tfpar_before_model_call(model, args, kwargs)`; other models pay one getattr.

def install_model_call_hook():
    """Lets a strategy act before each call of a model created under its scope, and runs a
    replica's call of a model compiled per replica (`tfpar.keras.xla_calls`). Idempotent."""
    import keras

    from tfpar.keras import xla_calls

    def wrap(model_call):
        def __call__(self, *args, **kwargs):
            hook = hooks_of(internals.attr(self, "_distribute_strategy"))._tfpar_before_model_call
            if hook is not None:
                hook(self, args, kwargs)
            if xla_calls.applies(self):
                return xla_calls.call(self, model_call, args, kwargs)
            return model_call(self, *args, **kwargs)
        return __call__

    _wrap_once(keras.Model, "__call__", wrap, "_tfpar_model_call_hook")


# --- Pipeline training -------------------------------------------------------------
# A pipeline interleaves the forward and backward passes of micro-batches, which a
# model call followed by one gradient tape cannot express: the strategy must build
# the whole training step. Keras' fit/train_on_batch call `model.train_step(data)`;
# tfpar wraps `keras.Model.train_step` once, and the wrapper hands the step to the
# model's strategy if it defines `_tfpar_train_step(model, data)`. Models whose class
# overrides `train_step` keep their own.

def install_train_step_hook():
    """Lets a strategy build the train step of models created under its scope. Idempotent."""
    import keras

    def wrap(train_step):
        def wrapper(self, data):
            step = hooks_of(internals.attr(self, "_distribute_strategy"))._tfpar_train_step
            if step is not None:
                return step(self, data)
            return train_step(self, data)
        return wrapper

    _wrap_once(keras.Model, "train_step", wrap, "_tfpar_train_step_hook")
