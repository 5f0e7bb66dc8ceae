"""All-reduce across worker processes: TensorFlow's ring against halving-doubling and
recursive doubling (`DataParallelStrategy(communication="halving_doubling")`), by buffer size.

4 and 8 worker processes on 127.0.0.1 (one replica each, one thread per op, pinned to the
cores in turn). Each worker makes one strategy per algorithm, in the same order, and times a
`tf.function` that all-reduces one float32 buffer in replica context (each call a barrier:
every replica waits for the sum), for each size; the three alternate round by round.

  ring                TensorFlow's ring: 2 (n-1) steps, 2 (n-1)/n of the buffer sent
  halving_doubling    Rabenseifner: 2 log2(n) steps, the ring's bytes
  recursive_doubling  log2(n) steps, log2(n) x the buffer sent
  auto                halving_doubling as tfpar picks per buffer (recursive doubling up to
                      `tfpar.plan.halving_doubling.DOUBLING_BYTES`)

    python benchmarks/all_reduce_algorithms.py [--workers 4,8] [--sizes 4096,...] [--rounds 3]
"""

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import all_reduce_functions, write_json  # noqa: E402

OUTPUT = (lambda line: None) if not os.environ.get("BENCH_VERBOSE") else print
ALGORITHMS = ("ring", "halving_doubling", "recursive_doubling", "auto")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="4,8", help="comma-separated process counts")
    parser.add_argument("--sizes", default="4096,65536,1048576,16777216",
                        help="buffer sizes in bytes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0,
                        help="time spent per (algorithm, size) and round, about")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "all_reduce_algorithms.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args()


def _strategy(algorithm):
    import tfpar
    from tfpar.plan import halving_doubling

    if algorithm in ("halving_doubling", "recursive_doubling"):  # One algorithm for all sizes.
        halving_doubling.DOUBLING_BYTES = -1 if algorithm == "halving_doubling" else 1 << 40
    elif algorithm == "auto":
        halving_doubling.DOUBLING_BYTES = DEFAULT_DOUBLING_BYTES
    communication = "ring" if algorithm == "ring" else "halving_doubling"
    # No timeout: TensorFlow gives each collective with one a thread that sleeps that long
    # (its Env::SchedClosureAfter), and this loop launches thousands a second: at the
    # default 600 s the workers died at ~5,800 threads each (BUILD_NOTES).
    return tfpar.DataParallelStrategy(communication=communication, bytes_per_pack=0,
                                      timeout_seconds=math.inf)


def worker(args):
    config = json.loads(os.environ["TF_CONFIG"])
    index = config["task"]["index"]
    os.sched_setaffinity(0, {index % os.cpu_count()})
    import tfpar

    tfpar.virtual_cpus(1, one_core_each=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    strategies = {a: _strategy(a) for a in ALGORITHMS}
    functions = all_reduce_functions(strategies, sizes, index)
    # Each (algorithm, size): the same number of calls on every worker, fixed from the
    # size (the calls are barriers: a worker that made more would wait forever).
    calls = {size: max(3, int(args.seconds / (1e-3 + size / 50e6))) for size in sizes}
    times = {f"{a} {s}": [] for a in ALGORITHMS for s in sizes}
    for _ in range(args.rounds):
        for size in sizes:
            for algorithm in ALGORITHMS:
                function = functions[algorithm, size]
                function()
                start = time.perf_counter()
                for _ in range(calls[size]):
                    function()
                times[f"{algorithm} {size}"].append((time.perf_counter() - start) / calls[size])
    if index == 0:
        with open(args.result, "w") as f:
            json.dump(times, f)


def run(args, workers):
    from tfpar.cluster.launcher import Launcher

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--worker", f"--result={result}",
                   f"--sizes={args.sizes}", f"--rounds={args.rounds}",
                   f"--seconds={args.seconds}"]
        code = Launcher(command, workers, output=OUTPUT).run()
        if code != 0:
            raise RuntimeError(f"{workers} workers failed with exit code {code}")
        with open(result) as f:
            return json.load(f)


def main():
    args = parse_args()
    if args.worker:
        return worker(args)
    from tfpar.plan import halving_doubling as steps

    sizes = [int(s) for s in args.sizes.split(",")]
    table = {}
    for workers in (int(w) for w in args.workers.split(",")):
        times = run(args, workers)
        table[workers] = {}
        for size in sizes:
            ms = {a: round(statistics.median(times[f"{a} {size}"]) * 1000, 3)
                  for a in ALGORITHMS}
            table[workers][size] = {
                "ms": ms,
                "vs_ring": {a: round(ms[a] / ms["ring"], 3) for a in ALGORITHMS if a != "ring"},
                "steps": {a: steps.sequential_steps(workers, a if a != "auto" else steps.choose(
                    size, workers)) for a in ALGORITHMS},
                "bytes_sent": {a: steps.bytes_sent(size, workers, a if a != "auto" else
                                                   steps.choose(size, workers))
                               for a in ALGORITHMS},
                "all_ms": {a: [round(t * 1000, 3) for t in times[f"{a} {size}"]]
                           for a in ALGORITHMS},
            }
    result = {
        "benchmark": "all_reduce_algorithms",
        "command": "python benchmarks/all_reduce_algorithms.py " + " ".join(
            f"--{k}={v}" for k, v in vars(args).items()
            if k not in ("out", "worker", "result") and v is not None),
        "cores": os.cpu_count(),
        "doubling_bytes": DEFAULT_DOUBLING_BYTES,
        "by_workers_and_bytes": table,
    }
    print(json.dumps({w: {s: (r["ms"], r["vs_ring"]) for s, r in t.items()}
                      for w, t in table.items()}, indent=1))
    write_json(args.out, result)


def _default_doubling_bytes():
    from tfpar.plan import halving_doubling

    return halving_doubling.DOUBLING_BYTES


DEFAULT_DOUBLING_BYTES = _default_doubling_bytes()

if __name__ == "__main__":
    main()
