"""The one place where tfpar adapts Keras 3 to its strategies.

Keras 3 callbacks are not multi-worker aware: under a multi-worker strategy every
worker runs `BackupAndRestore` and `ModelCheckpoint`, and all write the same files
(seen here: `FileExistsError` on the backup directory, and h5 files written
concurrently). Weights are identical on every worker, so tfpar lets only the chief
write; every worker still reads the chief's backup when a run resumes.
"""

import functools
import threading

_installed = False
_lock = threading.Lock()


def _is_non_chief_worker(callback):
    strategy = getattr(getattr(callback, "model", None), "distribute_strategy", None)
    extended = getattr(strategy, "extended", None)
    return bool(getattr(strategy, "_tfpar_multi_worker", False)
                and not extended.should_checkpoint)


def _chief_only(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if _is_non_chief_worker(self):
            return None
        return method(self, *args, **kwargs)

    wrapper._tfpar_chief_only = True
    return wrapper


def install_multi_worker_callbacks():
    """Makes Keras' file-writing callbacks write on the chief only. Idempotent."""
    global _installed
    with _lock:
        if _installed:
            return
        import keras

        targets = [(keras.callbacks.BackupAndRestore, "_save_model"),
                   (keras.callbacks.BackupAndRestore, "on_train_end"),
                   (keras.callbacks.ModelCheckpoint, "_save_model")]
        for cls, name in targets:
            method = getattr(cls, name)
            if not getattr(method, "_tfpar_chief_only", False):
                setattr(cls, name, _chief_only(method))
        _installed = True


def install_parameter_server_training():
    """Makes Keras' fit/evaluate/predict work under tfpar.ParameterServerStrategy."""
    from tfpar import keras_parameter_server

    keras_parameter_server.install()


# --- Model parallelism -------------------------------------------------------------
# A strategy that places layers (ModelParallelStrategy) must see a model before it
# first runs, and Keras offers no hook for that: tfpar wraps `keras.Model.__call__`
# once. The wrapper only asks the model's strategy, if it defines
# `_tfpar_before_model_call(model, args, kwargs)`; other models pay one getattr.

def install_model_call_hook():
    """Lets a strategy act before each call of a model created under its scope. Idempotent."""
    with _lock:
        import keras

        if getattr(keras.Model.__call__, "_tfpar_model_call_hook", False):
            return
        model_call = keras.Model.__call__

        @functools.wraps(model_call)
        def __call__(self, *args, **kwargs):
            hook = getattr(getattr(self, "_distribute_strategy", None),
                           "_tfpar_before_model_call", None)
            if hook is not None:
                hook(self, args, kwargs)
            return model_call(self, *args, **kwargs)

        __call__._tfpar_model_call_hook = True
        keras.Model.__call__ = __call__


# --- Pipeline training -------------------------------------------------------------
# A pipeline interleaves the forward and backward passes of micro-batches, which a
# model call followed by one gradient tape cannot express: the strategy must build
# the whole training step. Keras' fit/train_on_batch call `model.train_step(data)`;
# tfpar wraps `keras.Model.train_step` once, and the wrapper hands the step to the
# model's strategy if it defines `_tfpar_train_step(model, data)`. Models whose class
# overrides `train_step` keep their own.

def install_train_step_hook():
    """Lets a strategy build the train step of models created under its scope. Idempotent."""
    with _lock:
        import keras

        if getattr(keras.Model.train_step, "_tfpar_train_step_hook", False):
            return
        train_step = keras.Model.train_step

        @functools.wraps(train_step)
        def wrapper(self, data):
            step = getattr(getattr(self, "_distribute_strategy", None), "_tfpar_train_step", None)
            if step is not None:
                return step(self, data)
            return train_step(self, data)

        wrapper._tfpar_train_step_hook = True
        keras.Model.train_step = wrapper
