"""A small Llama-shaped decoder trained on long sequences, each split over C worker processes
(context parallelism: `tfpar.DataParallelStrategy(context_parallel=C)`).

    python examples/long_context.py --length=8192                       # one process, C = 1
    tfpar launch --workers 2 -- python examples/long_context.py --length=8192      # C = 2
    tfpar launch --workers 4 -- python examples/long_context.py --length=8192      # C = 4
    tfpar launch --workers 4 --memory_cap 1.5GiB -- python examples/long_context.py ...

Every worker reads the same batches and keeps 2 of the 2C chunks of each sequence; attention
gathers the keys and values of the whole sequence from the others. The task is to continue a
sequence that repeats a block of distinct tokens. Each worker
prints the tokens per second it trained on (the whole sequence's tokens: every worker works on
all of them together), the loss, and its memory peaks (TensorFlow's allocator, the process's
resident set). `benchmarks/long_context.py` finds the longest length under a cap.
"""

import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

import tfpar  # noqa: E402  (cheap: TensorFlow is imported on first use)

flags.DEFINE_integer("length", 8192, "Tokens per sequence (a multiple of 2 x workers).")
flags.DEFINE_integer("hidden", 64, "Hidden size of the decoder (4 query, 2 key/value heads).")
flags.DEFINE_integer("layers", 2, "Decoder blocks.")
flags.DEFINE_integer("batch", 1, "Sequences per step.")
flags.DEFINE_integer("steps", 4, "Steps to train (after one traced step).")
flags.DEFINE_integer("vocabulary", 256, "Vocabulary size.")
FLAGS = flags.FLAGS


def repeated_blocks(steps, batch, length, vocabulary, block=64, seed=0):
    """Token sequences that repeat one random block of distinct tokens, each starting at
    another place in it, and the next token of each."""
    import numpy as np

    rng = np.random.default_rng(seed)
    pattern = rng.permutation(np.arange(1, vocabulary))[:block]
    starts = rng.integers(0, block, size=steps * batch)
    positions = (starts[:, None] + np.arange(length + 1)[None, :]) % block
    tokens = pattern[positions].astype("int32")
    return ({"token_ids": tokens[:, :-1], "padding_mask": np.ones_like(tokens[:, :-1])},
            tokens[:, 1:])


def decoder(length):
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=FLAGS.vocabulary, num_layers=FLAGS.layers, num_query_heads=4,
        num_key_value_heads=2, hidden_dim=FLAGS.hidden, intermediate_dim=2 * FLAGS.hidden)
    inputs = {k: keras.Input((length,), dtype="int32", name=k) for k in backbone.input}
    model = keras.Model(inputs, keras.layers.Dense(FLAGS.vocabulary)(backbone(inputs)))
    model.compile(keras.optimizers.Adam(3e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def main(_):
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    workers = len(config.get("cluster", {}).get("worker", [])) or 1
    task = config.get("task", {"type": "worker", "index": 0})
    strategy = tfpar.DataParallelStrategy(context_parallel=workers)
    x, y = repeated_blocks(FLAGS.steps + 1, FLAGS.batch, FLAGS.length, FLAGS.vocabulary)
    with strategy.scope():
        model = decoder(FLAGS.length)
    first = {k: v[:FLAGS.batch] for k, v in x.items()}
    model.fit(first, y[:FLAGS.batch], batch_size=FLAGS.batch, verbose=0)  # Traced.
    tfpar.reset_memory_peaks()
    rest = {k: v[FLAGS.batch:] for k, v in x.items()}
    start = time.perf_counter()
    losses = model.fit(rest, y[FLAGS.batch:], batch_size=FLAGS.batch, epochs=1,
                       verbose=0).history["loss"]
    seconds = time.perf_counter() - start
    tokens = FLAGS.steps * FLAGS.batch * FLAGS.length
    print(f"context_parallel={workers}, {task['type']} {task['index']}: {FLAGS.length} tokens "
          f"per sequence, {tokens / seconds:.0f} tokens/s, loss {losses[-1]:.3f}; "
          f"{tfpar.process_memory().format()}", flush=True)


if __name__ == "__main__":
    app.run(main)
