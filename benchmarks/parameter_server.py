"""Parameter-server throughput: 1 and 2 workers, and async against sync with a straggler.

Each configuration is a real cluster on 127.0.0.1 (chief, workers, one ps), run one
after the other in one invocation; each worker runs its ops on one thread (pinning a
TensorFlow server to one core with taskset made it hang here). The
straggler is worker 1 stopped two thirds of the time (SIGSTOP/SIGCONT every 30 ms):
about 3x slower, whatever runs on it. Throughput is training examples per second
of model.fit over the timed epoch (the first epoch, with tracing, is not timed).

    python benchmarks/parameter_server.py [--steps=40] [--rounds=1]
"""

import argparse
import json
import os
import signal
import subprocess
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfpar.cluster.launcher import Task, make_cluster  # noqa: E402
from tfpar.cluster.tf_config import ClusterConfig  # noqa: E402

SLOW_FRACTION = 2 / 3  # of each period the straggler spends stopped: 3x slower
PERIOD = 0.03


def chief(args):
    """Runs in the chief process: fit for 2 epochs, prints the timed epoch's throughput."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tfpar

    strategy = tfpar.ParameterServerStrategy(mode=args.mode)
    rng = np.random.default_rng(0)
    batch = args.batch * (strategy.num_workers if args.mode == "sync" else 1)
    x = rng.normal(size=(batch, args.width)).astype("float32")
    y = rng.integers(0, 10, batch).astype("int32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((args.width,))]
            + [keras.layers.Dense(args.width, activation="relu") for _ in range(args.layers)]
            + [keras.layers.Dense(10)])
        model.compile(keras.optimizers.SGD(0.001),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    times = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)

    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    model.fit(data, shuffle=False, steps_per_epoch=args.steps, epochs=2, verbose=0, callbacks=[Timer()])
    print("RESULT " + json.dumps({"examples_per_second": args.steps * batch / times[1],
                                  "iterations": int(model.optimizer.iterations.numpy())}),
          flush=True)


def run_cluster(args, mode, workers, straggler):
    cluster = make_cluster(workers, ps=1)
    lines = []
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    tasks = {}
    for job in ("ps", "worker"):
        for i in range(len(cluster[job])):
            config = ClusterConfig(cluster, job, i)
            # One thread per op: each worker computes on about one core.
            tasks[config.task_name] = Task(
                config, [sys.executable, "-m", "tfpar.cluster.server", "--intra_op_threads=1"],
                env, lines.append)
    command = [sys.executable, __file__, "--role=chief", f"--mode={mode}",
               f"--steps={args.steps}", f"--batch={args.batch}", f"--width={args.width}",
               f"--layers={args.layers}"]
    tasks["chief:0"] = Task(ClusterConfig(cluster, "chief", 0), command, env, lines.append)
    stop = threading.Event()
    if straggler:
        slow = tasks["worker:1"]
        threading.Thread(target=_duty_cycle, args=(slow, stop), daemon=True).start()
    try:
        code = tasks["chief:0"].process.wait(args.timeout)
    except subprocess.TimeoutExpired:
        code = "timeout"
    finally:
        stop.set()
        for task in tasks.values():
            task.signal(signal.SIGCONT)
            task.signal(signal.SIGKILL)
        for task in tasks.values():
            task.process.wait(10)
    tasks["chief:0"].join_output()
    results = [json.loads(l.split("RESULT ", 1)[1]) for l in lines if "RESULT " in l]
    if code != 0 or not results:
        raise RuntimeError(f"{mode} with {workers} worker(s) failed ({code}):\n"
                           + "\n".join(lines[-40:]))
    return results[0]


def _duty_cycle(task, stop):
    while not stop.is_set():
        task.signal(signal.SIGCONT)
        time.sleep(PERIOD * (1 - SLOW_FRACTION))
        task.signal(signal.SIGSTOP)
        time.sleep(PERIOD * SLOW_FRACTION)
    task.signal(signal.SIGCONT)


CONFIGS = [  # name, mode, workers, straggler
    ("async_1_worker", "async", 1, False),
    ("async_2_workers", "async", 2, False),
    ("sync_2_workers", "sync", 2, False),
    ("async_2_workers_straggler", "async", 2, True),
    ("sync_2_workers_straggler", "sync", 2, True),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--role", default="bench", choices=["bench", "chief"])
    parser.add_argument("--mode", default="async")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per configuration")
    parser.add_argument("--batch", type=int, default=256, help="examples per worker step")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "parameter_server.json"))
    args = parser.parse_args()
    if args.role == "chief":
        return chief(args)
    runs = {name: [] for name, *_ in CONFIGS}
    for round_index in range(args.rounds):
        for name, mode, workers, straggler in CONFIGS:
            result = run_cluster(args, mode, workers, straggler)
            runs[name].append(result["examples_per_second"])
            print(f"round {round_index}: {name}: {result['examples_per_second']:.0f} examples/s "
                  f"(iterations {result['iterations']})", flush=True)
    median = {name: statistics.median(values) for name, values in runs.items()}
    summary = {
        "scaling_2_workers": median["async_2_workers"] / median["async_1_worker"],
        "async_over_sync": median["async_2_workers"] / median["sync_2_workers"],
        "async_over_sync_with_straggler":
            median["async_2_workers_straggler"] / median["sync_2_workers_straggler"],
    }
    for key, value in summary.items():
        print(f"{key}: {value:.2f}x")
    print(f"goal: async >= 1.5x sync with a 3x-slower straggler: "
          f"{'met' if summary['async_over_sync_with_straggler'] >= 1.5 else 'NOT met'}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("role", "mode")},
                   "examples_per_second": runs, "median": median, "summary": summary}, f,
                  indent=2)


if __name__ == "__main__":
    main()
