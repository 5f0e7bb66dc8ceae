"""The Keras seam: file-writing callbacks write on the chief only."""

import types

import keras

from tfpar.contract import StrategyHooks
from tfpar.keras import hooks as keras_seam


def _callback(multi_worker, chief):
    extended = types.SimpleNamespace(should_checkpoint=chief)
    strategy = type("Strategy", (StrategyHooks,), {"_tfpar_multi_worker": multi_worker,
                                                   "extended": extended})()
    callback = keras.callbacks.Callback()
    callback._model = types.SimpleNamespace(distribute_strategy=strategy)
    return callback


def test_only_non_chief_workers_of_tfpar_strategies_skip_writes():
    assert keras_seam._is_non_chief_worker(_callback(True, chief=False))
    assert not keras_seam._is_non_chief_worker(_callback(True, chief=True))
    assert not keras_seam._is_non_chief_worker(_callback(False, chief=False))


def test_install_wraps_once():
    keras_seam.install_multi_worker_callbacks()
    first = keras.callbacks.BackupAndRestore._save_model
    keras_seam.install_multi_worker_callbacks()
    assert keras.callbacks.BackupAndRestore._save_model is first
    assert first._tfpar_chief_only and keras.callbacks.ModelCheckpoint._save_model._tfpar_chief_only
    calls = []
    wrapped = keras_seam._chief_only(lambda self: calls.append(1) or "saved")
    assert wrapped(_callback(True, chief=False)) is None and calls == []
    assert wrapped(_callback(True, chief=True)) == "saved" and calls == [1]


def test_the_train_step_hook_is_not_mistaken_for_a_users_override():
    """Once a PipelineStrategy exists, keras.Model.train_step is tfpar's wrapper: the
    parameter-server loops then took every model for one that overrides train_step (and
    lost sharded-variable training)."""
    from tfpar.keras import ps_adapters as parameter_server, steps

    keras_seam.install_train_step_hook()
    assert keras.Model.train_step._tfpar_train_step_hook

    class Own(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    plain = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert steps.is_keras_train_step(keras.Model.train_step)
    assert not parameter_server.overrides_train_step(plain)
    inputs = keras.Input((2,))
    assert parameter_server.overrides_train_step(Own(inputs, keras.layers.Dense(1)(inputs)))


def test_every_patch_can_be_removed_and_stock_keras_comes_back():
    """tfpar replaces Keras and TensorFlow attributes (wraps, and keras.distribution's
    backend functions) through one ledger; `hooks.remove_patches()` undoes them all."""
    import json
    import os
    import subprocess
    import sys

    worker = os.path.join(os.path.dirname(__file__), "..", "workers", "remove_patches.py")
    done = subprocess.run([sys.executable, worker], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["attributes"] > 40 and result["undone"] == result["replaced"], result
    # The placed layers' and the pipelined model's own `call`s (per-object patches) too.
    assert result["own_calls"] >= 3 and result["own_calls_after"] == 0, result
    assert result["restored"] and result["stock_equal"], result
