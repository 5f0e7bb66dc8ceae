"""Saving and loading a ZeRO model across 4 worker processes: bytes each process writes and
reads, and the wall time, for Keras' single `.weights.h5` (gathered: every value fetched
from its owner, the chief writing the file, the other workers a copy each to a temporary
path, as a multi-worker program must) against Keras' sharded `.weights.json` written by
the owners in parallel (`tfpar.keras.owner_saving`: each worker its own share).

    python benchmarks/checkpoint_writes.py [--shard parameters] [--width 1024] [--layers 8]

A job of `tfpar launch --workers 4` (one CPU device per worker), each worker training
`DataParallelStrategy(shard=...)` one step of `hidden_mlp` (Adam) and then saving both ways
and loading both ways. Bytes are the process's own read and write system calls
(`/proc/self/io` rchar/wchar, so they include small files and logs but not sockets); times are
the slowest worker's.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _common import command_line, hidden_mlp, write_json  # noqa: E402


def _io():
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])


def _measured(action):
    read, written = _io()
    start = time.perf_counter()
    action()
    seconds = time.perf_counter() - start
    read_after, written_after = _io()
    return {"seconds": seconds, "read": read_after - read, "written": written_after - written}


def worker(args):
    import numpy as np
    import tensorflow as tf

    import tfpar

    strategy = tfpar.DataParallelStrategy(shard=args.shard, timeout_seconds=600)
    with strategy.scope():
        model = hidden_mlp(args.width, args.layers)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, args.width), dtype=np.float32)
    y = (np.arange(16) % 10).astype("int32")
    model.train_on_batch(x, y)
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    gathered = os.path.join(args.dir if task == 0 else tempfile.mkdtemp(), "model.weights.h5")
    sharded = os.path.join(args.dir, "model.weights.json")
    result = {
        "parameters": model.count_params(),
        "state_bytes": sum(v.numpy().nbytes for v in model.weights)
        + sum(int(np.prod(v.shape)) * 4 for v in model.optimizer.variables),
        "save .weights.h5 (gathered)": _measured(lambda: model.save_weights(gathered)),
        "save .weights.json (owners)": _measured(
            lambda: model.save_weights(sharded, max_shard_size=1)),
        "load .weights.h5": _measured(lambda: model.load_weights(
            os.path.join(args.dir, "model.weights.h5"))),
        "load .weights.json": _measured(lambda: model.load_weights(sharded)),
    }
    with open(os.path.join(args.dir, f"worker-{task}.json"), "w") as f:
        json.dump(result, f)
    del tf


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard", default="parameters",
                        choices=["optimizer", "gradients", "parameters"])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "checkpoint_writes.json"))
    args = parser.parse_args()
    if args.dir:
        return worker(args)
    with tempfile.TemporaryDirectory() as directory:
        command = [sys.executable, "-m", "tfpar.cli.launch", f"--workers={args.workers}",
                   "--timeout=900", "--", sys.executable, os.path.abspath(__file__),
                   f"--dir={directory}", f"--shard={args.shard}", f"--width={args.width}",
                   f"--layers={args.layers}"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1000)
        if done.returncode:
            raise RuntimeError(f"exit {done.returncode}\n{done.stdout[-3000:]}"
                               f"{done.stderr[-3000:]}")
        workers = [json.load(open(os.path.join(directory, f"worker-{i}.json")))
                   for i in range(args.workers)]
    mib = 1 << 20
    state = workers[0]["state_bytes"]
    print(f"ZeRO shard={args.shard!r}, {args.workers} worker processes, MLP "
          f"{args.layers}x{args.width} + head ({workers[0]['parameters']:,} parameters), "
          f"Adam: {state / mib:.1f} MiB of weights and optimizer state")
    print(f"{'':30s} {'seconds':>8s} " + " ".join(f"{f'w{i} MiB':>8s}"
                                                  for i in range(args.workers))
          + f" {'max/state':>9s}")
    rows = {}
    for what in [k for k in workers[0] if k.startswith(("save", "load"))]:
        kind = "written" if what.startswith("save") else "read"
        per_worker = [w[what][kind] for w in workers]
        seconds = max(w[what]["seconds"] for w in workers)
        rows[what] = {"seconds": seconds, f"bytes_{kind}_per_worker": per_worker,
                      "busiest_over_state": max(per_worker) / state}
        print(f"{what:30s} {seconds:8.2f} "
              + " ".join(f"{b / mib:8.1f}" for b in per_worker)
              + f" {max(per_worker) / state:9.2f}")
    write_json(args.out, {"benchmark": "checkpoint_writes",
                          "command": command_line("checkpoint_writes", argparse.Namespace(**{
                              k: v for k, v in vars(args).items() if k != "dir"})),
                          "state_bytes": state, "rows": rows})


if __name__ == "__main__":
    main()
