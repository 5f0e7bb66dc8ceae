"""A worker of the multi-worker tests: trains a small model with model.fit.

Run under `tfpar launch`; writes <out>/<task>.npz with the final weights and
<out>/<task>.json with history, evaluate and predict results.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import multi_worker_common as common  # noqa: E402


def main(out, epochs, model_dir=None, crash_at=None, timeout=None, examples=common.EXAMPLES,
         optimizer="sgd", own_dirs=False, compression=None, sync_every=1,
         communication="auto", global_batch=common.GLOBAL_BATCH, shard=None,
         jit_compile=False):
    import keras
    import tensorflow as tf

    import tfpar

    keras.config.disable_traceback_filtering()
    strategy = tfpar.DataParallelStrategy(timeout_seconds=timeout, compression=compression,
                                          sync_every=sync_every, communication=communication,
                                          shard=shard)
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    name = f"{task['type']}-{task['index']}"
    print(f"PID {os.getpid()}", flush=True)
    if model_dir and own_dirs:  # As on machines that share no filesystem.
        model_dir = os.path.join(model_dir, name)
    x, y = common.data(examples)
    with strategy.scope():
        model = common.model()
        model.compile(common.optimizer(optimizer), common.loss(), metrics=["accuracy"],
                      jit_compile=jit_compile)
    callbacks = [common.SlowDown()]
    if model_dir:
        callbacks.append(keras.callbacks.BackupAndRestore(os.path.join(model_dir, "backup")))
    if crash_at is not None and task["index"] == 1:
        callbacks.append(common.CrashAt(crash_at))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    history = model.fit(dataset, epochs=epochs, verbose=2, callbacks=callbacks)
    loss, accuracy = model.evaluate(dataset, verbose=0)
    predictions = model.predict(dataset, verbose=0)
    if model_dir and strategy.cluster_resolver.task_id == 0:
        model.save(os.path.join(model_dir, "model.keras"))
    np.savez(os.path.join(out, f"{name}.npz"), *model.get_weights())
    group_sizes = _all_reduce_group_sizes(strategy)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump({"epochs_run": len(history.history["loss"]), "loss": loss,
                   "predictions_shape": list(predictions.shape),
                   "iterations": int(model.optimizer.iterations.numpy()),
                   "strategy": repr(strategy), "all_reduce_group_sizes": group_sizes}, f)


def _all_reduce_group_sizes(strategy):
    """The group sizes of the collectives that sum a replica's tensor, read in the traced
    all-reduce (which every worker then runs): the workers' count for TensorFlow's ring,
    smaller groups for tfpar's halving-doubling pairs or hierarchy."""
    import tensorflow as tf

    @tf.function
    def all_reduce():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, tf.ones([64])))

    graph = all_reduce.get_concrete_function().graph
    sizes = {int(tf.get_static_value(op.inputs[1])) for op in graph.get_operations()
             if op.type in ("CollectiveReduceV2", "CollectiveGatherV2")}
    all_reduce()
    return sorted(sizes)


if __name__ == "__main__":
    args = dict(a.lstrip("-").split("=", 1) for a in sys.argv[1:])
    main(args["out"], int(args.get("epochs", 2)), args.get("model_dir"),
         int(args["crash_at"]) if "crash_at" in args else None,
         float(args["timeout"]) if "timeout" in args else None,
         int(args.get("examples", common.EXAMPLES)), args.get("optimizer", "sgd"),
         args.get("own_dirs") == "1", args.get("compression"), int(args.get("sync_every", 1)),
         args.get("communication", "auto"), int(args.get("global_batch", common.GLOBAL_BATCH)),
         args.get("shard"), args.get("jit_compile") == "1")
