"""Trains a Megatron MLP block (column- then row-parallel Dense) on each mesh shape named
in argv ("1,2": tensor parallel; "2,1": data parallel; "2,2": both; "gemma": a keras-hub
Gemma forward pass instead), marking each phase
on stderr ("PHASE <shape> <name>"), for a test that reads the collectives TensorFlow logs
launching in each (TF_CPP_VMODULE=collective_ops=1: group, shape and device of each)."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import tfpar  # noqa: E402


def phase(shape, name):
    sys.stderr.flush()
    print(f"PHASE {shape} {name}", file=sys.stderr, flush=True)


def run(keras, tf, spec):
    shape = tuple(int(n) for n in spec.split(","))
    mesh = keras.distribution.DeviceMesh(
        shape, ["batch", "model"], keras.distribution.list_devices()[:int(np.prod(shape))])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*up/kernel"] = (None, "model")
    layout_map[".*up/bias"] = ("model",)
    layout_map[".*down/kernel"] = ("model", None)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="embed"),
                              keras.layers.Dense(32, activation="relu", name="up"),
                              keras.layers.Dense(8, name="down")])
    model.compile("sgd", "mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 8)).astype("float32"), rng.normal(size=(16, 8)).astype("float32")
    phase(spec, "warmup")  # Traces and runs each step once.
    model.predict_on_batch(x)
    model.train_on_batch(x, y)
    tf.test.experimental.sync_devices()
    phase(spec, "forward")
    model.predict_on_batch(x)
    tf.test.experimental.sync_devices()
    phase(spec, "train")
    model.train_on_batch(x, y)
    tf.test.experimental.sync_devices()
    phase(spec, "end")
    keras.distribution.set_distribution(None)


def gemma(keras, tf):
    """A keras-hub GemmaBackbone (2 decoder blocks, a small config) on a (1, 2) mesh laid
    out by its own get_layout_map: one forward pass."""
    import keras_hub

    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"],
                                         keras.distribution.list_devices()[:2])
    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh)))
    keras.utils.set_random_seed(0)
    model = keras_hub.models.GemmaBackbone(
        vocabulary_size=32, num_layers=2, num_query_heads=2, num_key_value_heads=2,
        hidden_dim=16, intermediate_dim=32, head_dim=8)
    rng = np.random.default_rng(0)
    inputs = {"token_ids": rng.integers(1, 32, (4, 6)).astype("int32"),
              "padding_mask": np.ones((4, 6), "int32")}
    phase("gemma", "warmup")
    model.predict(inputs, verbose=0)
    tf.test.experimental.sync_devices()
    phase("gemma", "forward")
    model.predict(inputs, verbose=0)
    tf.test.experimental.sync_devices()
    phase("gemma", "end")
    keras.distribution.set_distribution(None)


def main():
    tfpar.virtual_cpus(4)
    import keras
    import tensorflow as tf

    tfpar.use_keras_distribution()
    for spec in sys.argv[1:]:
        if spec == "gemma":
            gemma(keras, tf)
        else:
            run(keras, tf, spec)


if __name__ == "__main__":
    main()
