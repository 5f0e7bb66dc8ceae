"""Tensor parallelism (keras.distribution on TensorFlow) against one device.

A wide Megatron MLP block (Dense(ff, gelu) split by columns, then Dense(hidden) split by
rows) trained with SGD under `model.fit`, on one device and on a (1, 2) mesh of 2 logical
CPUs (one core each), candidates alternating round by round. In the same run: the ceiling
of these 2 CPUs (two concurrent matmul streams, each the size of one device's share,
against both on one device), and the bytes each device sends per step, from the
all-reduces TensorFlow launches (counted in a child process from its collective log)
against the Megatron formula (`tfpar.plan.layouts.megatron_mlp_bytes`).

    python benchmarks/tensor_parallel.py [--tokens 512] [--hidden 1024] [--ff 4096]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _common import two_stream_ceiling, write_json  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="rows of a batch")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ff", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count_collectives", action="store_true",
                        help="(internal) run one step and exit, for the collective count")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "tensor_parallel.json"))
    return parser.parse_args()


def build(args):
    import keras

    keras.utils.set_random_seed(0)
    # A replicated layer before the block: its weights need the block's input gradient,
    # as in a deeper network (Megatron's backward all-reduce).
    model = keras.Sequential([keras.Input((args.hidden,)),
                              keras.layers.Dense(args.hidden, name="embed"),
                              keras.layers.Dense(args.ff, activation="gelu", name="mlp_up"),
                              keras.layers.Dense(args.hidden, name="mlp_down")])
    model.compile(keras.optimizers.SGD(1e-3), "mse", jit_compile=False)
    return model


def mesh_distribution():
    import keras

    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"],
                                         keras.distribution.list_devices()[:2])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*mlp_up/kernel"] = (None, "model")
    layout_map[".*mlp_up/bias"] = ("model",)
    layout_map[".*mlp_down/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layout_map)


def data(args):
    import numpy as np

    rng = np.random.default_rng(0)
    return (rng.normal(size=(args.tokens, args.hidden)).astype("float32"),
            rng.normal(size=(args.tokens, args.hidden)).astype("float32"))


def runner(model, args):
    x, y = data(args)
    model.train_on_batch(x, y)  # trace and warm up

    def run():
        for _ in range(args.steps):
            model.train_on_batch(x, y)
    return run


def count_collectives(args):
    """All-reduces launched per device in one training step on the mesh, from
    TensorFlow's collective log of a child process."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="collective_ops=1")
    done = subprocess.run([sys.executable, __file__, "--count_collectives",
                           f"--tokens={args.tokens}", f"--hidden={args.hidden}",
                           f"--ff={args.ff}"], env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    lines = (done.stdout + done.stderr).splitlines()
    start = lines.index("TIMED STEP")
    return sum("Collective ExecuteAsync start" in line and "AllReduce" in line
               for line in lines[start:]) / 2  # 2 devices


def main():
    args = parse_args()
    import tfpar

    tfpar.virtual_cpus(2, one_core_each=True)
    import keras
    import tensorflow as tf

    tfpar.use_keras_distribution()
    if args.count_collectives:
        keras.distribution.set_distribution(mesh_distribution())
        model = build(args)
        x, y = data(args)
        model.train_on_batch(x, y)
        tf.test.experimental.sync_devices()
        print("TIMED STEP", file=sys.stderr, flush=True)
        model.train_on_batch(x, y)
        tf.test.experimental.sync_devices()
        return
    one_device = build(args)
    keras.distribution.set_distribution(mesh_distribution())
    tensor_parallel = build(args)
    keras.distribution.set_distribution(None)
    runners = {"one device": runner(one_device, args),
               "tensor parallel (1, 2)": runner(tensor_parallel, args)}
    times = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) / args.steps)
    step = {name: statistics.median(t) for name, t in times.items()}
    from tfpar.plan import layouts

    all_reduces = count_collectives(args)
    activation = args.tokens * args.hidden * 4
    result = {
        "benchmark": "tensor_parallel",
        "command": "python benchmarks/tensor_parallel.py " + " ".join(
            f"--{k}={v}" for k, v in vars(args).items() if k not in ("out", "count_collectives")),
        "model": f"Dense({args.hidden}) then a Megatron MLP block {args.hidden} -> {args.ff} "
                 f"-> {args.hidden}, SGD, {args.tokens} rows",
        "step_ms": {name: round(s * 1000, 2) for name, s in step.items()},
        "speedup": round(step["one device"] / step["tensor parallel (1, 2)"], 3),
        # One device's share of the block's up-projection per stream.
        "two_stream_ceiling": round(two_stream_ceiling(
            args.tokens, args.hidden, args.ff // 2, args.rounds, args.steps), 3),
        "all_reduces_per_step_per_device": all_reduces,
        "bytes_sent_per_step_per_device": layouts.ring_all_reduce_bytes(activation, 2)
        * all_reduces,
        "megatron_bytes_per_step_per_device": layouts.megatron_mlp_bytes(
            args.tokens, args.hidden, 2),
        "all_step_ms": {k: [round(t * 1000, 2) for t in v] for k, v in times.items()},
        "tensorflow": tf.__version__,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "all_step_ms"}, indent=2))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
