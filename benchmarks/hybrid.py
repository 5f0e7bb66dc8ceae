"""Hybrid layouts (pipeline x ZeRO, pipeline x tensor parallelism) against the single
strategies on the same 4 devices.

The same MLP trained with Adam by `model.train_on_batch` under each candidate on 4
logical CPUs, each candidate in a fresh process, candidates alternating round by round.
Per candidate it prints the step time against data parallelism, the training state each device holds as
`memory_report` reads it from the built variables (weights, gradients, optimizer state:
what each layout buys; a count of what is placed, not a measured peak), and the bytes per step each device sends by the
Megatron/DeepSpeed formulas (`tfpar.plan.communication`: a ring all-reduce moves
2(R-1)/R of the gradients, ZeRO-3 1.5x that; a pipeline stage sends each micro-batch's
activation forward and its gradient back). The formulas are printed beside, not measured.

    python benchmarks/hybrid.py [--rounds 3] [--steps 8] [--out FILE]

On these machines 4 logical CPUs share 2 cores: step times compare layouts on the same
devices, not what 4 GPUs would do. The two-stream ceiling (two concurrent matmul streams
against one) is measured in the same run.
"""

import argparse
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _common import (add_common_args, batch, command_line, hidden_mlp,  # noqa: E402
                     two_stream_ceiling, write_json)

DEVICES = 4
CANDIDATES = {  # name: (strategy, its arguments)
    "data parallel (R=4)": ("data", {}),
    "ZeRO-1 (R=4)": ("data", {"shard": "optimizer"}),
    "ZeRO-3 (R=4)": ("data", {"shard": "parameters"}),
    "pipeline (K=2, R=2)": ("pipeline", {}),
    "pipeline x ZeRO-1 (K=2, R=2)": ("pipeline", {"shard": "optimizer"}),
    "pipeline x ZeRO-2 (K=2, R=2)": ("pipeline", {"shard": "gradients"}),
    "pipeline x ZeRO-3 (K=2, R=2)": ("pipeline", {"shard": "parameters"}),
    "pipeline x tensor parallel (K=2, T=2)": ("pipeline", {"tensor_parallel": 2}),
}


def make_strategy(kind, arguments, micro_batches, layers):
    import tfpar
    from tfpar.cli.train import megatron_layout_map

    devices = [f"/cpu:{i}" for i in range(DEVICES)]
    if kind == "data":
        return tfpar.DataParallelStrategy(devices, **arguments)
    tensor_parallel = arguments.get("tensor_parallel", 1)
    if tensor_parallel > 1:
        arguments = dict(arguments, layout_map=megatron_layout_map(layers))
    return tfpar.PipelineStrategy(devices, num_stages=2,
                                  num_replicas=DEVICES // 2 // tensor_parallel,
                                  schedule="1f1b", num_micro_batches=micro_batches, **arguments)


def formula_bytes(kind, arguments, gradient_bytes, boundary_bytes, micro_batches, layers):
    """Bytes the busiest device sends per step, by the formulas."""
    from tfpar.plan import communication, sharding

    stage = sharding.STAGES[arguments.get("shard")]
    if kind == "data":
        return communication.data_parallel_bytes(gradient_bytes, DEVICES, stage)
    if arguments.get("tensor_parallel", 1) > 1:  # One replica: no gradient reduction.
        # A stage's layer pairs, their output the boundary's size.
        return (communication.tensor_parallel_bytes(boundary_bytes, 2, layers // 2 // 2,
                                                    micro_batches)
                + communication.pipeline_bytes(boundary_bytes, 2, micro_batches))
    # Each stage's half of the gradients over its 2 replicas, and the stage boundary.
    return (communication.data_parallel_bytes(gradient_bytes / 2, 2, stage)
            + communication.pipeline_bytes(boundary_bytes, 2, micro_batches))


def measure_candidate(name, args):
    """In this process: builds candidate `name`, warms it up and times `args.steps` steps;
    returns {"seconds_per_step", "bytes_per_device", "formula_bytes"}."""
    import time

    import tfpar

    tfpar.virtual_cpus(DEVICES, one_core_each=True)

    kind, arguments = CANDIDATES[name]
    x, y = batch(args.global_batch, args.width)
    strategy = make_strategy(kind, arguments, args.micro_batches, args.layers)
    with strategy.scope():
        model = hidden_mlp(args.width, args.layers)
    for _ in range(2):
        model.train_on_batch(x, y)  # Trace, place, warm up.
    start = time.perf_counter()
    for _ in range(args.steps):
        model.train_on_batch(x, y)
    seconds = (time.perf_counter() - start) / args.steps
    try:
        held = strategy.memory_report(model).peak
    except NotImplementedError:  # Not planned for tensor parallelism yet.
        held = None
    copies = strategy.num_replicas_in_sync
    boundary = 4 * (args.global_batch // copies // args.micro_batches) * args.width
    return {"seconds_per_step": seconds, "bytes_per_device": held,
            "formula_bytes": formula_bytes(kind, arguments, 4 * model.count_params(),
                                           boundary, args.micro_batches, args.layers)}


def _in_a_process(name, args):
    import json
    import subprocess
    import sys

    command = [sys.executable, os.path.abspath(__file__), f"--candidate={name}"] + [
        f"--{k}={v}" for k, v in vars(args).items() if k not in ("out", "candidate")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global_batch", type=int, default=512)
    parser.add_argument("--micro_batches", type=int, default=4)
    parser.add_argument("--candidate", default=None, help=argparse.SUPPRESS)
    add_common_args(parser, width=512, layers=8, steps=8, rounds=3, out_name="hybrid.json")
    args = parser.parse_args()
    if args.candidate:
        import json

        print(json.dumps(measure_candidate(args.candidate, args)))
        return

    # Each candidate in a fresh process, candidates alternating round by round: in one
    # process, models built earlier stepped up to 2x slower once later ones existed.
    times, measured = {name: [] for name in CANDIDATES}, {}
    for _ in range(args.rounds):
        for name in CANDIDATES:
            measured[name] = _in_a_process(name, args)
            times[name].append(measured[name]["seconds_per_step"])
    import tfpar

    tfpar.virtual_cpus(2, one_core_each=True)
    ceiling = two_stream_ceiling(args.global_batch // 2, args.width, args.width,
                                 args.rounds, args.steps)
    step = {name: statistics.median(t) for name, t in times.items()}
    base = step["data parallel (R=4)"]
    rows = {}
    print(f"MLP {args.layers}x{args.width} + head, Adam, global batch {args.global_batch}, "
          f"{DEVICES} logical CPUs on this host, a process per candidate and round, median "
          f"of {args.rounds} rounds x {args.steps} steps; two-stream ceiling {ceiling:.2f}x")
    print(f"{'candidate':38s} {'step ms':>8s} {'vs data':>8s} {'state MiB':>11s} "
          f"{'sent MiB/step (formula)':>24s}")
    for name, seconds in step.items():
        peak, sent = measured[name]["bytes_per_device"], measured[name]["formula_bytes"]
        rows[name] = {"step_ms": round(seconds * 1000, 2),
                      "step_time_vs_data_parallel": round(seconds / base, 3),
                      "state_bytes_per_device": peak, "formula_bytes_sent_per_step": sent}
        held = f"{peak / (1 << 20):11.2f}" if peak is not None else f"{'-':>11s}"
        print(f"{name:38s} {seconds * 1000:8.1f} {seconds / base:8.2f} {held} "
              f"{sent / (1 << 20):24.2f}")
    write_json(args.out, {
        "benchmark": "hybrid",
        "command": command_line("hybrid", argparse.Namespace(**{
            k: v for k, v in vars(args).items() if k != "candidate"})),
        "devices": DEVICES, "two_stream_ceiling": round(ceiling, 3), "rows": rows,
        "all_step_ms": {k: [round(t * 1000, 2) for t in v] for k, v in times.items()}})


if __name__ == "__main__":
    main()
