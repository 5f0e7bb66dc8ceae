"""Hybrid layouts (pipeline x ZeRO) against the single strategies on the same 4 devices.

The same MLP trained with Adam by `model.train_on_batch` under each candidate, side by side in one
process on 4 logical CPUs, candidates alternating round by round. Per candidate it prints
the step time against data parallelism, the bytes per device `memory_report` counts
(what each layout buys), and the bytes per step each device sends by the
Megatron/DeepSpeed formulas (`tfpar.plan.communication`: a ring all-reduce moves
2(R-1)/R of the gradients, ZeRO-3 1.5x that; a pipeline stage sends each micro-batch's
activation forward and its gradient back). The formulas are printed beside, not measured.

    python benchmarks/hybrid.py [--rounds 5] [--steps 4] [--out FILE]

On these machines 4 logical CPUs share 2 cores: step times compare layouts on the same
devices, not what 4 GPUs would do. The two-stream ceiling (two concurrent matmul streams
against one) is measured in the same run.
"""

import argparse
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _common import add_common_args, batch, command_line, time_rounds, two_stream_ceiling, write_json  # noqa: E402,E501

DEVICES = 4
CANDIDATES = {  # name: (strategy, its arguments)
    "data parallel (R=4)": ("data", {}),
    "ZeRO-1 (R=4)": ("data", {"shard": "optimizer"}),
    "ZeRO-3 (R=4)": ("data", {"shard": "parameters"}),
    "pipeline (K=2, R=2)": ("pipeline", {}),
    "pipeline x ZeRO-1 (K=2, R=2)": ("pipeline", {"shard": "optimizer"}),
    "pipeline x ZeRO-2 (K=2, R=2)": ("pipeline", {"shard": "gradients"}),
    "pipeline x ZeRO-3 (K=2, R=2)": ("pipeline", {"shard": "parameters"}),
}


def make_strategy(kind, arguments, micro_batches):
    import tfpar

    devices = [f"/cpu:{i}" for i in range(DEVICES)]
    if kind == "data":
        return tfpar.DataParallelStrategy(devices, **arguments)
    return tfpar.PipelineStrategy(devices, num_stages=2, num_replicas=2, schedule="1f1b",
                                  num_micro_batches=micro_batches, **arguments)


def formula_bytes(kind, arguments, gradient_bytes, boundary_bytes, micro_batches):
    """Bytes the busiest device sends per step, by the formulas."""
    from tfpar.plan import communication, sharding

    stage = sharding.STAGES[arguments.get("shard")]
    if kind == "data":
        return communication.data_parallel_bytes(gradient_bytes, DEVICES, stage)
    # Each stage's half of the gradients over its 2 replicas, and the stage boundary.
    return (communication.data_parallel_bytes(gradient_bytes / 2, 2, stage)
            + communication.pipeline_bytes(boundary_bytes, 2, micro_batches))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global_batch", type=int, default=512)
    parser.add_argument("--micro_batches", type=int, default=4)
    add_common_args(parser, width=512, layers=8, steps=4, rounds=5, out_name="hybrid.json")
    args = parser.parse_args()

    import tfpar

    tfpar.virtual_cpus(DEVICES, one_core_each=True)
    import keras

    x, y = batch(args.global_batch, args.width)
    runners, reports, sent = {}, {}, {}
    for name, (kind, arguments) in CANDIDATES.items():
        strategy = make_strategy(kind, arguments, args.micro_batches)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential(
                [keras.Input((args.width,))]
                + [keras.layers.Dense(args.width, activation="relu")
                   for _ in range(args.layers)] + [keras.layers.Dense(10)])
            model.compile(keras.optimizers.Adam(1e-4),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.train_on_batch(x, y)  # Trace, place, warm up.
        runners[name] = (lambda m: lambda: [m.train_on_batch(x, y)
                                            for _ in range(args.steps)])(model)
        reports[name] = strategy.memory_report(model)
        gradient_bytes = 4 * model.count_params()
        boundary = 4 * (args.global_batch // 2 // args.micro_batches) * args.width
        sent[name] = formula_bytes(kind, arguments, gradient_bytes, boundary,
                                   args.micro_batches)
    times = time_rounds(runners, args.rounds, args.steps)
    ceiling = two_stream_ceiling(args.global_batch // 2, args.width, args.width,
                                 args.rounds, args.steps)
    step = {name: statistics.median(t) for name, t in times.items()}
    base = step["data parallel (R=4)"]
    rows = {}
    print(f"MLP {args.layers}x{args.width} + head, Adam, global batch {args.global_batch}, "
          f"{DEVICES} logical CPUs on this host, median of {args.rounds} rounds x "
          f"{args.steps} steps; two-stream ceiling {ceiling:.2f}x")
    print(f"{'candidate':30s} {'step ms':>8s} {'vs data':>8s} {'MiB/device':>11s} "
          f"{'sent MiB/step (formula)':>24s}")
    for name, seconds in step.items():
        peak = reports[name].peak
        rows[name] = {"step_ms": round(seconds * 1000, 2),
                      "step_time_vs_data_parallel": round(seconds / base, 3),
                      "bytes_per_device": peak, "formula_bytes_sent_per_step": sent[name]}
        print(f"{name:30s} {seconds * 1000:8.1f} {seconds / base:8.2f} "
              f"{peak / (1 << 20):11.2f} {sent[name] / (1 << 20):24.2f}")
    write_json(args.out, {
        "benchmark": "hybrid", "command": command_line("hybrid", args),
        "devices": DEVICES, "two_stream_ceiling": round(ceiling, 3), "rows": rows,
        "all_step_ms": {k: [round(t * 1000, 2) for t in v] for k, v in times.items()}})


if __name__ == "__main__":
    main()
