"""The longest sequence a Llama-shaped decoder trains on under a per-process memory cap, with
its sequences split over C worker processes (`DataParallelStrategy(context_parallel=C)`)
against one process (C = 1), and the step time at each length.

    python benchmarks/long_context.py [--cap=1.5G] [--contexts=1,2,4] [--lengths=...]

Each (C, length) is a job of `tfpar launch --workers=C --memory_cap=CAP` (one CPU device per
worker, each worker in a memory cgroup of its own: the kernel kills one over the cap): a
keras-hub `LlamaBackbone` (hidden 64, 2 blocks, 4 query and 2 key/value heads, vocabulary 256)
with a Dense head, SGD, batch 1, one traced step and `--steps` timed steps (2). For each C, lengths are
tried in increasing order until one fails; the longest that trained is reported with each
worker's TensorFlow allocator peak and resident peak, and the bytes each worker sent per step
(its TCP sockets, `ss`, as `hybrid_traffic.py` counts them) against `step_bytes`. Writes
benchmarks/results/long_context.json.

What to expect: context parallelism divides the activations of each position's layers
(O(L/C) per device); attention runs by blocks of keys, a loop, with a recomputing backward
(`tfpar.distribute.context.blockwise_attention`), so a device holds its L/C queries against one
block of keys at a time, plus the whole sequence's keys and values. C = 1 is plain Keras
(attention's whole L x L scores). Session 33: C=1 3,072; C=2 and C=4 every length tried up to
65,536, allocator peaks halved by C at each length. (Unrolled blocks: 24,576 for both,
`results/long_context_unrolled.json`; before blockwise attention, sqrt(C):
`results/long_context_gathered.json`.)
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import command_line, write_json  # noqa: E402
from hybrid_traffic import bytes_by_task, loopback_sent, socket_counters  # noqa: E402

HIDDEN, LAYERS, VOCABULARY = 64, 2, 256


def task(args):
    """One worker: trains the decoder on sequences of --length, writes its figures."""
    import keras
    import keras_hub
    import numpy as np
    import tensorflow as tf

    import tfpar

    config = json.loads(os.environ["TF_CONFIG"])
    index = config["task"]["index"]
    strategy = tfpar.DataParallelStrategy(context_parallel=len(config["cluster"]["worker"]))
    with strategy.scope():
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=VOCABULARY, num_layers=LAYERS, num_query_heads=4,
            num_key_value_heads=2, hidden_dim=HIDDEN, intermediate_dim=2 * HIDDEN)
        inputs = {k: keras.Input((args.length,), dtype="int32", name=k) for k in backbone.input}
        model = keras.Model(inputs, keras.layers.Dense(VOCABULARY)(backbone(inputs)))
        model.compile(keras.optimizers.SGD(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCABULARY, size=(args.steps, args.length)).astype("int32")
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    y = np.roll(tokens, -1, axis=1)
    tfpar.reset_memory_peaks()
    model.fit(x, y, batch_size=1, epochs=1, steps_per_epoch=1, verbose=0)  # Traced.
    before = socket_counters() if index == 0 else None
    loopback = loopback_sent()
    start = time.perf_counter()
    loss = model.fit(x, y, batch_size=1, epochs=1, verbose=0).history["loss"][0]
    seconds = (time.perf_counter() - start) / args.steps
    after = bytes_by_task(since=before)[0] if index == 0 else {}
    # Every worker's bytes over loopback (each counted once): a check on the sockets' count,
    # which misses connections gRPC closed before the second snapshot.
    loopback = (loopback_sent() - loopback) / args.steps
    memory = tfpar.process_memory()
    with open(os.path.join(args.dir, f"worker-{index}.json"), "w") as f:
        json.dump({"seconds_per_step": seconds, "loss": loss,
                   "allocator_peak": memory.allocator_peak_bytes,
                   "resident_peak": memory.rss_peak_bytes,
                   "sent_per_step": {task: sent / args.steps for task, (sent, _) in after.items()},
                   "loopback_per_step": loopback,
                   "parameters": model.count_params()}, f)
    del tf


def step_bytes(length, context, parameters):
    """Bytes one worker sends per step by the formula: the gradients' ring all-reduce,
    and per block the keys' and values' ring all-gather forward ((C-1) x its part, of the 2
    key/value heads: half the hidden width), the padding mask's (int32), and backward
    TensorFlow's gradient of the gather, a ring all-reduce of the whole sequence's gradient
    (2 (C-1)/C x L x width, for keys and values)."""
    share = (context - 1) / context
    part = length // context
    width = HIDDEN // 2  # (2 of 4 heads: Llama's grouped-query attention.)
    per_block = 2 * (context - 1) * part * width * 4 + (context - 1) * part * 4 \
        + 2 * 2 * share * length * width * 4
    return 2 * share * 4 * parameters + LAYERS * per_block


def trial(context, length, cap, timeout, steps=2):
    """Runs one job; returns its figures, or None when a worker failed (over the cap)."""
    with tempfile.TemporaryDirectory() as directory:
        command = [sys.executable, "-m", "tfpar.cli.launch", f"--workers={context}",
                   f"--memory_cap={cap}", f"--timeout={timeout}", "--",
                   sys.executable, os.path.abspath(__file__), "--role=task",
                   f"--dir={directory}", f"--length={length}", f"--steps={steps}"]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout + 60)
        wall = time.perf_counter() - start
        files = [os.path.join(directory, f"worker-{i}.json") for i in range(context)]
        if done.returncode or not all(os.path.exists(f) for f in files):
            killed = "Killed" in done.stdout + done.stderr or "signal 9" in done.stdout
            return {"trained": False, "exit": done.returncode, "killed": killed,
                    "tail": (done.stdout + done.stderr)[-600:], "wall_seconds": wall}
        workers = [json.load(open(f)) for f in files]
    sent = {t: b for t, b in workers[0]["sent_per_step"].items() if t.startswith("worker")}
    return {"trained": True, "wall_seconds": wall, "sent_per_step": sent,
            "formula_per_step": step_bytes(length, context, workers[0]["parameters"]),
            "seconds_per_step": max(w["seconds_per_step"] for w in workers),
            "loopback_per_step": workers[0].get("loopback_per_step"),
            "allocator_peak": [w["allocator_peak"] for w in workers],
            "resident_peak": [w["resident_peak"] for w in workers],
            "loss": workers[0]["loss"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default="driver", choices=["driver", "task"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, default=1024, help=argparse.SUPPRESS)
    parser.add_argument("--cap", default="1.5GiB", help="memory cap per worker process")
    parser.add_argument("--contexts", default="1,2,4")
    parser.add_argument("--lengths", default="1024,1536,2048,2560,3072,4096,5120,6144,8192",
                        help="tried in order (multiples of 2C) until one fails")
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--steps", type=int, default=2,
                        help="timed steps after the traced one (1 saves a third at long lengths)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "long_context.json"))
    args = parser.parse_args()
    if args.role == "task":
        return task(args)
    mib = 1 << 20
    rows = {}
    for context in (int(c) for c in args.contexts.split(",")):
        rows[context] = {}
        for length in (int(n) for n in args.lengths.split(",")):
            result = trial(context, length, args.cap, args.timeout, args.steps)
            rows[context][length] = result
            _write(args, rows)
            if not result["trained"]:
                print(f"C={context} length {length}: did not train (exit {result['exit']}"
                      f"{', killed over the cap' if result['killed'] else ''})", flush=True)
                break
            busiest = max(result["sent_per_step"].values(), default=0)
            print(f"C={context} length {length}: {result['seconds_per_step']:.2f} s/step, "
                  f"allocator peak {max(result['allocator_peak']) / mib:.0f} MiB, resident "
                  f"peak {max(result['resident_peak']) / mib:.0f} MiB, busiest worker sent "
                  f"{busiest / mib:.2f} MiB/step (formula "
                  f"{result['formula_per_step'] / mib:.2f})", flush=True)
    longest = _write(args, rows, final=True)
    for context, length in longest.items():
        print(f"C={context}: longest sequence trained under {args.cap} per process: {length} "
              f"({length / max(longest[min(longest)], 1):.2f}x C={min(longest)})")


def _write(args, rows, final=False):
    """Writes the trials so far (after each one: a stopped run keeps what it measured)."""
    longest = {c: max([n for n, r in r_.items() if r["trained"]], default=0)
               for c, r_ in rows.items()}
    result = {"benchmark": "long_context", "command": command_line(
        "long_context", argparse.Namespace(**{k: v for k, v in vars(args).items()
                                              if k in ("cap", "contexts", "lengths", "steps")})),
        "model": {"hidden": HIDDEN, "layers": LAYERS, "heads": [4, 2], "batch": 1},
        "cap": args.cap, "longest": longest, "complete": final,
        "trials": {str(c): {str(n): r for n, r in r_.items()} for c, r_ in rows.items()}}
    if final:
        write_json(args.out, result)
    else:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return longest

if __name__ == "__main__":
    main()
