"""The chief of the pipeline-checkpoint test, run by `tfpar launch --workers 2 --coordinator`
(the workers serve the stages; this process runs the program):

    python pipeline_checkpoint.py --out=DIR [--tensor_parallel=2]

A 2-stage pipeline over the 2 worker processes (or, with --tensor_parallel=2, one stage whose
Dense layers are split Megatron's way over them) trains 2 steps with Adam, then writes a
`tf.train.Checkpoint` of the model and its optimizer to DIR/ckpt. Writes DIR/result.json:
the bytes each process of the job wrote meanwhile (`/proc/<pid>/io`, the processes found by
the TF_CONFIG in their environment), the bytes of variables on each device, and the largest
difference between the pipeline's weights (and, without tensor parallelism, its optimizer
state) and those a plain Keras model on one device (this process, no strategy) reads back
from the checkpoint, and a fresh pipeline's (weights and optimizer state) restored from it,
and the bytes each process read meanwhile.
"""

import glob
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfpar  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def _processes():
    """{task name: pid} of this job's processes (by the TF_CONFIG in their environment)."""
    found = {}
    for directory in glob.glob("/proc/[0-9]*"):
        try:
            with open(os.path.join(directory, "environ"), "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            task = json.loads(env[b"TF_CONFIG"])["task"]
        except (OSError, KeyError, ValueError):
            continue
        found[f"{task['type']}:{task['index']}"] = int(os.path.basename(directory))
    return found


def _written(pid):
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes"))


def _read(pid):
    with open(f"/proc/{pid}/io") as f:  # (rchar: every read call, the page cache's too.)
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((256,))]
                             + [keras.layers.Dense(512, name=f"hidden_{i}") for i in range(4)]
                             + [keras.layers.Dense(10, name="out")])
    model.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _devices_and_bytes(variable):
    """[(device, bytes)] of `variable`'s storage: its shards' under tensor parallelism."""
    from tfpar.keras import split_variables

    storage = split_variables.sharded_storage(variable)
    parts = storage.shards if storage is not None else [variable]
    return [(part.value.device, int(np.prod(part.shape)) * 4) for part in parts]


def main(out, tensor_parallel=1):
    from tfpar.cli.train import megatron_layout_map

    split = tensor_parallel > 1
    strategy = tfpar.PipelineStrategy(
        num_stages=1 if split else 2, num_micro_batches=2, schedule="1f1b",
        tensor_parallel=tensor_parallel, layout_map=megatron_layout_map(4) if split else None,
        cluster_resolver=tf.distribute.cluster_resolver.TFConfigClusterResolver())
    with strategy.scope():
        model = _model()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 256), dtype=np.float32)
    y = (np.arange(32) % 10).astype("int32")
    for _ in range(2):
        model.train_on_batch(x, y)
    by_stage = {}
    for variable in model.weights + model.optimizer.variables:
        for device, held in _devices_and_bytes(variable):
            by_stage[device] = by_stage.get(device, 0) + held
    pids = _processes()
    before = {name: _written(pid) for name, pid in pids.items()}
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
        os.path.join(out, "ckpt"))
    os.sync()
    written = {name: _written(pid) - before[name] for name, pid in pids.items()}
    weights = model.get_weights()
    plain = _model()  # One device, no strategy.
    if split:  # The optimizer's state is kept per shard: the weights are read whole.
        tf.train.Checkpoint(model=plain).read(path).assert_existing_objects_matched()
        difference = max(float(np.abs(a - b).max())
                         for a, b in zip(weights, plain.get_weights()))
        # Restored into a fresh split model: each shard's slice read by its owner.
        with strategy.scope():
            fresh = _model()
        fresh.train_on_batch(x, y)  # (Built, placed and split; the restore overwrites it.)
        # (A Keras model tracks its optimizer: the read restores Adam's state too.)
        held = {}
        for variable in fresh.weights + fresh.optimizer.variables:
            for device, size in _devices_and_bytes(variable):
                held[device] = held.get(device, 0) + size
        state = [v.numpy() for v in model.optimizer.variables]
        before = {name: _read(pid) for name, pid in pids.items()}
        tf.train.Checkpoint(model=fresh).read(path).assert_existing_objects_matched()
        read = {name: _read(pid) - before[name] for name, pid in pids.items()}
        difference = max(difference, *(float(np.abs(a - b).max()) for a, b in zip(
            weights + state, fresh.get_weights() + [v.numpy() for v in fresh.optimizer.variables])))
    else:
        state = [v.numpy() for v in model.optimizer.variables]
        plain.optimizer.build(plain.trainable_variables)
        tf.train.Checkpoint(model=plain, optimizer=plain.optimizer).read(
            path).assert_consumed()
        difference = max(float(np.abs(a - b).max()) for a, b in zip(
            weights + state,
            plain.get_weights() + [v.numpy() for v in plain.optimizer.variables]))
        # Restored into a fresh pipeline: each worker reads its own stage's values.
        with strategy.scope():
            fresh = _model()
            fresh.optimizer.build(fresh.trainable_variables)
        before = {name: _read(pid) for name, pid in pids.items()}
        tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).read(
            path).assert_consumed()
        read = {name: _read(pid) - before[name] for name, pid in pids.items()}
        difference = max(difference, *(float(np.abs(a - b).max()) for a, b in zip(
            weights + state,
            fresh.get_weights() + [v.numpy() for v in fresh.optimizer.variables])))
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"written": written, "stage_bytes": by_stage, "difference": difference,
                   "read": read, "held": held if split else None,
                   "moved": max(float(np.abs(a - b).max())
                                for a, b in zip(weights, _model().get_weights()))}, f)


if __name__ == "__main__":
    arguments = dict(a.lstrip("-").split("=", 1) for a in sys.argv[1:])
    main(arguments["out"], int(arguments.get("tensor_parallel", 1)))
