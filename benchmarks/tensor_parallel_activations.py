"""Each device's allocator peak when a keras-hub Transformer block is split T ways, T = 1, 2,
4, one worker process per device: does a stage device's activation memory fall as 1/T?

Each T runs as a job of its own: `tfpar launch --workers T --coordinator` (a chief that runs
the program, T workers that hold the stage, one CPU device each), `tfpar.PipelineStrategy(
num_stages=1, tensor_parallel=T, layout_map=...)` splitting the blocks' attention by heads
(query/key/value by columns, the output projection by rows) and the MLP Megatron's way. The
model: GPT-2-shaped decoder blocks of keras-hub (`TransformerDecoder`, causal
self-attention), small hidden size and a long sequence, so that what a step holds is its
activations (attention scores grow with the square of the sequence), not its weights.
After the chief's steps the launcher stops the workers, and each prints TensorFlow's
allocator peak for its device (`tfpar.cluster.server`); `--peaks_only` prints them.

    python benchmarks/tensor_parallel_activations.py [--sequence 1024] [--tensor_parallel 1,2,4]
"""

import argparse
import json
import os
import re
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _common import command_line, write_json  # noqa: E402


def gpt2_blocks(args):
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    tokens = keras.Input((args.sequence,), dtype="int32")
    x = keras_hub.layers.TokenAndPositionEmbedding(args.vocabulary, args.sequence,
                                                   args.hidden)(tokens)
    for i in range(args.blocks):
        x = keras_hub.layers.TransformerDecoder(4 * args.hidden, args.heads, dropout=0.0,
                                                name=f"block_{i}")(x)
    model = keras.Model(tokens, keras.layers.Dense(args.vocabulary, name="lm_head")(x))
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def megatron_blocks_layout():
    import keras

    layout_map = keras.distribution.LayoutMap(None)
    layout_map[r".*self_attention/(query|key|value)/kernel"] = (None, "model", None)
    layout_map[r".*self_attention/attention_output/kernel"] = ("model", None, None)
    layout_map[r".*feedforward_intermediate_dense/kernel"] = (None, "model")
    layout_map[r".*feedforward_output_dense/kernel"] = ("model", None)
    return layout_map


def chief(args):
    """On the chief: trains `--steps` steps of the split blocks."""
    import numpy as np
    import tensorflow as tf

    import tfpar

    strategy = tfpar.PipelineStrategy(
        num_stages=1, num_micro_batches=1, tensor_parallel=args.t,
        layout_map=megatron_blocks_layout() if args.t > 1 else None,
        cluster_resolver=tf.distribute.cluster_resolver.TFConfigClusterResolver())
    with strategy.scope():
        model = gpt2_blocks(args)
    rng = np.random.default_rng(0)
    x = rng.integers(0, args.vocabulary, (args.batch, args.sequence)).astype("int32")
    y = rng.integers(0, args.vocabulary, (args.batch, args.sequence)).astype("int32")
    losses = [float(model.train_on_batch(x, y)) for _ in range(args.steps)]
    print("RESULT " + json.dumps({"losses": losses, "params": model.count_params()}), flush=True)


def run(t, args):
    """Runs the job for T = t; returns {worker: allocator peak in bytes} and the chief's result."""
    command = [sys.executable, "-m", "tfpar.cli.launch", f"--workers={t}", "--coordinator",
               "--timeout=900", "--", sys.executable, os.path.abspath(__file__),
               "--role=chief", f"--t={t}"] + [
        f"--{key}={value}" for key, value in vars(args).items()
        if key not in ("out", "role", "t", "tensor_parallel")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1000)
    output = done.stdout + done.stderr
    found = [line.split("RESULT ", 1)[1] for line in output.splitlines() if "RESULT " in line]
    peaks = {}
    for line in output.splitlines():
        said = re.search(r"(worker[:\-/ ]?\d+).*allocator [\d.]+ MiB \(peak ([\d.]+) MiB\)", line)
        if said:
            peaks[said[1]] = int(float(said[2]) * (1 << 20))
    if done.returncode or not found or len(peaks) != t:
        raise RuntimeError(f"T={t}: exit {done.returncode}, peaks {peaks}\n{output[-4000:]}")
    return peaks, json.loads(found[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequence", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocabulary", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tensor_parallel", default="1,2,4")
    parser.add_argument("--role", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--t", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "tensor_parallel_activations.json"))
    args = parser.parse_args()
    if args.role == "chief":
        chief(args)
        return
    mib = 1 << 20
    scores = args.batch * args.heads * args.sequence ** 2 * 4
    print(f"{args.blocks} GPT-2 blocks of keras-hub, hidden {args.hidden}, {args.heads} heads, "
          f"sequence {args.sequence}, batch {args.batch}; one block's attention scores "
          f"{scores / mib:.0f} MiB; allocator peak per worker (MiB)")
    rows = {}
    for t in [int(v) for v in args.tensor_parallel.split(",")]:
        peaks, result = run(t, args)
        ordered = [peaks[k] for k in sorted(peaks)]
        rows[t] = {"peaks": peaks, "busiest": max(ordered), "losses": result["losses"]}
        print(f"T={t}: " + ", ".join(f"{p / mib:.1f}" for p in ordered)
              + f"   busiest {max(ordered) / mib:.1f}   losses {result['losses']}", flush=True)
    if 1 in rows:
        for t, row in rows.items():
            row["busiest_vs_one"] = row["busiest"] / rows[1]["busiest"]
            print(f"T={t}: busiest device / one device {row['busiest_vs_one']:.3f} "
                  f"(1/T = {1 / t:.3f})")
    shown = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in ("role", "t")})
    write_json(args.out, {"benchmark": "tensor_parallel_activations",
                          "command": command_line("tensor_parallel_activations", shown),
                          "rows": rows})


if __name__ == "__main__":
    main()
