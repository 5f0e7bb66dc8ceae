"""`jit_compile=True` against `jit_compile=False`: Keras `fit` step time on one device and
under `DataParallelStrategy` over 2 logical CPUs (each replica's model call compiled by XLA,
`tfpar.keras.xla_calls`), for a CNN and a transformer block, side by side in one run.

    python benchmarks/xla.py [--rounds=3] [--steps=10]

Each (model, strategy, jit_compile) trains `--steps` timed steps after 2 untimed ones
(tracing and XLA compilation), in `--rounds` rounds whose configurations run in turn (a
slow minute on these shared machines lands on every configuration alike); the median of the
rounds is reported, and the ratio plain / jit per (model, strategy), beside the ratio of the
fastest rounds (these shared machines throttle in slices: whole rounds run slow). The 2-device rows also
report the speedup over one device and the two-matmul-stream ceiling of this machine
(`_common.two_stream_ceiling`: one replica's rows of the block's 128 x 512 product), since 2 vCPUs do not scale as 2 GPUs. Writes
benchmarks/results/xla.json.

What to expect on CPUs: XLA's CPU backend fuses elementwise work into its matmuls and
convolutions but does not use oneDNN's convolution kernels, so a convolution-heavy model can
be slower compiled; the ratio is what this machine measured, not a GPU's.
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import cnn_and_step, command_line, two_stream_ceiling, write_json  # noqa: E402

BATCH = 64


def _transformer_block(length=128, dim=128, heads=4):
    """Embedding + one pre-norm transformer block (MultiHeadAttention, causal; a 4x MLP) +
    a vocabulary head: a decoder block as keras-hub builds it, from Keras layers."""
    import keras

    tokens = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(1000, dim)(tokens)
    a = keras.layers.LayerNormalization()(h)
    a = keras.layers.MultiHeadAttention(heads, dim // heads)(a, a, use_causal_mask=True)
    h = h + a
    f = keras.layers.LayerNormalization()(h)
    f = keras.layers.Dense(4 * dim, activation="gelu")(f)
    h = h + keras.layers.Dense(dim)(f)
    return keras.Model(tokens, keras.layers.Dense(1000)(h))


def _data(kind, n, rng):
    import numpy as np

    if kind == "cnn":
        return (rng.normal(size=(n, 32, 32, 3)).astype("float32"),
                rng.integers(0, 10, size=(n,)).astype("int32"))
    tokens = rng.integers(0, 1000, size=(n, 128)).astype("int32")
    return tokens, np.roll(tokens, -1, axis=1)


def _trainer(kind, devices, jit_compile):
    """A compiled model and its data, ready to `fit` one epoch of `steps` batches."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tfpar

    strategy = (tfpar.DataParallelStrategy([f"/cpu:{i}" for i in range(devices)])
                if devices > 1 else tf.distribute.get_strategy())
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = cnn_and_step(BATCH)[0] if kind == "cnn" else _transformer_block()
        model.compile(keras.optimizers.Adam(1e-4),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=jit_compile)
    return model, _data(kind, BATCH, np.random.default_rng(0))


def _seconds_per_step(model, data, steps):
    import tensorflow as tf

    x, y = data
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    start = time.perf_counter()
    model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0)
    return (time.perf_counter() - start) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--models", default="cnn,transformer")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "xla.json"))
    args = parser.parse_args()

    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    configs = [(kind, devices, jit) for kind in args.models.split(",")
               for devices in (1, 2) for jit in (False, True)]
    trainers = {}
    for config in configs:
        model, data = _trainer(*config)
        _seconds_per_step(model, data, 2)  # Traced and compiled.
        trainers[config] = (model, data)
    times = {config: [] for config in configs}
    for round_ in range(args.rounds):
        for config in configs:
            times[config].append(_seconds_per_step(*trainers[config], args.steps))
        print(f"round {round_ + 1}: " + ", ".join(
            f"{k} x{d} {'xla' if j else 'plain'} {times[k, d, j][-1] * 1e3:.0f} ms"
            for k, d, j in configs), flush=True)
    median = {config: statistics.median(t) for config, t in times.items()}
    rows = []
    for kind in args.models.split(","):
        for devices in (1, 2):
            plain, xla = median[kind, devices, False], median[kind, devices, True]
            fastest = min(times[kind, devices, False]) / min(times[kind, devices, True])
            rows.append({"model": kind, "devices": devices, "plain_ms": plain * 1e3,
                         "xla_ms": xla * 1e3, "xla_speedup": plain / xla,
                         "xla_speedup_fastest_rounds": fastest,
                         "two_device_speedup_plain": median[kind, 1, False] / plain
                         if devices == 2 else None,
                         "two_device_speedup_xla": median[kind, 1, True] / xla
                         if devices == 2 else None})
            print(f"{kind} on {devices} device(s): plain {plain * 1e3:.0f} ms, jit_compile "
                  f"{xla * 1e3:.0f} ms per step of {BATCH}: XLA {plain / xla:.2f}x (fastest "
                  f"rounds: {fastest:.2f}x)")
    # Rows of one replica's batch through a 1024-wide product, the CNN's and the block's
    # order of work per replica.
    ceiling = two_stream_ceiling(BATCH // 2 * 128, 128, 512, args.rounds, args.steps)
    print(f"two matmul streams on this machine: {ceiling:.2f}x")
    write_json(args.out, {"benchmark": "xla", "command": command_line("xla", args), "batch": BATCH,
                          "rounds": args.rounds, "steps": args.steps, "rows": rows,
                          "matmul_ceiling": ceiling,
                          "seconds": {f"{k}/{d}/{'xla' if j else 'plain'}": t
                                      for (k, d, j), t in times.items()}})


if __name__ == "__main__":
    main()
