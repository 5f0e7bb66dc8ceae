"""A worker of the multi-worker conformance test (tests/conformance/).

Run as one task of a TF_CONFIG cluster (tests/cluster_helper.py). One multi-worker
DataParallelStrategy runs the conformance features named by --features one after another
(tests/conformance/harness.py), then trains one epoch on TFRecord files (--files) twice, in
file order and with a seeded shuffle, recording the ids of the examples this worker trained on.

Writes <out>/<task>-<feature>.pkl (a harness.Result, or {"error": ...}) and
<out>/<task>-files.json ({variant: [ids]}); then <out>/<task>.done.
"""

import json
import os
import pickle
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "conformance"))


def file_dataset(files, shuffle_seed=None, batch=16):
    import tensorflow as tf

    spec = {"x": tf.io.FixedLenFeature([4], tf.float32), "y": tf.io.FixedLenFeature([], tf.int64),
            "id": tf.io.FixedLenFeature([], tf.int64)}

    def parse(record):
        example = tf.io.parse_single_example(record, spec)
        return {"x": example["x"], "id": example["id"]}, example["y"]

    names = tf.data.Dataset.list_files(os.path.join(files, "*.tfrecord"), shuffle=False)
    dataset = names.interleave(tf.data.TFRecordDataset, cycle_length=2).map(parse)
    if shuffle_seed is not None:
        dataset = dataset.shuffle(64, seed=shuffle_seed)
    return dataset.batch(batch)


def train_on_files(strategy, files, shuffle_seed):
    """One epoch of fit on the files; returns the ids this worker's replica trained on."""
    import keras
    import tensorflow as tf

    seen = []

    def record(ids):
        seen.extend(int(i) for i in ids.numpy())
        return 0

    class Recording(keras.Model):
        def train_step(self, data):
            x, y = data
            tf.py_function(record, [x["id"]], tf.int32)
            return super().train_step(data)

    with strategy.scope():
        keras.utils.set_random_seed(0)
        x = keras.Input((4,), name="x")
        ids = keras.Input((), dtype="int64", name="id")
        h = keras.layers.Dense(8, activation="tanh")(x)
        model = Recording({"x": x, "id": ids}, keras.layers.Dense(3)(h))
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(file_dataset(files, shuffle_seed), epochs=1, verbose=0)
    return seen


def main(out, features, files):
    import tfpar

    import harness

    strategy = tfpar.DataParallelStrategy(timeout_seconds=60)
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    name = f"{task['type']}-{task['index']}"
    for feature in features:
        try:
            result = harness.run("mw2", harness.FEATURES[feature], strategy=strategy)
        except Exception as error:  # noqa: BLE001 - recorded for the test to report
            result = {"error": f"{type(error).__name__}: {error}",
                      "types": [c.__name__ for c in type(error).__mro__],
                      "iterations_run": getattr(error, "iterations_run", None),
                      "traceback": traceback.format_exc()[-3000:]}
        with open(os.path.join(out, f"{name}-{feature}.pkl"), "wb") as f:
            pickle.dump(result, f)
        print(f"feature done: {feature}", flush=True)
    if files:
        seen = {"in_order": train_on_files(strategy, files, None),
                "shuffled": train_on_files(strategy, files, 7)}
        with open(os.path.join(out, f"{name}-files.json"), "w") as f:
            json.dump(seen, f)
    open(os.path.join(out, f"{name}.done"), "w").close()


if __name__ == "__main__":
    args = dict(a.lstrip("-").split("=", 1) for a in sys.argv[1:])
    main(args["out"], [f for f in args.get("features", "").split(",") if f],
         args.get("files"))
