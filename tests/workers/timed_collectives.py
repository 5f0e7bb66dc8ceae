"""A worker of the collective-timeout test: a multi-worker fit of many small steps under the
default timeout, writing how many threads the process gained.

    python timed_collectives.py --out=DIR --shard=gradients|none --steps=N
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(out, shard, steps):
    import keras
    import numpy as np
    import tensorflow as tf

    import tfpar

    strategy = tfpar.DataParallelStrategy(shard=None if shard == "none" else shard)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(3)])
        model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    x = np.random.default_rng(0).normal(size=(8 * steps, 4)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, np.arange(8 * steps) % 3)).batch(8)

    def threads():
        return len(os.listdir("/proc/self/task"))

    model.fit(dataset.take(2), verbose=0)  # Traced, and TensorFlow's pools started.
    before = threads()
    model.fit(dataset, verbose=0)
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    with open(os.path.join(out, f"{task['type']}-{task['index']}.json"), "w") as f:
        json.dump({"threads_gained": threads() - before,
                   "steps": int(model.optimizer.iterations.numpy()) - 2}, f)


if __name__ == "__main__":
    args = dict(a.lstrip("-").split("=", 1) for a in sys.argv[1:])
    main(args["out"], args.get("shard", "none"), int(args.get("steps", 512)))
