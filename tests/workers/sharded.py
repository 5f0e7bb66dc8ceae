"""A worker of the multi-worker ZeRO test: trains with DataParallelStrategy(shard=...).

(One multi-worker strategy per process: TensorFlow configures collectives once; each
optimizer of `--optimizers` trains a model of its own under it, in turn.)
For each optimizer: fit 2 epochs with a BackupAndRestore kept on disk and a ModelCheckpoint
of each epoch (<out>/<shard>-<optimizer>-<epoch>.keras), save the weights and the model
(`save_weights`, `model.save`: the chief to <out>, the others to a temporary path, as every
worker must save sharded state together) and Keras' sharded weights
(<out>/<shard>-<optimizer>.weights.json, every worker the same path: each writes the state it
owns), then resume a fresh model from the backup for a third epoch.
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
