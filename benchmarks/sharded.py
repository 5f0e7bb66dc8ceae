"""ZeRO stages 1-3 (DataParallelStrategy(shard=...)) against unsharded data parallelism.

The same MLP trained with Adam under each, side by side in one process, candidates
alternating round by round; each logical CPU limited to one core. Also prints the bytes
each replica holds (`strategy.memory_report`), so the time ratio comes with what it buys.

    python benchmarks/sharded.py [--devices 2] [--rounds 7] [--out FILE]
    python benchmarks/sharded.py --workers 2 [--rounds 3]   # 2 worker processes

With --workers 2, each configuration is a 2-worker job (one multi-worker strategy per
process), the jobs alternating round by round.

Goal (issue 14): stage 1 and 2 <= 1.1x, stage 3 <= 1.3x the unsharded step time. On
one host's CPUs gradients are all-reduced (each replica keeps its own) and stage 3's
reads are copies between logical devices; across workers the reduce-scatter is
point-to-point sends, and stage 3 broadcasts each variable from its owner where it is
read and sends each gradient back to the owner alone; on GPUs NCCL collectives.
"""

import json
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _common import (  # noqa: E402
    command_line, mlp_steps, single_host_args, single_host_result, time_rounds, write_json)

SHARDS = {"unsharded": None, "stage 1 (optimizer)": "optimizer",
          "stage 2 (gradients)": "gradients", "stage 3 (parameters)": "parameters"}


def across_workers(args):
    """Seconds per step of each 2-worker configuration, jobs alternating by round."""
    import argparse

    import multi_worker

    jobs = {name: (shard, None) for name, shard in SHARDS.items()}
    # Buckets the size of the unsharded ring's packs across workers (default: 25 MiB).
    jobs["stage 2, 4 MiB buckets"] = ("gradients", 4 << 20)
    times = {name: [] for name in jobs}
    for _ in range(args.rounds):
        for name, (shard, bucket_bytes) in jobs.items():
            job = argparse.Namespace(
                model="mlp", per_worker_batch=args.global_batch // 2, width=args.width,
                layers=args.layers, steps=args.steps, optimizer="adam",
                bytes_per_pack=bucket_bytes, shard=shard)
            seconds, replicas = multi_worker.run_config(job, "tfpar", 2)
            assert replicas == 2
            times[name].append(seconds)
    return times


def main():
    args = single_host_args(__doc__.splitlines()[0], "sharded.json", workers=True)
    if args.workers > 1:
        times = across_workers(args)
        step = {name: statistics.median(t) for name, t in times.items()}
        result = {
            "benchmark": "sharded", "command": command_line("sharded", args),
            "workers": args.workers, "global_batch": args.global_batch,
            "model": f"MLP {args.layers}x{args.width}, Adam",
            "rows": {name: {"step_ms": round(s * 1000, 2),
                            "step_time_vs_unsharded": round(s / step["unsharded"], 3)}
                     for name, s in step.items()},
            "all_step_ms": {k: [round(t * 1000, 2) for t in v] for k, v in times.items()},
        }
        print(json.dumps(result["rows"], indent=2))
        write_json(args.out.replace(".json", "_workers.json"), result)
        return
    import tfpar

    tfpar.virtual_cpus(args.devices, one_core_each=True)
    import keras

    devices = [f"/cpu:{i}" for i in range(args.devices)]
    runners, reports = {}, {}
    for name, shard in SHARDS.items():
        strategy = tfpar.DataParallelStrategy(devices, shard=shard)
        made = []
        model, run = mlp_steps(strategy, args,
                               lambda: made.append(keras.optimizers.Adam(1e-4)) or made[-1])
        runners[name] = run
        reports[name] = strategy.memory_report(model, optimizer=made[-1])
    times = time_rounds(runners, args.rounds, args.steps)

    step = {name: statistics.median(t) for name, t in times.items()}
    base = step["unsharded"]
    rows = {}
    for name, seconds in step.items():
        report = reports[name]
        peak = max(d.weights + d.gradients + d.optimizer + d.gather_buffer
                   for d in report.devices)
        rows[name] = {
            "step_ms": round(seconds * 1000, 2),
            "step_time_vs_unsharded": round(seconds / base, 3),
            "bytes_per_replica": peak,
            "bytes_per_param": round(peak / report.num_params, 2),
        }
    num_params = reports["unsharded"].num_params
    result = single_host_result(
        "sharded", args, f"MLP {args.layers}x{args.width}, Adam, {num_params:,} parameters",
        rows, times)
    print(f"{'candidate':24s} {'step ms':>9s} {'vs unsharded':>13s} {'B/param':>8s}")
    for name, row in rows.items():
        print(f"{name:24s} {row['step_ms']:9.2f} {row['step_time_vs_unsharded']:13.3f} "
              f"{row['bytes_per_param']:8.2f}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
