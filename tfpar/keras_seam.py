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
