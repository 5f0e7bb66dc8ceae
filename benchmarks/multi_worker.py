"""Multi-worker data parallelism: scaling from 1 to 2 workers, and tfpar against stock.

Each worker is a separate process on 127.0.0.1, pinned to its own core (one
thread per op). Configurations alternate round by round in one run:

  1 worker  tfpar    DataParallelStrategy() on one worker
  2 workers tfpar    DataParallelStrategy() across 2 TF_CONFIG workers
  2 workers stock    tf.distribute.MultiWorkerMirroredStrategy, same custom loop
  2 alone            two 1-worker processes at once, one per core, nothing shared: the
                     machine's ceiling for 2 workers (what 2 cores computing together give)

Same per-worker batch everywhere, so 2 workers process twice the samples per step.

The model: `--model=cnn` (default), a VGG-style CNN on 32x32 images, the kind of
compute-heavy model data parallelism is for (4.4 MiB of gradients against ~400 ms of
one-core work per step at per-worker batch 64); `--model=mlp`, an MLP whose 16 MiB
of gradients make the all-reduce weigh far more (per-worker batch 2048 by default).

    python benchmarks/multi_worker.py [--model cnn|mlp] [--rounds 2] [--steps 8] [--out FILE]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import add_common_args, batch, cnn_and_step, mlp_and_step  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    parser.add_argument("--per_worker_batch", type=int, default=None,
                        help="default: 64 for the CNN, 2048 for the MLP")
    add_common_args(parser, width=1024, layers=4, steps=8, rounds=2, out_name="multi_worker.json")
    parser.add_argument("--bytes_per_pack", type=int, default=None,
                        help="tfpar ring packing across workers (default: tfpar's)")
    parser.add_argument("--shard", default=None, help="tfpar's ZeRO stage (shard=)")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--compressions", default="",
                        help="comma-separated tfpar gradient compressions to run as well "
                             "(fp16, bf16), each as one more 2-worker configuration")
    parser.add_argument("--sync_everys", default="",
                        help="comma-separated tfpar sync_every values (periodic averaging) to "
                             "run as well, each as one more 2-worker configuration; its steps "
                             "are timed over a multiple of n")
    parser.add_argument("--compression", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sync_every", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=["tfpar", "stock"], help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--core", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.per_worker_batch is None:
        args.per_worker_batch = 64 if args.model == "cnn" else 2048
    return args


def worker(args):
    """One worker process: time a custom training loop, write seconds per step."""
    config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    index = config.get("task", {}).get("index", 0)
    os.sched_setaffinity(0, {(index if args.core is None else args.core) % os.cpu_count()})
    import tfpar

    tfpar.virtual_cpus(1, one_core_each=True)
    import keras
    import tensorflow as tf

    if args.worker == "stock":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        strategy = tfpar.DataParallelStrategy(devices=None if config else ["/cpu:0"],
                                              bytes_per_pack=args.bytes_per_pack if config else None,
                                              shard=args.shard, compression=args.compression,
                                              sync_every=args.sync_every)
    global_batch = args.per_worker_batch * strategy.num_replicas_in_sync
    with strategy.scope():
        optimizer = keras.optimizers.Adam(1e-4) if args.optimizer == "adam" else None
        model, replica_step = (cnn_and_step(global_batch) if args.model == "cnn"
                               else mlp_and_step(args, global_batch, optimizer))
    x, y = batch(global_batch, model.input_shape[1:], seed=index)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat().with_options(options)
    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    @tf.function
    def step():
        return strategy.reduce("SUM", strategy.run(replica_step, args=next(iterator)), None)

    # Under sync_every=n, n x k steps from a multiple of n: k averagings timed.
    n = args.sync_every
    timed = -(-args.steps // n) * n
    for _ in range(3 if n == 1 else n):
        float(step())
    start = time.perf_counter()
    for _ in range(timed):
        float(step())
    seconds = (time.perf_counter() - start) / timed
    if index == 0:
        with open(args.result + ("" if args.core is None else f".{args.core}"), "w") as f:
            json.dump({"step_seconds": seconds, "replicas": strategy.num_replicas_in_sync}, f)


def run_config(args, kind, workers, compression=None, sync_every=1):
    """Launches one configuration; returns (seconds per step, replicas)."""
    from tfpar.cluster.launcher import Launcher

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), f"--worker={kind}",
                   f"--result={result}", f"--model={args.model}",
                   f"--per_worker_batch={args.per_worker_batch}",
                   f"--width={args.width}", f"--layers={args.layers}", f"--steps={args.steps}",
                   f"--optimizer={args.optimizer}",
                   ] + ([f"--bytes_per_pack={args.bytes_per_pack}"] if args.bytes_per_pack is not None else []
                        ) + ([f"--shard={args.shard}"] if args.shard else []
                        ) + ([f"--compression={compression}"] if compression else []
                        ) + [f"--sync_every={sync_every}"]
        if kind == "alone":  # Two one-worker processes at once, each on its own core.
            runs = [subprocess.Popen(command[:2] + ["--worker=tfpar", f"--core={core}"]
                                     + command[3:]) for core in range(workers)]
            codes = [run.wait(timeout=600) for run in runs]
            code = max(codes)
            if code == 0:
                steps = [json.load(open(f"{result}.{core}"))["step_seconds"]
                         for core in range(workers)]
                return statistics.mean(steps), workers
        elif workers == 1:
            code = subprocess.run(command, timeout=600).returncode
        else:
            code = Launcher(command, workers, output=lambda line: None).run()
        if code != 0:
            raise RuntimeError(f"{kind} with {workers} worker(s) failed with exit code {code}")
        with open(result) as f:
            data = json.load(f)
    return data["step_seconds"], data["replicas"]


def _ceiling(args):
    """Two concurrent matmul streams against one, at this model's shape, in this run."""
    import tfpar

    tfpar.virtual_cpus(2)
    from _common import two_stream_ceiling

    rows = args.per_worker_batch if args.model == "mlp" else 1024
    return round(two_stream_ceiling(rows, args.width, args.width, args.rounds, 5), 3)


def main():
    args = parse_args()
    if args.worker:
        return worker(args)
    configs = {"1 worker tfpar": ("tfpar", 1, None, 1),
               "2 workers tfpar": ("tfpar", 2, None, 1),
               "2 workers stock": ("stock", 2, None, 1),
               "2 alone": ("alone", 2, None, 1)}
    for compression in filter(None, args.compressions.split(",")):
        configs[f"2 workers tfpar {compression}"] = ("tfpar", 2, compression, 1)
    for n in filter(None, args.sync_everys.split(",")):
        configs[f"2 workers tfpar sync_every={int(n)}"] = ("tfpar", 2, None, int(n))
    times = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, (kind, workers, compression, sync_every) in configs.items():
            seconds, replicas = run_config(args, kind, workers, compression, sync_every)
            assert replicas == workers
            times[name].append(seconds)
    step = {name: statistics.median(t) for name, t in times.items()}
    throughput = {name: configs[name][1] * args.per_worker_batch / s for name, s in step.items()}
    result = {
        "benchmark": "multi_worker",
        "command": "python benchmarks/multi_worker.py " + " ".join(
            f"--{k}={v}" for k, v in vars(args).items()
            if k not in ("out", "worker", "result") and v is not None
            and not (args.model == "cnn" and k in ("width", "layers"))),
        "model": (f"MLP {args.layers}x{args.width}" if args.model == "mlp" else
                  "VGG-style CNN, 6 convolutions, 32x32 images")
                 + f", per-worker batch {args.per_worker_batch}",
        "step_ms": {k: round(v * 1000, 1) for k, v in step.items()},
        "samples_per_s": {k: round(v, 1) for k, v in throughput.items()},
        "scaling_2_workers": round(throughput["2 workers tfpar"] / throughput["1 worker tfpar"], 3),
        **{f"scaling_2_workers_{name.split()[-1]}": round(
            throughput[name] / throughput["1 worker tfpar"], 3)
           for name in configs if name.startswith("2 workers tfpar ")},
        "two_stream_ceiling": _ceiling(args),
        "two_process_ceiling": round(throughput["2 alone"] / throughput["1 worker tfpar"], 3),
        "tfpar_step_time_vs_stock": round(step["2 workers tfpar"] / step["2 workers stock"], 3),
        "all_step_ms": {k: [round(t * 1000, 1) for t in v] for k, v in times.items()},
    }
    print(json.dumps(result, indent=2))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
