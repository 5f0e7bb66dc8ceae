"""PipelineStrategy on 2 logical CPUs: micro-batches against plain layer placement.

One MLP (the Keras train step, SGD) trained side by side, on 2 logical CPUs:

- one device: the whole model on /cpu:0 (stock OneDeviceStrategy);
- K=2 M=1: the model cut into 2 stages, the batch in one piece (plain layer
  placement: the two devices take turns);
- K=2 M=8, GPipe and 1F1B: the batch in 8 micro-batches of 1024 rows flowing
  through the 2 stages. The bound 2M/(M+1) counts only the bubble; each
  micro-batch also costs a fixed amount (a gradient-accumulation add per weight,
  the copy between devices, ordering ops) and a little matmul efficiency (one
  thread, 1024x1024 weights, forward and both backward matmuls: 512 rows ~4%
  slower than 8192, 1024 rows ~2%). 1024-row micro-batches halve that overhead
  against 512 (`--micro_batch=512` shows it).

"One core per logical CPU": TensorFlow has one pool of inter-op threads for all
CPU devices, and with 2 threads it runs a backward pass's weight-gradient and
input-gradient matmuls at once even on one device. So the two baselines are also
measured as the bound 2M/(M+1) assumes them, in a second process that runs one op
at a time (inter-op 1; K=2 M=1 then runs each device on one core in turn). Both
processes run one thread per op, and take turns round by round (drift on the
shared machine hits all candidates alike); step times are medians. A forward pass
alone (prediction), a chain of matmuls that uses one thread per device anyway, is
timed too.

Also measured: the cores busy in a step (TensorFlow profiler: op time / step
time); peak memory (TensorFlow's CPU allocator peak during one step above its level
before it; the logical CPUs share one allocator), next to the schedule's estimate
of the activations a stage keeps; and a Chrome trace plus picture of one profiled
GPipe step and one 1F1B step.

    python benchmarks/pipeline.py [--micro_batch 1024] [--num_micro_batches 8] [--rounds 5]

With `--schedules`, the schedules past 1F1B instead, side by side at K=2 M=4 (the same
MLP, 2 logical CPUs, one core each): 1F1B (its stages balanced by parameters, and by
measured time), interleaved 1F1B (2 virtual stages), zero-bubble H1 and 2BW, each step
time against 1F1B's, each schedule's dry-run bubble next to the idle time of each stage
measured from a profiled step (traces and pictures in benchmarks/results/), the cores busy
in a step (profiler: op time over step time; a stage's idle time is not a core's, as the
logical CPUs share one pool of threads), and, in the same run, the two-stream ceiling of
these CPUs.

    python benchmarks/pipeline.py --schedules [--micro_batch 1024] [--rounds 5]

With `--schedules --processes`, the same comparison with each stage on its own process, as
the schedules assume: 2 worker servers on 127.0.0.1 (`tfpar.cluster.server`, one thread per op),
worker i pinned to core i (CPU affinity), this process their chief. A stage's idle time is
then its core's: each worker's CPU time over the steps (from /proc) is measured, and the
ceiling is two single-thread streams, one per worker, in the same run. Each worker runs
two ops at a time on its core: with one inter-op thread a stage sent each activation only
after its next action (measured in a profile of the workers; 1F1B then took 1.45x longer).
One step of each schedule is traced across the processes (`PipelineStrategy.trace` with
each worker's profiler server, `tfpar.cluster.server --profiler_port`): pictures
`pipeline_processes_*.png`. Writes pipeline_schedules_processes.json.

    python benchmarks/pipeline.py --schedules --processes [--rounds 5]

With `--balance`, 1F1B (K=2 M=4) with its stages balanced by parameters against balanced
by measured time, on a model whose parameters are mostly an embedding table (16.8M
parameters, little work) before the MLP: each stage's idle time from a profiled step.

    python benchmarks/pipeline.py --balance [--rounds 5]

Prints a table and writes JSON (default benchmarks/results/pipeline.json, with
--schedules pipeline_schedules.json, with --balance pipeline_balance.json).
"""

import argparse
import multiprocessing
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _common import add_common_args, batch, command_line, time_rounds, write_json  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEVICES = ["/cpu:0", "/cpu:1"]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro_batch", type=int, default=1024, help="rows per micro-batch")
    parser.add_argument("--num_micro_batches", type=int, default=8)
    parser.add_argument("--remat", action="store_true", help="also time GPipe with remat")
    parser.add_argument("--trace", default=os.path.join(RESULTS, "pipeline_trace.json"),
                        help="Chrome trace of one GPipe step (a .png is written next to it)")
    parser.add_argument("--schedules", action="store_true",
                        help="compare 1F1B, interleaved, zero-bubble H1 and 2BW at K=2 M=4")
    parser.add_argument("--processes", action="store_true",
                        help="with --schedules: each stage a worker process on one core")
    parser.add_argument("--balance", action="store_true",
                        help="compare 1F1B balanced by parameters and by time (K=2 M=4)")
    add_common_args(parser, width=1024, layers=8, steps=2, rounds=5, out_name="pipeline.json")
    args = parser.parse_args()
    if args.balance and "--out" not in " ".join(os.sys.argv):
        args.out = os.path.join(RESULTS, "pipeline_balance.json")
    if (args.schedules or args.balance) and "--num_micro_batches" not in " ".join(os.sys.argv):
        args.num_micro_batches = 4
    if args.schedules and "--out" not in " ".join(os.sys.argv):
        args.out = os.path.join(RESULTS, "pipeline_schedules" + (
            "_processes.json" if args.processes else ".json"))
    if args.processes and not args.schedules:
        parser.error("--processes goes with --schedules")
    return args


def make_model(args):
    """The benchmark MLP, compiled; call under a strategy's scope."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((args.width,))]
        + [keras.layers.Dense(args.width, activation="relu") for _ in range(args.layers)]
        + [keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(1e-4),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def make_step(strategy, model, data, steps):
    """`steps` compiled Keras train steps of `model` on a fixed batch, as fit runs them."""
    import tensorflow as tf

    iterator = iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors(data).repeat()))

    @tf.function
    def step():
        logs = strategy.run(model.train_step, args=(next(iterator),))
        return strategy.experimental_local_results(logs["loss"])[0]

    for _ in range(3):  # trace, place, and let the allocator reach its steady state
        step()
    return lambda: [float(step()) for _ in range(steps)]


def make_forward(model, x, steps):
    """`steps` compiled forward passes (prediction) of `model` on a fixed batch."""
    import tensorflow as tf

    with tf.device(DEVICES[0]):
        x = tf.constant(x)
    forward = tf.function(lambda: model(x, training=False))
    for _ in range(3):
        forward()
    return lambda: [forward().numpy() for _ in range(steps)]


def make_embedding_model(args):
    """A model whose parameters are not its work: a 32768 x 512 embedding table (16.8M
    parameters, a gather) before the benchmark's Dense layers (11.5M, all the matmuls)."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((TOKENS,), dtype="int32"), keras.layers.Embedding(VOCABULARY, 512),
         keras.layers.Flatten()]
        + [keras.layers.Dense(args.width, activation="relu") for _ in range(args.layers)]
        + [keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(1e-4),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


TOKENS, VOCABULARY = 8, 32768


def build(candidates, args, data, make_model=make_model):
    """{name: (strategy, model, step)} for {name: strategy factory}."""
    built = {}
    for name, make in candidates.items():
        strategy = make()
        with strategy.scope():
            model = make_model(args)
        built[name] = (strategy, model, make_step(strategy, model, data, args.steps))
    return built


def one_core_worker(connection, args):
    """The baselines as 2M/(M+1) assumes them: one op at a time in this process."""
    import tfpar

    tfpar.virtual_cpus(2, one_core_each=True)
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    data = batch(args.num_micro_batches * args.micro_batch, args.width)
    built = build({
        "one device, 1 core": lambda: tf.distribute.OneDeviceStrategy(DEVICES[0]),
        "K=2 M=1, 1 core per device": lambda: tfpar.PipelineStrategy(DEVICES,
                                                                     num_micro_batches=1),
    }, args, data)
    connection.send("ready")
    while connection.recv() == "round":
        connection.send(time_rounds({n: b[2] for n, b in built.items()}, 1, args.steps))


def profiled_cores(run):
    """Cores computing during a call of `run` (and the seconds of op time in it).

    From TensorFlow's profiler: on each compute thread, the time covered by ops.
    """
    import tensorflow as tf

    from tfpar.viz.pipeline_trace import profiled_ops

    logdir = tempfile.mkdtemp(prefix="tfpar_bench_")
    try:
        tf.profiler.experimental.start(logdir)
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
        tf.profiler.experimental.stop()
        by_thread = {}
        for _, _, begin, end, thread in profiled_ops(logdir):
            if thread.startswith("tf_Compute"):
                by_thread.setdefault(thread, []).append((begin, end))
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    busy = 0.0
    for spans in by_thread.values():  # The union of each thread's op intervals.
        covered_to = float("-inf")
        for begin, end in sorted(spans):
            busy += max(0.0, end - max(begin, covered_to))
            covered_to = max(covered_to, end)
    return busy / wall, busy


def peak_bytes(step):
    """TensorFlow's CPU allocator peak during one step, above its level before."""
    import tensorflow as tf

    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    step()
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - before


def idle_per_stage(events, num_stages):
    """Per stage, the fraction of the traced step (first action's start to last one's
    end) in which it ran none of its actions."""
    spans = [e for e in events if e["ph"] == "X"]
    start = min(e["ts"] for e in spans)
    length = max(e["ts"] + e["dur"] for e in spans) - start
    return [round(1 - sum(e["dur"] for e in spans if e["tid"] == s) / length, 3)
            for s in range(num_stages)]


SCHEDULES = {  # name: (schedule, virtual stages, balance_by)
    "1F1B": ("1f1b", 1, "params"),
    "1F1B by time": ("1f1b", 1, "time"),
    "interleaved v=2": ("interleaved_1f1b", 2, "params"),
    "ZB-H1": ("zero_bubble_h1", 1, "params"),
    "ZB-H1 v=2": ("zero_bubble_h1", 2, "params"),
    "2BW": ("2bw", 1, "params"),
}


def trace_path(name, prefix=""):
    """Where the trace of schedule `name` goes (a picture next to it)."""
    return os.path.join(RESULTS, f"pipeline_{prefix}" + name.lower().replace(" ", "_").replace(
        "=", "") + ".json")


def start_stage_workers(count):
    """`count` worker servers of a local cluster whose chief is this process (its
    TF_CONFIG is set), each on a core of its own, one thread per op, each with a profiler
    server. They die with this process. Returns (tasks, {"worker:i": profiler address})."""
    from tfpar.cluster.launcher import Task, free_ports, make_cluster
    from tfpar.cluster.tf_config import ClusterConfig

    cluster = make_cluster(count, coordinator=True)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    cores = sorted(os.sched_getaffinity(0))
    ports = free_ports(count)
    # Worker i may run only on core i: its threads (and the ones TensorFlow starts later)
    # share that core, so a stage's idle time is its core's.
    tasks = [Task(ClusterConfig(cluster, "worker", i),
                  [sys.executable, "-c", PINNED_SERVER.format(core=cores[i % len(cores)],
                                                              port=ports[i])], env,
                  WORKER_OUTPUT.append) for i in range(count)]
    os.environ["TF_CONFIG"] = ClusterConfig(cluster, "chief", 0).to_json()
    return tasks, {f"worker:{i}": f"127.0.0.1:{port}" for i, port in enumerate(ports)}


WORKER_OUTPUT = []  # The worker servers' lines, printed if the run fails.
PINNED_SERVER = ("import os, sys; os.sched_setaffinity(0, {{{core}}}); os.execv(sys.executable, "
                 "[sys.executable, '-m', 'tfpar.cluster.server', '--intra_op_threads=1', "
                 "'--profiler_port={port}'])")


def cpu_seconds(pid):
    """User and system CPU time of process `pid` so far (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cores(run, pids):
    """Per process in `pids`, its CPU time over the wall time of a call of `run`."""
    before = [cpu_seconds(pid) for pid in pids]
    start = time.perf_counter()
    run()
    wall = time.perf_counter() - start
    return [(cpu_seconds(pid) - b) / wall for pid, b in zip(pids, before)]


def compare_schedules(args):
    """1F1B, interleaved and zero-bubble side by side (see the module docstring)."""
    import tfpar

    if args.processes:
        tasks, profilers = start_stage_workers(2)
        import tensorflow as tf

        # Two ops at a time on each (pinned) worker: the chief's setting reaches the workers'
        # contexts, which would take one (their one core). With one, a stage's activation
        # waits behind its whole next action: its send is queued, the action runs inline.
        tf.config.threading.set_inter_op_parallelism_threads(2)
    else:
        # (A third CPU, used only to time layers for balance_by="time".)
        tfpar.virtual_cpus(3, one_core_each=True)
    import tensorflow as tf

    from _common import two_stream_ceiling
    from tfpar.plan.schedule import bubble_fraction

    devices, connect = DEVICES, {}
    if args.processes:
        devices = [f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in range(2)]
        # The first strategy connects this process to the workers; the others find it so.
        connect = {"cluster_resolver": tf.distribute.cluster_resolver.TFConfigClusterResolver()}

    def make(schedule, virtual_stages, balance_by):
        strategy = tfpar.PipelineStrategy(
            devices, num_micro_batches=m, schedule=schedule, virtual_stages=virtual_stages,
            balance_by=balance_by, **connect)
        connect.clear()
        return strategy

    m = args.num_micro_batches
    data = batch(m * args.micro_batch, args.width)
    events = {}  # name: the Chrome trace events of one profiled step
    try:
        built = build({name: (lambda p=p: make(*p)) for name, p in SCHEDULES.items()}, args,
                      data)
        times = time_rounds({n: b[2] for n, b in built.items()}, args.rounds, args.steps)
        ceiling = two_stream_ceiling(args.micro_batch, args.width, args.width, args.rounds,
                                     args.steps, devices)
        if args.processes:
            # A stage's busy time is its process's CPU time: each worker has one core.
            cores = {name: process_cores(b[2], [t.process.pid for t in tasks])
                     for name, b in built.items()}
            # One profiled step each, the workers' ops recorded by their own profilers.
            for name, (strategy, model, _) in built.items():
                events[name] = strategy.trace(trace_path(name, "processes_"), model, *data,
                                              profilers=profilers)
    except Exception:
        print("\n".join(WORKER_OUTPUT[-40:]))
        raise
    finally:
        for task in tasks if args.processes else ():
            task.signal(signal.SIGKILL)
    step = {name: statistics.median(t) for name, t in times.items()}
    rows, traces = {}, {}
    for name, (strategy, model, _) in built.items():
        rows[name] = {"step_ms": round(step[name] * 1000, 1),
                      "speedup_vs_1F1B": round(step["1F1B"] / step[name], 3),
                      "dry_run_bubble": round(bubble_fraction(strategy.schedule), 3),
                      "chunks": strategy.stages(model)}
        if args.processes:
            rows[name]["idle_per_stage_cpu"] = [round(1 - c, 3) for c in cores[name]]
            # Each chunk boundary is crossed by every micro-batch's activation forward and
            # its gradient backward, between the two processes.
            rows[name]["activations_between_processes_mb"] = round(
                (len(rows[name]["chunks"]) - 1) * m * 2 * args.micro_batch * args.width * 4
                / 2**20)
        else:
            events[name] = strategy.trace(trace_path(name), model, *data)
            rows[name]["cores_busy"] = round(profiled_cores(built[name][2])[0], 2)
        traces[name] = os.path.relpath(trace_path(name, "processes_" if args.processes
                                                  else "")[:-5] + ".png")
        rows[name]["idle_per_stage_traced"] = idle_per_stage(events[name], 2)
    result = {
        "benchmark": "pipeline_schedules",
        "command": command_line("pipeline", args).replace(f" --trace={args.trace}", "")
        .replace(" --remat=False", "").replace(" --schedules=True", " --schedules")
        .replace(" --processes=True", " --processes").replace(" --processes=False", ""),
        "model": f"MLP {args.layers}x{args.width} + 10-way head, SGD, Keras train step",
        "devices": ("2 worker processes on 127.0.0.1, each pinned to a core (intra-op 1, "
                    "inter-op 2)"
                    if args.processes else "2 logical CPUs, one thread per op (intra-op 1)"),
        "global_batch": m * args.micro_batch, "micro_batch": args.micro_batch,
        "two_stream_ceiling": round(ceiling, 3), "rows": rows, "traces": traces,
        "tensorflow": tf.__version__, "host": platform.node(),
        "all_step_ms": {k: [round(t * 1000, 1) for t in v] for k, v in times.items()}}
    print(f"{result['model']}, K=2 M={m} x {args.micro_batch} rows, {result['devices']}, "
          f"median of {args.rounds} rounds x {args.steps} steps; two-stream ceiling "
          f"{result['two_stream_ceiling']}x")
    idle, last, last_key = (
        ("idle s0, s1 (CPU)", "MB moved", "activations_between_processes_mb") if args.processes
        else ("", "cores busy", "cores_busy"))
    print(f"{'schedule':18s} {'ms':>8s} {'vs 1F1B':>8s} {'bubble':>7s} "
          f"{'idle s0, s1 (trace)':>20s} {idle:>20s} {last:>10s}")
    for name, row in rows.items():
        print(f"{name:18s} {row['step_ms']:8.1f} {row['speedup_vs_1F1B']:8.3f} "
              f"{row['dry_run_bubble']:7.3f} {str(row['idle_per_stage_traced']):>20s} "
              f"{str(row.get('idle_per_stage_cpu', '')):>20s} {row[last_key]:10}")
    if traces:
        print("traces:", traces)
    write_json(args.out, result)


def compare_balance(args):
    """1F1B with stages balanced by parameters and by measured time, side by side, on a
    model whose parameters are mostly an embedding table (see the module docstring)."""
    import numpy as np

    import tfpar

    tfpar.virtual_cpus(3, one_core_each=True)  # (The third CPU times layers.)
    import tensorflow as tf

    m = args.num_micro_batches
    rows_count = m * args.micro_batch
    rng = np.random.default_rng(0)
    data = (rng.integers(0, VOCABULARY, (rows_count, TOKENS)).astype("int32"),
            rng.integers(0, 10, rows_count).astype("int32"))
    built = build({f"by {b}": (lambda b=b: tfpar.PipelineStrategy(
        DEVICES, num_micro_batches=m, schedule="1f1b", balance_by=b))
        for b in ("params", "time")}, args, data, make_embedding_model)
    times = time_rounds({n: b[2] for n, b in built.items()}, args.rounds, args.steps)
    step = {name: statistics.median(t) for name, t in times.items()}
    rows, traces = {}, {}
    for name, (strategy, model, _) in built.items():
        path = trace_path(name, "balance_")
        events = strategy.trace(path, model, *data)
        traces[name] = os.path.relpath(path[:-5] + ".png")
        rows[name] = {"step_ms": round(step[name] * 1000, 1),
                      "speedup_vs_params": round(step["by params"] / step[name], 3),
                      "idle_per_stage_traced": idle_per_stage(events, 2),
                      "stages": strategy.stages(model)}
    result = {
        "benchmark": "pipeline_balance",
        "command": command_line("pipeline", args).replace(f" --trace={args.trace}", "")
        .replace(" --remat=False", "").replace(" --schedules=False", "")
        .replace(" --balance=True", " --balance"),
        "model": f"Embedding {VOCABULARY}x512 over {TOKENS} tokens, then MLP {args.layers}x"
                 f"{args.width} + 10-way head, SGD, Keras train step",
        "devices": "2 logical CPUs, one thread per op (intra-op 1)",
        "global_batch": rows_count, "micro_batch": args.micro_batch, "rows": rows,
        "traces": traces, "tensorflow": tf.__version__, "host": platform.node(),
        "all_step_ms": {k: [round(t * 1000, 1) for t in v] for k, v in times.items()}}
    print(f"{result['model']}, 1F1B K=2 M={m} x {args.micro_batch} rows, {result['devices']}, "
          f"median of {args.rounds} rounds x {args.steps} steps")
    for name, row in rows.items():
        print(f"{name:10s} {row['step_ms']:8.1f} ms  x{row['speedup_vs_params']:.3f}  idle s0, "
              f"s1 {row['idle_per_stage_traced']}  stage 0: {row['stages'][0]}")
    print("traces:", traces)
    write_json(args.out, result)


def main():
    args = parse_args()
    if args.schedules:
        return compare_schedules(args)
    if args.balance:
        return compare_balance(args)
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    worker = context.Process(target=one_core_worker, args=(child, args), daemon=True)
    worker.start()
    import tfpar

    tfpar.virtual_cpus(2, one_core_each=True)
    import tensorflow as tf

    from tfpar.plan.schedule import max_in_flight

    m = args.num_micro_batches
    global_batch = m * args.micro_batch
    data = batch(global_batch, args.width)
    gpipe, one_f_one_b, m1 = f"K=2 M={m} GPipe", f"K=2 M={m} 1F1B", "K=2 M=1"
    candidates = {
        "one device": lambda: tf.distribute.OneDeviceStrategy(DEVICES[0]),
        m1: lambda: tfpar.PipelineStrategy(DEVICES, num_micro_batches=1),
        gpipe: lambda: tfpar.PipelineStrategy(DEVICES, num_micro_batches=m),
        one_f_one_b: lambda: tfpar.PipelineStrategy(DEVICES, num_micro_batches=m,
                                                    schedule="1f1b"),
    }
    if args.remat:
        candidates[f"K=2 M={m} GPipe remat"] = lambda: tfpar.PipelineStrategy(
            DEVICES, num_micro_batches=m, remat=True)
    built = build(candidates, args, data)
    forwards = {name: make_forward(built[name][1], data[0], args.steps)
                for name in ("one device", m1, gpipe)}
    assert parent.recv() == "ready"

    times = {name: [] for name in list(built) + ["one device, 1 core",
                                                 "K=2 M=1, 1 core per device"]}
    forward_times = {name: [] for name in forwards}
    for _ in range(args.rounds):
        for name, seconds in time_rounds({n: b[2] for n, b in built.items()}, 1,
                                         args.steps).items():
            times[name] += seconds
        parent.send("round")
        for name, seconds in parent.recv().items():
            times[name] += seconds
        for name, seconds in time_rounds(forwards, 1, args.steps).items():
            forward_times[name] += seconds
    parent.send("stop")
    worker.join(timeout=60)

    step = {name: statistics.median(t) for name, t in times.items()}
    forward = {name: statistics.median(t) for name, t in forward_times.items()}
    cores = {name: profiled_cores(b[2]) for name, b in built.items()}
    peaks = {name: peak_bytes(b[2]) for name, b in built.items()}
    bound = 2 * m / (m + 1)
    strategy, model = built[gpipe][0], built[gpipe][1]
    stages = strategy.stages(model)
    # Activations a stage keeps per micro-batch: each Dense layer's output (its
    # backward needs it), micro_batch x width floats.
    per_micro_batch = [len(s) * args.micro_batch * args.width * 4 for s in stages]
    estimate = {name: [round(n * b / 2**20, 1) for n, b in
                       zip(max_in_flight(built[name][0].schedule), per_micro_batch)]
                for name in (gpipe, one_f_one_b)}
    traces = {}
    for name, path in ((gpipe, args.trace),
                       (one_f_one_b, args.trace.replace(".json", "_1f1b.json"))):
        built[name][0].trace(path, built[name][1], *data)
        traces[name] = {"json": os.path.relpath(path), "png": os.path.relpath(path[:-5] + ".png")}

    def speedup(baseline, candidate=gpipe, table=step):
        return round(table[baseline] / table[candidate], 3)

    rows = {name: {"step_ms": round(seconds * 1000, 1),
                   "samples_per_s": round(global_batch / seconds, 1),
                   "speedup_vs_one_device_1_core": speedup("one device, 1 core", name),
                   "speedup_vs_K2_M1_1_core_per_device": speedup("K=2 M=1, 1 core per device",
                                                                 name)}
            for name, seconds in step.items()}
    for name in built:
        rows[name]["cores_busy"] = round(cores[name][0], 2)
        rows[name]["peak_MiB"] = round(peaks[name] / 2**20, 1)
    params = 4 * ((args.layers * (args.width + 1) * args.width) + (args.width + 1) * 10)
    result = {
        "benchmark": "pipeline",
        "command": command_line("pipeline", args).replace(f" --trace={args.trace}", "").replace(
            " --remat=False", "").replace(" --remat=True", " --remat"),
        "model": f"MLP {args.layers}x{args.width} + 10-way head, "
                 f"{params / 2**20:.1f} MiB of weights, SGD, Keras train step",
        "devices": "2 logical CPUs, one thread per op (intra-op 1); inter-op 2, and 1 for "
                   "the '1 core' baselines",
        "global_batch": global_batch, "micro_batch": args.micro_batch, "stages": stages,
        "bound_2M_over_M_plus_1": round(bound, 3),
        "train": {
            "speedup_M8_vs_M1_1_core_per_device": speedup("K=2 M=1, 1 core per device"),
            "fraction_of_bound": round(speedup("K=2 M=1, 1 core per device") / bound, 3),
            "speedup_M8_vs_M1_same_threads": speedup(m1),
            "speedup_M8_vs_one_device_1_core": speedup("one device, 1 core"),
            "speedup_M8_vs_one_device": speedup("one device"),
            "1F1B_vs_GPipe_step_time": round(step[one_f_one_b] / step[gpipe], 3),
            "1F1B_fraction_of_bound": round(
                speedup("K=2 M=1, 1 core per device", one_f_one_b) / bound, 3),
        },
        "forward": {
            "step_ms": {name: round(s * 1000, 1) for name, s in forward.items()},
            "speedup_M8_vs_M1": speedup(m1, gpipe, forward),
            "fraction_of_bound": round(speedup(m1, gpipe, forward) / bound, 3),
            "speedup_M8_vs_one_device": speedup("one device", gpipe, forward),
        },
        "memory": {
            "peak_MiB": {name: rows[name]["peak_MiB"] for name in (gpipe, one_f_one_b)},
            "estimated_activation_MiB_per_stage": estimate,
        },
        "schedule": {name: built[name][0].schedule_table() for name in (gpipe, one_f_one_b)},
        "traces": traces,
        "tensorflow": tf.__version__, "host": platform.node(), "rows": rows,
        "all_step_ms": {k: [round(t * 1000, 1) for t in v] for k, v in times.items()},
    }
    print(f"{result['model']}, batch {global_batch} ({m} x {args.micro_batch}), "
          f"{result['devices']}, median of {args.rounds} rounds x {args.steps} steps")
    print(f"stages: {stages}")
    print(f"{'train step':28s} {'ms':>8s} {'samples/s':>10s} {'vs 1dev1c':>10s} "
          f"{'vs M1 1c':>9s} {'cores':>6s} {'peak MiB':>9s}")
    for name, row in rows.items():
        print(f"{name:28s} {row['step_ms']:8.1f} {row['samples_per_s']:10.0f} "
              f"{row['speedup_vs_one_device_1_core']:10.3f} "
              f"{row['speedup_vs_K2_M1_1_core_per_device']:9.3f} "
              f"{row.get('cores_busy', 1.0):6.2f} {row.get('peak_MiB', float('nan')):9.1f}")
    train = result["train"]
    print(f"train: M={m} vs M=1 (one core per device) {train['speedup_M8_vs_M1_1_core_per_device']}"
          f"x = {100 * train['fraction_of_bound']:.1f}% of the bound {bound:.3f} (1F1B: "
          f"{100 * train['1F1B_fraction_of_bound']:.1f}%); vs M=1 with the same threads "
          f"{train['speedup_M8_vs_M1_same_threads']}x")
    print(f"forward: {result['forward']['step_ms']} -> M={m} vs M=1 "
          f"{result['forward']['speedup_M8_vs_M1']}x = "
          f"{100 * result['forward']['fraction_of_bound']:.1f}% of the bound")
    print("memory:", result["memory"])
    print(built[gpipe][0].schedule_table())
    print("traces:", traces)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
