"""PipelineStrategy on 2 logical CPUs: micro-batches against plain layer placement.

One MLP (Keras train step, SGD) trained side by side in one process, on 2 logical
CPUs limited to one core each:

- one device: the whole model on /cpu:0 (stock OneDeviceStrategy);
- K=2 M=1: the model cut into 2 stages, the batch in one piece (plain layer placement:
  the two devices take turns);
- K=2 M=8, GPipe and 1F1B: the batch in 8 micro-batches of 512 rows (the size at
  which single-thread matmuls are efficient here) flowing through the 2 stages.

Candidates alternate round by round (drift on the shared machine hits all alike);
step times are medians. The pipeline's speedup over K=2 M=1 is compared with the
bound 2M/(M+1) (the bubble of a 2-stage pipeline). Peak memory is TensorFlow's CPU
allocator peak during one step, above what was allocated before it (the logical
CPUs share one allocator), next to the schedule's estimate of the activations a
stage keeps. Also writes a Chrome trace and a picture of one real GPipe step and
one 1F1B step.

    python benchmarks/pipeline.py [--micro_batch 512] [--num_micro_batches 8] [--rounds 5]

Prints a table and writes JSON (default benchmarks/results/pipeline.json).
"""

import argparse
import os
import platform
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _common import add_common_args, batch, command_line, time_rounds, write_json  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro_batch", type=int, default=512, help="rows per micro-batch")
    parser.add_argument("--num_micro_batches", type=int, default=8)
    parser.add_argument("--remat", action="store_true", help="also time GPipe with remat")
    parser.add_argument("--trace", default=os.path.join(RESULTS, "pipeline_trace.json"),
                        help="Chrome trace of one GPipe step (a .png is written next to it)")
    add_common_args(parser, width=1024, layers=8, steps=2, rounds=5, out_name="pipeline.json")
    return parser.parse_args()


def make_model(args):
    """The benchmark MLP, compiled; call under a strategy's scope."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((args.width,))]
        + [keras.layers.Dense(args.width, activation="relu") for _ in range(args.layers)]
        + [keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(1e-4),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def make_step(strategy, model, data):
    """One compiled Keras train step of `model` on a fixed batch, as fit runs it."""
    import tensorflow as tf

    iterator = iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors(data).repeat()))

    @tf.function
    def step():
        logs = strategy.run(model.train_step, args=(next(iterator),))
        return strategy.experimental_local_results(logs["loss"])[0]

    step()  # trace, place and warm up
    return lambda: float(step())


def peak_bytes(step):
    """TensorFlow's CPU allocator peak during one step, above its level before."""
    import tensorflow as tf

    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    step()
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - before


def main():
    args = parse_args()
    import tfpar

    tfpar.virtual_cpus(2, one_core_each=True)
    import tensorflow as tf

    from tfpar.plan.schedule import max_in_flight

    m = args.num_micro_batches
    global_batch = m * args.micro_batch
    data = batch(global_batch, args.width)
    devices = ["/cpu:0", "/cpu:1"]
    candidates = {
        "one device": lambda: tf.distribute.OneDeviceStrategy(devices[0]),
        "K=2 M=1": lambda: tfpar.PipelineStrategy(devices, num_micro_batches=1),
        f"K=2 M={m} GPipe": lambda: tfpar.PipelineStrategy(devices, num_micro_batches=m),
        f"K=2 M={m} 1F1B": lambda: tfpar.PipelineStrategy(devices, num_micro_batches=m,
                                                           schedule="1f1b"),
    }
    if args.remat:
        candidates[f"K=2 M={m} GPipe remat"] = lambda: tfpar.PipelineStrategy(
            devices, num_micro_batches=m, remat=True)
    runners, strategies, models = {}, {}, {}
    for name, make in candidates.items():
        strategies[name] = make()
        with strategies[name].scope():
            models[name] = make_model(args)
        runners[name] = make_step(strategies[name], models[name], data)
    times = time_rounds(runners, args.rounds, args.steps)
    peaks = {name: peak_bytes(run) for name, run in runners.items()}

    step = {name: statistics.median(t) for name, t in times.items()}
    gpipe, one_f_one_b = f"K=2 M={m} GPipe", f"K=2 M={m} 1F1B"
    bound = 2 * m / (m + 1)
    speedup = step["K=2 M=1"] / step[gpipe]
    rows = {name: {"step_ms": round(seconds * 1000, 1),
                   "samples_per_s": round(global_batch / seconds, 1),
                   "speedup_vs_one_device": round(step["one device"] / seconds, 3),
                   "speedup_vs_K2_M1": round(step["K=2 M=1"] / seconds, 3),
                   "peak_MiB": round(peaks[name] / 2**20, 1)}
            for name, seconds in step.items()}
    stages = strategies[gpipe].stages(models[gpipe])
    # Activations a stage keeps per micro-batch: each Dense layer's output (its
    # backward needs it), micro_batch x width floats.
    per_micro_batch = [len(s) * args.micro_batch * args.width * 4 for s in stages]
    estimate = {
        name: [n * b for n, b in zip(max_in_flight(strategies[name].schedule), per_micro_batch)]
        for name in (gpipe, one_f_one_b)}
    traces = {}
    for name, path in ((gpipe, args.trace), (one_f_one_b, args.trace.replace(".json", "_1f1b.json"))):
        strategies[name].trace(path, models[name], *data)
        traces[name] = {"json": os.path.relpath(path), "png": os.path.relpath(path[:-5] + ".png")}

    params = 4 * ((args.layers * (args.width + 1) * args.width) + (args.width + 1) * 10)
    result = {
        "benchmark": "pipeline",
        "command": command_line("pipeline", args).replace(f" --trace={args.trace}", ""),
        "model": f"MLP {args.layers}x{args.width} + 10-way head, "
                 f"{params / 2**20:.1f} MiB of weights, SGD, Keras train step",
        "devices": "2 logical CPUs, one core each (intra-op 1, inter-op 2)",
        "global_batch": global_batch, "micro_batch": args.micro_batch,
        "stages": stages,
        "bound_2M_over_M_plus_1": round(bound, 3),
        "speedup_M8_vs_M1": round(speedup, 3),
        "fraction_of_bound": round(speedup / bound, 3),
        "speedup_M8_vs_one_device": round(step["one device"] / step[gpipe], 3),
        "estimated_activation_MiB_per_stage": {
            name: [round(b / 2**20, 1) for b in v] for name, v in estimate.items()},
        "schedule": {name: strategies[name].schedule_table() for name in (gpipe, one_f_one_b)},
        "traces": traces,
        "tensorflow": tf.__version__, "host": platform.node(), "rows": rows,
        "all_step_ms": {k: [round(t * 1000, 1) for t in v] for k, v in times.items()},
    }
    print(f"{result['model']}, batch {global_batch} ({m} x {args.micro_batch}), "
          f"{result['devices']}, median of {args.rounds} rounds x {args.steps} steps")
    print(f"stages: {stages}")
    print(f"{'candidate':24s} {'step ms':>9s} {'samples/s':>10s} {'vs 1 dev':>9s} "
          f"{'vs M=1':>7s} {'peak MiB':>9s}")
    for name, row in rows.items():
        print(f"{name:24s} {row['step_ms']:9.1f} {row['samples_per_s']:10.0f} "
              f"{row['speedup_vs_one_device']:9.3f} {row['speedup_vs_K2_M1']:7.3f} "
              f"{row['peak_MiB']:9.1f}")
    print(f"M={m} vs M=1: {speedup:.3f}x; bound 2M/(M+1) = {bound:.3f}; "
          f"{100 * speedup / bound:.1f}% of the bound")
    print("estimated activations kept per stage (MiB):",
          result["estimated_activation_MiB_per_stage"])
    print(strategies[gpipe].schedule_table())
    print("traces:", traces)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
