"""ModelParallelStrategy over 2 logical CPUs against the same model on one device.

The same MLP and SGD step run on one device (stock OneDeviceStrategy), split by
ModelParallelStrategy over 2 logical CPUs (one core each), and placed by
ModelParallelStrategy on a single device (the cost of tfpar's placed forward and
backward alone). Candidates alternate round by round in one process, so drift on
the shared machine hits all of them alike. Goal: split <= 1.1x one device.

    python benchmarks/model_parallel.py [--devices 2] [--rounds 7] [--out FILE]

Prints a table and writes JSON (default benchmarks/results/model_parallel.json).
"""

import os
import platform
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _common import (  # noqa: E402
    command_line, mlp_steps, single_host_args, time_rounds, write_json)


def main():
    args = single_host_args(__doc__.splitlines()[0], "model_parallel.json")
    import tfpar

    tfpar.virtual_cpus(args.devices, one_core_each=True)
    import tensorflow as tf

    devices = [f"/cpu:{i}" for i in range(args.devices)]
    candidates = {
        "one device": lambda: tf.distribute.OneDeviceStrategy(devices[0]),
        f"split over {args.devices}": lambda: tfpar.ModelParallelStrategy(devices, optimizer="sgd"),
        "tfpar on 1 device": lambda: tfpar.ModelParallelStrategy(devices[:1], optimizer="sgd"),
    }
    runners, reports = {}, {}
    for name, make in candidates.items():
        strategy = make()
        model, runners[name] = mlp_steps(strategy, args)
        if isinstance(strategy, tfpar.ModelParallelStrategy):
            reports[name] = strategy.placement_report(model)
    times = time_rounds(runners, args.rounds, args.steps)

    step = {name: statistics.median(t) for name, t in times.items()}
    base = step["one device"]
    rows = {name: {"step_ms": round(seconds * 1000, 2),
                   "samples_per_s": round(args.global_batch / seconds, 1),
                   "step_time_vs_one_device": round(seconds / base, 3)}
            for name, seconds in step.items()}
    split = reports[f"split over {args.devices}"]
    params = 4 * ((args.layers * (args.width + 1) * args.width) + (args.width + 1) * 10)
    result = {
        "benchmark": "model_parallel",
        "command": command_line("model_parallel", args),
        "devices": args.devices, "global_batch": args.global_batch,
        "model": f"MLP {args.layers}x{args.width} + 10-way head, "
                 f"{params / 2**20:.1f} MiB of weights, SGD",
        "placement": {d: t.layers for d, t in split.totals.items()},
        "imbalance": round(split.imbalance, 3),
        "tensorflow": tf.__version__, "host": platform.node(), "rows": rows,
        "all_step_ms": {k: [round(t * 1000, 2) for t in v] for k, v in times.items()},
    }
    print(f"{result['model']}, batch {args.global_batch}, {args.devices} logical CPUs "
          f"(one core each), median of {args.rounds} rounds x {args.steps} steps")
    print(split)
    print(f"{'candidate':20s} {'step ms':>9s} {'samples/s':>10s} {'vs 1 device':>12s}")
    for name, row in rows.items():
        print(f"{name:20s} {row['step_ms']:9.2f} {row['samples_per_s']:10.0f} "
              f"{row['step_time_vs_one_device']:12.3f}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
