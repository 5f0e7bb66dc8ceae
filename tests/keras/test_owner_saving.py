"""Keras' sharded weights format written by several owners (tfpar.keras.owner_saving),
read back by stock Keras on one device. The writers are simulated in this process (each
worker's part written in turn); `tests/distribute/data_parallel/test_multi_worker.py`
writes it from 2 worker processes under ZeRO."""

import json
import pathlib
import zlib

import keras
import numpy as np
import pytest

from tfpar.keras import internals, owner_saving

WRITERS = 3


class _Plan:
    """Writer `me` of WRITERS; each variable written by the writer its path hashes to
    (the same in every run: zlib's hash, not Python's salted one)."""

    def __init__(self, me, everyone):
        self.me, self.writers, self._everyone = me, WRITERS, everyone
        self.agreed = None

    def writer_of(self, value):
        return zlib.crc32(value.path.encode()) % WRITERS if hasattr(value, "path") else 0

    @staticmethod
    def local_value(value):
        return value

    def agree(self, path):
        self.agreed = path

    def done(self, files):
        self._everyone[self.me] = files
        return dict(self._everyone)


def _model(seed):
    keras.utils.set_random_seed(seed)
    # Named: the writers follow the variables' paths, which Keras' automatic names
    # would make depend on the layers made before in this process.
    model = keras.Sequential([keras.Input((6,)),
                              keras.layers.Dense(32, activation="relu", name="hidden"),
                              keras.layers.BatchNormalization(name="norm"),
                              keras.layers.Dense(3, name="head")], name="owned")
    model.compile(keras.optimizers.Adam(0.01, name="adam"), "mse")
    return model


def _trained():
    model = _model(0)
    x = np.random.default_rng(0).normal(size=(64, 6)).astype("float32")
    model.fit(x, x[:, :3], epochs=2, batch_size=16, verbose=0)
    return model


@pytest.mark.skipif(internals.release(keras.version())
                    < internals.release(owner_saving.READS_SPLIT_GROUPS),
                    reason="this Keras refuses it (test_an_older_keras_refuses_it)")
def test_every_writer_writes_its_own_files_and_stock_keras_reads_them_whole(tmp_path):
    model = _trained()
    path = tmp_path / "model.weights.json"
    everyone = {}
    # The chief (0) last: it writes the map once every other writer is done.
    for me in range(WRITERS - 1, -1, -1):
        owner_saving.save(model, path, 2e-6, _Plan(me, everyone))  # ~2 KiB per file
        assert path.exists() == (me == 0)
    files = {me: set(names) for me, names in everyone.items()}
    assert all(files.values()) and not set.intersection(*files.values())
    for me, names in files.items():  # Writer k's files: model_<n>, n = k modulo WRITERS.
        assert all(int(n[len("model_"):-len(".weights.h5")]) % WRITERS == me
                   for n in names), names
    assert max(len(n) for n in files.values()) > 1  # the 2 KiB limit opened more files
    on_disk = {p.name for p in tmp_path.glob("*.weights.h5")}
    assert on_disk == set.union(*files.values())
    weight_map = json.loads(path.read_text())["weight_map"]
    assert {n for v in weight_map.values() for n in ([v] if isinstance(v, str) else v)} \
        == on_disk
    # Some group's variables are spread over several writers' files.
    assert any(isinstance(v, list) for v in weight_map.values())

    loaded = _model(1)
    loaded.optimizer.build(loaded.trainable_variables)
    assert not np.allclose(loaded.get_weights()[0], model.get_weights()[0])
    loaded.load_weights(path)
    for got, want in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=want.path)
    assert int(loaded.optimizer.iterations.numpy()) == 8


def test_the_wrong_name_or_a_remote_path_is_refused_before_anything_is_written(tmp_path):
    model = _trained()
    plan = _Plan(0, {})
    with pytest.raises(ValueError, match=r"named '\*\.weights\.json'"):
        owner_saving.save(model, tmp_path / "model.weights.h5", 1, plan)
    with pytest.raises(ValueError, match="is remote. Mount it"):
        owner_saving.save(model, "gs://bucket/model.weights.json", 1, plan)
    assert plan.agreed is None and not list(tmp_path.iterdir())


def test_an_older_keras_refuses_it(tmp_path, monkeypatch):
    monkeypatch.setattr(keras, "version", lambda: "3.10.0")
    plan = _Plan(0, {})
    with pytest.raises(ValueError, match=r"need Keras >= 3\.11\.0 .* Keras 3\.10\.0. Save to "
                                         r"a '\.weights\.h5' file"):
        owner_saving.save(_trained(), tmp_path / "model.weights.json", 1, plan)
    assert plan.agreed is None and not list(pathlib.Path(tmp_path).iterdir())


def test_a_load_reads_only_the_values_kept_and_checks_the_others_shapes(tmp_path):
    """`owner_saving.load` (ZeRO-3 across workers: weights held on other workers are
    stand-ins) takes from the files only the values of the variables it keeps; the
    stand-ins keep nothing and are not read, but a shape that differs is refused."""
    import h5py

    model = _trained()
    path = tmp_path / "model.weights.json"
    model.save_weights(path, max_shard_size=1)  # (Stock Keras, one writer.)
    loaded = _model(1)
    loaded.optimizer.build(loaded.trainable_variables)
    before = loaded.get_weights()
    elsewhere = {v.path for v in loaded.layers[0].weights}  # "hidden": kernel and bias
    read = []
    array = h5py.Dataset.__array__

    def counted(dataset, *args, **kwargs):
        read.append(dataset.nbytes)
        return array(dataset, *args, **kwargs)

    h5py.Dataset.__array__ = counted
    try:
        owner_saving.load(loaded, path, lambda v: v.path in elsewhere)
    finally:
        h5py.Dataset.__array__ = array
    for variable, old, saved in zip(loaded.weights, before, model.get_weights()):
        np.testing.assert_array_equal(variable.numpy(),
                                      old if variable.path in elsewhere else saved)
    for got, want in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=want.path)
    kept = (sum(v.numpy().nbytes for v in loaded.weights if v.path not in elsewhere)
            + sum(v.numpy().nbytes for v in loaded.optimizer.variables))
    assert sum(read) == kept
    assert loaded.layers[0].kernel.assign.__name__ == "assign"  # (Put back after.)

    narrow = keras.Sequential([keras.Input((6,)),
                               keras.layers.Dense(31, activation="relu", name="hidden"),
                               keras.layers.BatchNormalization(name="norm"),
                               keras.layers.Dense(3, name="head")], name="owned")
    with pytest.raises(ValueError, match=r"shape \(6, 32\); the variable's is \(6, 31\)"):
        owner_saving.load(narrow, path, lambda v: "hidden/" in v.path)
