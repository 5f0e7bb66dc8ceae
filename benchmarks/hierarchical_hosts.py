"""Bytes between hosts: TensorFlow's ring against tfpar's hierarchical all-reduce
(`DataParallelStrategy(communication="hierarchical")`), on simulated hosts.

`tfpar launch --hosts H --workers N` (network namespaces joined by virtual links, workers in
blocks of N/H per host; BUILD_NOTES "Operating on clusters"). Each worker makes both
strategies in the same order and times a `tf.function` that all-reduces one float32 buffer in
replica context, for each size, the two alternating round by round. Worker 0 (on host 0,
where the links end) reads the bytes each link carried (`/proc/net/dev` of its namespace)
around each timed loop: every byte that crossed between hosts, from every worker.

  formula, bytes over the link per all-reduce of B bytes (tx + rx), 2 hosts:
  ring          its ring runs through the workers in task order, so 2 of its N edges join
                the hosts, each carrying 2 (N-1)/N B
  hierarchical  each host sends 2 (H-1)/H B (`host_hierarchy.bytes_between_hosts`), and
                receives as much

    python benchmarks/hierarchical_hosts.py [--workers 4] [--sizes ...] [--rounds 3]
        [--link_mbit 1000] [--out ...]
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import all_reduce_functions, write_json  # noqa: E402

COMMUNICATIONS = ("ring", "hierarchical")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2, choices=[2],
                        help="2 (the formulas count one link)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--sizes", default="1048576,16777216",
                        help="buffer sizes in bytes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--link_mbit", type=float, default=None,
                        help="the link's rate (tfpar launch --link_mbit); default: unlimited")
    parser.add_argument("--calls", type=int, default=10, help="all-reduces per timed loop")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "hierarchical_hosts.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args()


def _link_bytes():
    """Bytes received plus sent on the simulated hosts' links seen from this namespace."""
    total = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, data = line.split(":", 1)
            if name.strip().startswith("tfpar"):
                fields = data.split()
                total += int(fields[0]) + int(fields[8])
    return total


def worker(args):
    config = json.loads(os.environ["TF_CONFIG"])
    index = config["task"]["index"]
    import tfpar

    tfpar.virtual_cpus(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    # No timeout: TensorFlow keeps a thread per timed collective for the timeout (BUILD_NOTES).
    strategies = {c: tfpar.DataParallelStrategy(communication=c, bytes_per_pack=0,
                                                timeout_seconds=math.inf)
                  for c in COMMUNICATIONS}
    functions = all_reduce_functions(strategies, sizes, index)
    times = {f"{c} {s}": [] for c in COMMUNICATIONS for s in sizes}
    link = {f"{c} {s}": [] for c in COMMUNICATIONS for s in sizes}
    for _ in range(args.rounds):
        for size in sizes:
            for name in COMMUNICATIONS:
                function = functions[name, size]
                function()
                before, start = _link_bytes(), time.perf_counter()
                for _ in range(args.calls):
                    function()
                times[f"{name} {size}"].append((time.perf_counter() - start) / args.calls)
                link[f"{name} {size}"].append((_link_bytes() - before) / args.calls)
    if index == 0:
        with open(args.result, "w") as f:
            json.dump({"times": times, "link": link}, f)


def main():
    args = parse_args()
    if args.worker:
        return worker(args)
    from tfpar.plan import host_hierarchy

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        command = [sys.executable, "-m", "tfpar.cli.launch", f"--hosts={args.hosts}",
                   f"--workers={args.workers}",
                   *([f"--link_mbit={args.link_mbit:g}"] if args.link_mbit else []),
                   "--", sys.executable,
                   os.path.abspath(__file__), "--worker", f"--result={result}",
                   f"--sizes={args.sizes}", f"--rounds={args.rounds}", f"--calls={args.calls}"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the workers failed ({done.returncode}):\n"
                               f"{done.stdout[-3000:]}")
        with open(result) as f:
            measured = json.load(f)
    hosts, workers = args.hosts, args.workers
    per_host = workers // hosts
    # The ring crosses between the two hosts on two of its edges (a host's last worker to
    # the other's first), each carrying 2 (N-1)/N of the buffer; the link counts both (tx +
    # rx at host 0's end). The hierarchy: what each host sends, both ways.
    table = {}
    for size in (int(s) for s in args.sizes.split(",")):
        formula = {"ring": 2 * 2 * (workers - 1) / workers * size,
                   "hierarchical": 2 * host_hierarchy.bytes_between_hosts(size, hosts,
                                                                          per_host)}
        row = {}
        for name in COMMUNICATIONS:
            link = statistics.median(measured["link"][f"{name} {size}"])
            row[name] = {"ms": round(statistics.median(measured["times"][f"{name} {size}"])
                                     * 1000, 2),
                         "link_mib": round(link / 2**20, 3),
                         "formula_mib": round(formula[name] / 2**20, 3),
                         "vs_formula": round(link / formula[name], 3)}
        row["hierarchical_vs_ring"] = {
            "link": round(row["hierarchical"]["link_mib"] / row["ring"]["link_mib"], 3),
            "time": round(row["hierarchical"]["ms"] / row["ring"]["ms"], 3)}
        table[size] = row
    result = {"benchmark": "hierarchical_hosts",
              "command": "python benchmarks/hierarchical_hosts.py " + " ".join(
                  f"--{k}={v}" for k, v in vars(args).items()
                  if k not in ("out", "worker", "result") and v is not None),
              "cores": os.cpu_count(), "hosts": hosts, "workers": workers,
              "link_mbit": args.link_mbit,
              "by_bytes": table}
    print(json.dumps(table, indent=1))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
