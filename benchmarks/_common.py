"""What the benchmarks share: arguments, the models and their SGD replica step."""

import os


def add_common_args(parser, width, layers, steps, rounds, out_name):
    parser.add_argument("--width", type=int, default=width)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      out_name))


def mlp_and_step(args, global_batch, optimizer=None):
    """An MLP (layers x width, 10-way head) with SGD (or `optimizer`), and its replica step
    for strategy.run.

    Call under the strategy's scope.
    """
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((args.width,))]
        + [keras.layers.Dense(args.width, activation="relu") for _ in range(args.layers)]
        + [keras.layers.Dense(10)])
    return model, sgd_replica_step(model, global_batch, optimizer)


def hidden_mlp(width, layers):
    """`layers` x Dense(width, relu) named hidden_<i> (as `tfpar.cli.train.megatron_layout_map`
    splits them) and a 10-way head, compiled with Adam. Call under the strategy's scope."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="relu", name=f"hidden_{i}")
           for i in range(layers)] + [keras.layers.Dense(10)])
    model.compile(keras.optimizers.Adam(1e-4),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def cnn_and_step(global_batch, image_size=32):
    """A VGG-style CNN (6 convolutions, 64-256 channels, 10-way head) with SGD.

    Compute-heavy for its size: ~1.1M weights (4.4 MiB of gradients) against ~6 ms of
    one-core training work per 32x32 image here. Call under the strategy's scope.
    """
    import keras

    keras.utils.set_random_seed(0)
    layers = [keras.Input((image_size, image_size, 3))]
    for filters, pool in ((64, False), (64, True), (128, False), (128, True), (256, False),
                          (256, False)):
        layers.append(keras.layers.Conv2D(filters, 3, padding="same", activation="relu"))
        if pool:
            layers.append(keras.layers.MaxPooling2D())
    model = keras.Sequential(layers + [keras.layers.GlobalAveragePooling2D(),
                                       keras.layers.Dense(10)])
    return model, sgd_replica_step(model, global_batch)


def sgd_replica_step(model, global_batch, optimizer=None):
    """The replica step for strategy.run: mean cross-entropy over the global batch, SGD
    (or `optimizer`, made under the strategy's scope)."""
    import keras
    import tensorflow as tf

    optimizer = optimizer or keras.optimizers.SGD(0.001)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            per_example = keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return replica_step


def batch(global_batch, shape, seed=0):
    """Random inputs of `shape` (an int: a feature width) and labels in [0, 10)."""
    import numpy as np

    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(global_batch,) + shape).astype("float32"),
            rng.integers(0, 10, global_batch).astype("int32"))


def single_host_args(description, out_name, workers=False):
    """Parsed arguments of the one-host benchmarks: logical CPUs and the MLP's global batch
    (and, with `workers`, --workers: worker processes instead of logical CPUs)."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--devices", type=int, default=2)
    if workers:
        parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--global_batch", type=int, default=1024)
    add_common_args(parser, width=512, layers=8, steps=20, rounds=7, out_name=out_name)
    return parser.parse_args()


def mlp_steps(strategy, args, make_optimizer=None):
    """The MLP built under `strategy`, and a function running `args.steps` compiled SGD
    (or `make_optimizer()`) steps of it on one fixed global batch."""
    import tensorflow as tf

    with strategy.scope():
        optimizer = make_optimizer() if make_optimizer else None
        model, replica_step = mlp_and_step(args, args.global_batch, optimizer)
    dataset = tf.data.Dataset.from_tensors(batch(args.global_batch, args.width)).repeat()
    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    @tf.function
    def steps(n):
        total = tf.constant(0.0)
        for _ in tf.range(n):
            total += strategy.reduce("SUM", strategy.run(replica_step, args=next(iterator)), None)
        return total

    steps(tf.constant(2))  # trace, place and warm up
    return model, lambda: float(steps(tf.constant(args.steps)))


def time_rounds(runners, rounds, steps):
    """Seconds per step of each runner, candidates alternating round by round."""
    import time

    times = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) / steps)
    return times


def single_host_result(benchmark, args, model, rows, times, **extra):
    """The JSON record of a one-host benchmark (and its heading printed)."""
    import platform

    import tensorflow as tf

    print(f"{model}, global batch {args.global_batch}, {args.devices} logical CPUs "
          f"(one core each), median of {args.rounds} rounds x {args.steps} steps")
    return {"benchmark": benchmark, "command": command_line(benchmark, args),
            "devices": args.devices, "global_batch": args.global_batch, "model": model,
            **extra, "tensorflow": tf.__version__, "host": platform.node(), "rows": rows,
            "all_step_ms": {k: [round(t * 1000, 2) for t in v] for k, v in times.items()}}


def command_line(name, args):
    return f"python benchmarks/{name}.py " + " ".join(
        f"--{k}={v}" for k, v in vars(args).items() if k != "out")


def write_json(path, result):
    import json

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")


def two_stream_ceiling(rows, inner, outer, rounds, steps, devices=("/cpu:0", "/cpu:1")):
    """How many times one stream's throughput two concurrent streams get, one per device
    (a stream: a rows x inner by inner x outer product, forward and both backward
    products): 2.0 on two real devices; on these CPUs, less (shared memory bandwidth)."""
    import statistics
    import time

    import tensorflow as tf

    a = tf.random.normal([rows, inner])
    b = tf.random.normal([inner, outer])

    def work(device):
        with tf.device(device):
            h = tf.matmul(a, b)
            return tf.reduce_sum(tf.matmul(h, b, transpose_b=True)) + tf.reduce_sum(
                tf.matmul(a, h, transpose_a=True))

    one = tf.function(lambda: work(devices[0]))
    two = tf.function(lambda: work(devices[0]) + work(devices[1]))
    times = {one: [], two: []}
    for f in times:
        f()
    for _ in range(rounds):
        for f in times:
            start = time.perf_counter()
            for _ in range(steps):
                f().numpy()
            times[f].append(time.perf_counter() - start)
    return 2 * statistics.median(times[one]) / statistics.median(times[two])


def all_reduce_functions(strategies, sizes, index):
    """{(name, size): a tf.function that all-reduces a float32 buffer of `size` bytes in
    replica context under strategies[name]}, each traced and checked once (every worker
    calls this alike: each call is a collective). `index`: this worker's task index (its
    replica's value is index + 1)."""
    import tensorflow as tf

    functions = {}
    for name, strategy in strategies.items():
        for size in sizes:
            @tf.function
            def reduce(strategy=strategy, elements=size // 4):
                def replica_fn():
                    value = tf.fill([elements], float(index + 1))
                    return tf.distribute.get_replica_context().all_reduce(
                        tf.distribute.ReduceOp.SUM, value)
                return strategy.run(replica_fn)

            want = sum(range(1, strategy.num_replicas_in_sync + 1))
            got = float(strategy.experimental_local_results(reduce())[0][0])  # (Traced too.)
            assert got == want, (name, size, got, want)
            functions[name, size] = reduce
    return functions
