"""A worker of the context-parallel tests and benchmark, run under `tfpar launch --workers C`
(one CPU device per worker), or alone (C = 1, no strategy):

    python context_parallel.py --out=DIR [--model=attention|llama] [--length=N] [--steps=S]
                               [--hidden=H] [--layers=K]

`attention`: the causal attention model of the tests (multi_worker_common), fit for 2 epochs,
then evaluated and predicted. `llama`: a keras-hub Llama-shaped decoder (hidden H, K blocks,
4 query and 2 key/value heads, a Dense head) trained S steps on sequences of N tokens (batch 1).
Every sequence is split over the C workers (`DataParallelStrategy(context_parallel=C)`).
Writes DIR/<task>.json (the loss history, TensorFlow's allocator peak and the resident peak
over training, steps per second) and DIR/<task>.npz (the weights, then the predictions).
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import multi_worker_common as common  # noqa: E402


def llama(length, hidden, layers):
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=256, num_layers=layers, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=hidden, intermediate_dim=2 * hidden)
    inputs = {k: keras.Input((length,), dtype="int32", name=k) for k in backbone.input}
    model = keras.Model(inputs, keras.layers.Dense(256)(backbone(inputs)))
    model.compile(keras.optimizers.SGD(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def main(out, model="attention", length=common.SEQUENCE_LENGTH, steps=2, hidden=64,
         layers=2):
    import tensorflow as tf

    import tfpar

    config = os.environ.get("TF_CONFIG")
    task = json.loads(config)["task"] if config else {"type": "worker", "index": 0}
    name = f"{task['type']}-{task['index']}"
    strategy = (tfpar.DataParallelStrategy(context_parallel=len(json.loads(config)["cluster"]
                                                                ["worker"]))
                if config else tf.distribute.get_strategy())
    tfpar.reset_memory_peaks()
    if model == "attention":
        x, y = common.sequence_data()
        with strategy.scope():
            network = common.causal_attention_model()
        start = time.perf_counter()
        history = network.fit(x, y, batch_size=common.SEQUENCE_BATCH, epochs=2, shuffle=False,
                              verbose=0).history
        seconds = time.perf_counter() - start
        evaluated = network.evaluate(x, y, batch_size=common.SEQUENCE_BATCH, verbose=0)
        predictions = network.predict(x, batch_size=common.SEQUENCE_BATCH, verbose=0)
    else:
        rng = np.random.default_rng(0)
        tokens = rng.integers(1, 256, size=(steps, length)).astype("int32")
        x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
        y = np.roll(tokens, -1, axis=1)
        with strategy.scope():
            network = llama(length, hidden, layers)
        network.fit(x, y, batch_size=1, epochs=1, steps_per_epoch=1, verbose=0)  # (Traced.)
        start = time.perf_counter()
        history = network.fit(x, y, batch_size=1, epochs=1, verbose=0).history
        seconds = (time.perf_counter() - start) / steps
        evaluated, predictions = None, np.zeros(0)
    memory = tfpar.process_memory()
    np.savez(os.path.join(out, f"{name}.npz"), *network.get_weights(), predictions)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump({"strategy": repr(strategy), "loss": history["loss"],
                   "evaluated": evaluated, "predictions_shape": list(predictions.shape),
                   "allocator_peak": memory.allocator_peak_bytes,
                   "resident_peak": memory.rss_peak_bytes,
                   "seconds_per_step": seconds, "length": length}, f)


if __name__ == "__main__":
    arguments = dict(a.lstrip("-").split("=", 1) for a in sys.argv[1:])
    main(arguments["out"], arguments.get("model", "attention"),
         int(arguments.get("length", common.SEQUENCE_LENGTH)),
         int(arguments.get("steps", 2)), int(arguments.get("hidden", 64)),
         int(arguments.get("layers", 2)))
