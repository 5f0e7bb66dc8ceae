"""What gradient compression costs in accuracy: the training binary's job (data parallelism on
2 logical CPUs, the built-in spirals dataset, Adam with cosine decay, 10 epochs) with the
replicas' gradients summed in float32, float16 and bfloat16
(`python -m tfpar.cli.train --compression=...`), the same seed each, side by side.

    python benchmarks/compression_accuracy.py [--epochs 10] [--out FILE]
"""

import argparse
import json
import os
import re
import subprocess
import sys

from _common import write_json


def train(compression, epochs):
    command = [sys.executable, "-m", "tfpar.cli.train", f"--compression={compression}",
               f"--epochs={epochs}", "--verbose=0"]
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
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "compression_accuracy.json"))
    args = parser.parse_args()
    rows = {}
    print(f"{'compression':12s} {'test loss':>9s} {'accuracy':>9s}")
    for compression in ("none", "fp16", "bf16"):
        rows[compression] = train(compression, args.epochs)
        print(f"{compression:12s} {rows[compression]['loss']:9.4f} "
              f"{rows[compression]['accuracy']:9.4f}", flush=True)
    write_json(args.out, {"benchmark": "compression_accuracy",
                          "command": f"python benchmarks/compression_accuracy.py "
                                     f"--epochs={args.epochs}", "rows": rows})


if __name__ == "__main__":
    main()
