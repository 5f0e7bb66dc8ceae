"""What less communication costs in accuracy: the training binary's job (data parallelism on
2 logical CPUs, the built-in spirals dataset, Adam with cosine decay, 10 epochs) with the
replicas' gradients summed in float32, float16 and bfloat16
(`python -m tfpar.cli.train --compression=...`), and with periodic averaging every n steps
(`--sync_every=n`, n in --sync_everys), the same seed each, side by side.

    python benchmarks/compression_accuracy.py [--epochs 10] [--sync_everys 4,16] [--out FILE]
"""

import argparse
import json
import os
import re
import subprocess
import sys

from _common import write_json


def train(compression, epochs, sync_every=1):
    command = [sys.executable, "-m", "tfpar.cli.train", f"--compression={compression}",
               f"--sync_every={sync_every}", f"--epochs={epochs}", "--verbose=0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    found = re.search(r"final: loss=([\d.]+) accuracy=([\d.]+) samples/s=(\d+)", done.stdout)
    if done.returncode or not found:
        raise RuntimeError(f"{compression}: exit {done.returncode}\n{done.stdout[-2000:]}"
                           f"{done.stderr[-2000:]}")
    return {"loss": float(found[1]), "accuracy": float(found[2]),
            "samples_per_s": int(found[3])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--sync_everys", default="4,16",
                        help="comma-separated sync_every values to train with as well")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "compression_accuracy.json"))
    args = parser.parse_args()
    rows = {}
    print(f"{'compression':12s} {'test loss':>9s} {'accuracy':>9s}")
    runs = [(name, dict(compression=name)) for name in ("none", "fp16", "bf16")] + [
        (f"sync_every={n}", dict(compression="none", sync_every=int(n)))
        for n in filter(None, args.sync_everys.split(","))]
    for name, kwargs in runs:
        rows[name] = train(epochs=args.epochs, **kwargs)
        print(f"{name:12s} {rows[name]['loss']:9.4f} {rows[name]['accuracy']:9.4f}",
              flush=True)
    write_json(args.out, {"benchmark": "compression_accuracy",
                          "command": f"python benchmarks/compression_accuracy.py "
                                     f"--epochs={args.epochs} --sync_everys={args.sync_everys}",
                          "rows": rows})


if __name__ == "__main__":
    main()
