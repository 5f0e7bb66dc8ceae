"""A worker of the multi-worker ZeRO test: trains with DataParallelStrategy(shard=...).

(One multi-worker strategy per process: TensorFlow configures collectives once; each
optimizer of `--optimizers` trains a model of its own under it, in turn.)
For each optimizer: fit 2 epochs with a BackupAndRestore kept on disk and a ModelCheckpoint
of each epoch (<out>/<shard>-<optimizer>-<epoch>.keras), save the weights and the model
(`save_weights`, `model.save`: the chief to <out>, the others to a temporary path, as every
worker must save sharded state together) and Keras' sharded weights
(<out>/<shard>-<optimizer>.weights.json, every worker the same path: each writes the state it
owns), then resume a fresh model from the backup for a third epoch. First, a larger MLP saved
in that format is loaded back: <out>/<task>-mlp-<shard>.json (bytes read, bytes kept).
Writes <out>/<task>-<shard>-<optimizer>.npz (weights after 2 and 3 epochs, then the
resumed model's predictions) and .json (bytes held, the resumed model's evaluated loss).
"""

import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import multi_worker_common as common  # noqa: E402


def _read_bytes():
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["rchar"])


def _loads_what_it_keeps(strategy, out, name, shard):
    """An MLP of ~0.5M parameters (values far larger than the files' metadata) saved in
    Keras' sharded format by its owners, then loaded into a fresh model under the same
    strategy: the bytes of the values this process took from the files (h5py's reads, as
    Keras' reader takes a value) and of its read system calls, against the bytes of values
    it keeps (its memory report); both models' next step on the same batch."""
    import h5py
    import keras
    import tensorflow as tf

    def mlp():
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = keras.Sequential([keras.Input((128,))] + [
                keras.layers.Dense(384, activation="relu", name=f"hidden_{i}")
                for i in range(3)] + [keras.layers.Dense(3, name="head")])
            model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
            model.optimizer.build(model.trainable_variables)
        return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 128)).astype("float32")
    y = (np.arange(16) % 3).astype("int32")
    batch = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    saved = mlp()
    saved.fit(batch, verbose=0)
    path = os.path.join(out, f"mlp-{shard}.weights.json")
    saved.save_weights(path, max_shard_size=1)
    loaded = mlp()
    values_read = []
    array = h5py.Dataset.__array__

    def read_whole(dataset, *args, **kwargs):  # (How Keras' reader takes a value.)
        values_read.append(dataset.nbytes)
        return array(dataset, *args, **kwargs)

    h5py.Dataset.__array__ = read_whole
    before = _read_bytes()
    try:
        loaded.load_weights(path)
    finally:
        h5py.Dataset.__array__ = array
    read = _read_bytes() - before
    report = strategy.memory_report(loaded)
    for model in (saved, loaded):  # Equal next steps: the weights and Adam's state loaded.
        model.fit(batch, verbose=0)
    np.savez(os.path.join(out, f"{name}-mlp-{shard}.npz"),
             *saved.get_weights(), *loaded.get_weights())
    return {"load_read": read, "values_read": sum(values_read),
            "values": len(values_read), "load_kept": report.devices[0].weights
            + report.devices[0].optimizer, "weights": report.devices[0].weights,
            "optimizer": report.devices[0].optimizer}


def main(out, backups, shard, optimizers, bytes_per_pack):
    import keras
    import tensorflow as tf

    import tfpar

    task = json.loads(os.environ["TF_CONFIG"])["task"]
    name = f"{task['type']}-{task['index']}"
    strategy = tfpar.DataParallelStrategy(shard=shard, timeout_seconds=60,  # Before any TF op.
                                          bytes_per_pack=bytes_per_pack)
    x, y = common.data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(common.GLOBAL_BATCH)
    with open(os.path.join(out, f"{name}-mlp-{shard}.json"), "w") as f:
        json.dump(_loads_what_it_keeps(strategy, out, name, shard), f)
    for optimizer in optimizers.split(","):
        backup_dir = os.path.join(backups, f"{shard}-{optimizer}")

        def fit(epochs):
            with strategy.scope():
                model = common.model()
                model.compile(common.optimizer(optimizer), common.loss())
            model.fit(dataset, epochs=epochs, verbose=0, callbacks=[
                keras.callbacks.BackupAndRestore(backup_dir, delete_checkpoint=False),
                keras.callbacks.ModelCheckpoint(
                    os.path.join(out, f"{shard}-{optimizer}-{{epoch}}.keras"))])
            return model

        model = fit(2)
        report = strategy.memory_report(model)
        chief = strategy.cluster_resolver.task_id == 0
        where = out if chief else tempfile.mkdtemp()
        model.save_weights(os.path.join(where, f"{shard}-{optimizer}.weights.h5"))
        model.save(os.path.join(where, f"{shard}-{optimizer}.keras"))
        # Keras' sharded format: every worker the same path, each writing what it owns.
        model.save_weights(os.path.join(out, f"{shard}-{optimizer}.weights.json"),
                           max_shard_size=1)
        resumed = fit(3)  # From the backup of epoch 2: one more epoch.
        # (Under shard="parameters" get_weights fetches each variable from its owner: every
        # worker asks, in the same order.)
        np.savez(os.path.join(out, f"{name}-{shard}-{optimizer}.npz"),
                 *model.get_weights(), *resumed.get_weights(),
                 resumed.predict(x, batch_size=common.GLOBAL_BATCH, verbose=0))
        loss = resumed.evaluate(dataset, verbose=0)
        with open(os.path.join(out, f"{name}-{shard}-{optimizer}.json"), "w") as f:
            json.dump({"strategy": repr(strategy),
                       "optimizer_bytes": [d.optimizer for d in report.devices],
                       "weight_bytes": [d.weights for d in report.devices],
                       "resumed_iterations": int(resumed.optimizer.iterations.numpy()),
                       "resumed_loss": float(loss)}, f)


if __name__ == "__main__":
    args = dict(a.lstrip("-").split("=", 1) for a in sys.argv[1:])
    main(args["out"], args["backups"], args["shard"], args["optimizers"],
         int(args["bytes_per_pack"]))
