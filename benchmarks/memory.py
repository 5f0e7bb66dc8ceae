"""Measured memory per worker process against the plan, for each strategy.

Each configuration trains the same model (by default the 100.7M-parameter MLP of the
memory issue: 24 x Dense(2048, tanh) + a 10-way head, SGD with momentum, global batch 16)
for 2 steps, with one process per device: a single process, or 2 worker processes of a
TF_CONFIG cluster on 127.0.0.1 (data parallelism, ZeRO-1/2/3; a pipeline's 2 stages on
2 `tfpar.cluster.server` workers with its chief beside them). Every process runs in a memory
cgroup of its own where the machine allows it (root and the v1 memory controller at
/sys/fs/cgroup/memory), capped with --cap (bytes, or a fraction f: base + f x what one
process needs beyond the base). Per process it records:

- TensorFlow's allocator peak over training, and the resident peak (VmHWM) over
  training, both from inside (`tfpar.process_memory`);
- the resident peak of the whole process (getrusage of the exited child, from outside);
- the cgroup's peak usage (page cache included) and its OOM kills;
- the plan: the per-process base (a process that only imports tfpar, TensorFlow and
  Keras, measured first, in both counts) + `tfpar.plan.estimate_memory`'s per-device
  peak. The resident count includes the shared libraries; the cgroup's counts what the
  process brought in (libraries already in the page cache are charged elsewhere), and it
  is what a cap limits.

    python benchmarks/memory.py                          # uncapped, every configuration
    python benchmarks/memory.py --cap=0.7 --configs=data2,zero3,pipeline2

Writes benchmarks/results/memory.json (or --out) and prints a table.
"""

import argparse
import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from tfpar.cluster import launcher, memory_cgroup  # noqa: E402

CONFIGS = ("one", "data2", "zero1", "zero2", "zero3", "pipeline2", "model2", "remat2",
           "offload2")
SHARDS = {"zero1": "optimizer", "zero2": "gradients", "zero3": "parameters"}
# Each configuration's --strategy of examples/bigger_than_one_worker.py.
EXAMPLE_STRATEGY = {"one": "one", "data2": "data", "zero1": "zero1", "zero2": "zero2",
                    "zero3": "zero3", "pipeline2": "pipeline", "remat2": "pipeline",
                    "offload2": "pipeline", "model2": "model"}
# A pipeline's 2 stages on 2 tfpar.cluster.server workers, its chief beside them.
PIPELINES = ("pipeline2", "model2", "remat2", "offload2")  # A chief and 2 served workers.
# remat2 / offload2: a pipeline with remat, its stage inputs kept on the stage worker or
# offloaded to the chief, on a model whose kept activations dominate (--offload_shape).
OFFLOADING = ("remat2", "offload2")
BATCH = 16  # The example's.
STEPS = 2
TINY = {"width": 64, "layers": 2, "offload_shape": "64,2,64,4"}  # The base runs.


# -- the model (sizes for the plan, without TensorFlow) -------------------------------------

def variable_sizes(width, layers, classes=10):
    """Elements of each trainable variable of the MLP, in model order."""
    sizes = []
    for _ in range(layers):
        sizes += [width * width, width]
    return sizes + [width * classes, classes]


def shape(config, args):
    """(width, layers, global batch, micro-batches) of `config`'s model and step."""
    if config in OFFLOADING:
        return tuple(int(v) for v in args.offload_shape.split(","))
    return args.width, args.layers, BATCH, 4


def _remat_activations(config, width, layers, batch, micro_batches):
    """What the 2 stages of a GPipe step with remat keep, fp32 (the plan's activation
    bytes per model copy, which it splits over the stages): each stage's input for every
    micro-batch until its backward (on the chief when offloaded: then the inputs of 2
    micro-batches, the one in use and the next one fetched back), and one micro-batch's
    recomputed layer outputs (matmul and tanh) during a backward with the gradients
    flowing back through a layer (two of its outputs' size)."""
    micro_batch_input = 4 * (batch // micro_batches) * width
    kept = 2 * micro_batch_input if config == "offload2" else 4 * batch * width
    rerun = micro_batch_input * (2 * (layers // 2) + 2)
    return 2 * (kept + rerun)


def planned_bytes(config, args):
    """Per process: {task: planned bytes beyond the base} = the plan's per-device peak (SGD
    with momentum: one slot; the input batches the estimator counts). A pipeline's chief
    holds no stage: the program's own data (the whole dataset, made from arrays, and the
    batch it is cutting), and what is offloaded to it."""
    from tfpar.plan import memory as plan
    from tfpar.plan import sharding

    width, layers, batch, micro_batches = shape(config, args)
    sizes = variable_sizes(width, layers)
    one_batch = 4 * batch * width + 4 * batch  # Inputs and labels, fp32 and int32.
    # Kept for the backward pass: each layer's input and output, fp32, per example.
    activations = 4 * batch * (2 * width * layers + width)
    if config in OFFLOADING:
        activations = _remat_activations(config, width, layers, batch, micro_batches)
    common = dict(optimizer_slots=1, activation_bytes=activations, input_bytes=one_batch)
    if config == "one":
        cfg = plan.MemoryConfig("data", 1, **common)
    elif config == "data2":
        cfg = plan.MemoryConfig("data", 2, **dict(common, input_bytes=one_batch // 2))
    elif config in SHARDS:
        # Stages 1-2 across workers on CPUs send each gradient as it is made, the
        # backward pass pacing itself to a bucket in flight (what the strategy reports).
        cfg = plan.MemoryConfig("sharded", 2, shard=SHARDS[config],
                                gradient_window_bytes=sharding.DEFAULT_BUCKET_BYTES,
                                **dict(common, input_bytes=one_batch // 2))
    else:
        cfg = plan.MemoryConfig("model" if config == "model2" else "pipeline", 2, **common)
    devices = plan.estimate_memory(sizes, cfg).devices
    tasks = _tasks(config)
    if config in PIPELINES:
        offloaded = 4 * batch * width if config == "offload2" else 0  # The last stage's.
        chief = STEPS * one_batch + one_batch + offloaded
        return {"chief-0": chief, **{t: d.total for t, d in zip(tasks[1:], devices)}}
    return {t: d.total for t, d in zip(tasks, devices)}


def _tasks(config):
    if config == "one":
        return ["single-0"]
    if config in PIPELINES:
        return ["chief-0", "worker-0", "worker-1"]
    return ["worker-0", "worker-1"]


# -- one process (--role=task) ----------------------------------------------------------------

def _example():
    path = os.path.join(os.path.dirname(HERE), "examples", "bigger_than_one_worker.py")
    spec = importlib.util.spec_from_file_location("bigger_than_one_worker", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_task(args):
    """Trains (or, for --config=base, only imports) and writes this process's figures."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    import tfpar

    result = {}
    if args.config != "base":
        # The example's model, data and strategies: what its users run is what is measured.
        example = _example()
        width, layers, batch, micro_batches = shape(args.config, args)
        strategy = example.make_strategy(
            EXAMPLE_STRATEGY[args.config], micro_batches, remat=args.config in OFFLOADING,
            offload="chief" if args.config == "offload2" else "none")
        x, y = example.make_data(width, 0, STEPS, batch)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
        with strategy.scope():
            model = example.make_model(width, layers)
        built = tfpar.process_memory()
        result.update(built_allocator=built.allocator_bytes,
                      build_allocator_peak=built.allocator_peak_bytes,
                      built_rss=built.rss_bytes, build_rss_peak=built.rss_peak_bytes)
        tfpar.reset_memory_peaks()
        started = time.monotonic()
        history = model.fit(dataset, epochs=1, verbose=0)
        result["seconds"] = time.monotonic() - started
        result["loss"] = float(history.history["loss"][-1])
        measured = tfpar.process_memory()
        result.update(allocator_peak=measured.allocator_peak_bytes,
                      trained_allocator=measured.allocator_bytes,
                      training_rss_peak=measured.rss_peak_bytes)
        # A fingerprint of the trained weights, to compare with one process's, read one
        # variable at a time (after the peaks: under ZeRO-3 each read is a gather).
        result["weight_sums"] = [float(np.sum(w.numpy(), dtype=np.float64))
                                 for w in model.weights]
    result["rss_now"] = tfpar.process_memory().rss_bytes
    with open(args.result, "w") as f:
        json.dump(result, f)


# -- the driver ------------------------------------------------------------------------------

def cap_bytes(base_rss, one_rss, fraction):
    """The cap of the memory issue: base + fraction x what one process needs beyond the
    base, in resident counts (applied to the cgroup, which does not count the libraries
    another process loaded)."""
    return int(base_rss + fraction * (one_rss - base_rss))


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _tf_configs(config):
    if config in ("one", "base"):
        return {"single-0": None}
    ports = _free_ports(3)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports[:2]]}
    if config in PIPELINES:
        cluster["chief"] = [f"127.0.0.1:{ports[2]}"]
    return {t: json.dumps({"cluster": cluster, "task": {"type": t.split("-")[0],
                                                         "index": int(t.split("-")[1])}})
            for t in (_tasks(config) if config != "base" else ["single-0"])}


def run_config(config, args, limit, workdir):
    """Starts the processes of `config`, each in its cgroup, waits (at most --timeout s)
    and returns {task: figures}."""
    procs = {}
    for task, tf_config in _tf_configs(config).items():
        group = memory_cgroup.MemoryCgroup(f"tfpar_memory_{os.getpid()}_{config}_{task}", limit)
        # As `tfpar launch` starts its tasks (malloc arenas, allocator statistics).
        env = launcher.task_environment(dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
        env.pop("TF_CONFIG", None)
        if tf_config:
            env["TF_CONFIG"] = tf_config
        result = os.path.join(workdir, f"{config}-{task}.json")
        serving = config in PIPELINES and task.startswith("worker")
        command = ([sys.executable, "-m", "tfpar.cluster.server"] if serving else
                   [sys.executable, os.path.abspath(__file__), "--role=task",
                    f"--config={config}", f"--result={result}", f"--width={args.width}",
                    f"--layers={args.layers}", f"--offload_shape={args.offload_shape}"])
        log = open(os.path.join(workdir, f"{config}-{task}.log"), "w")
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, preexec_fn=group.join,
                                   start_new_session=True)
        procs[task] = (process, group, result, serving, log)
    deadline = time.monotonic() + args.timeout
    figures = {}
    try:
        waiting = [t for t, p in procs.items() if not p[3]]
        while waiting and time.monotonic() < deadline:
            for task in list(waiting):
                pid, status, usage = os.wait4(procs[task][0].pid, os.WNOHANG)
                if pid:
                    figures[task] = _exited(status, usage)
                    waiting.remove(task)
                    if figures[task]["exit"] != 0:  # One failed: the others cannot finish.
                        deadline = 0
            time.sleep(0.2)
    finally:
        for task, (process, group, result, serving, log) in procs.items():
            if task not in figures:
                # A server prints its peaks on SIGTERM (tfpar.cluster.server); anything else left
                # running timed out.
                figures[task] = dict(_stop(process, signal.SIGTERM if serving else None),
                                     stopped="served" if serving else "timed out")
            figures[task].update(group.figures())
            group.remove()
            log.close()
            if os.path.exists(result):
                with open(result) as f:
                    figures[task].update(json.load(f))
            elif serving:
                with open(log.name) as f:
                    said = re.search(r"allocator [\d.]+ MiB \(peak ([\d.]+) MiB\)", f.read())
                if said:
                    figures[task]["allocator_peak"] = int(float(said[1]) * (1 << 20))
            elif figures[task]["exit"] != 0:
                with open(log.name) as f:
                    figures[task]["log_tail"] = f.read()[-1500:]
    return figures


def _stop(process, first_signal, grace=10.0):
    """Ends `process` (`first_signal`, then SIGKILL after `grace` s) and returns its figures."""
    if first_signal is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, first_signal)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                return _exited(status, usage)
            time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    _, status, usage = os.wait4(process.pid, 0)
    return _exited(status, usage)


def _exited(status, usage):
    code = os.waitstatus_to_exitcode(status)
    return {"exit": code, "killed_by": signal.Signals(-code).name if code < 0 else None,
            "rss_peak": usage.ru_maxrss * 1024}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", default="driver", choices=["driver", "task"])
    parser.add_argument("--config", default="one")
    parser.add_argument("--result")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--offload_shape", default="1024,4,16384,16",
                        help="remat2 and offload2: width,layers,global batch,micro-batches")
    parser.add_argument("--cap", default=None,
                        help="per-process cap: bytes, or a fraction f of one process's need "
                             "beyond the base (base + f x (one - base))")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--base", default="tiny", choices=["tiny", "import"],
                        help="each process's base: the same processes training a tiny model "
                             "(tiny), or one process that only imports tfpar (import)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "memory.json"))
    args = parser.parse_args(argv)
    if args.role == "task":
        return run_task(args)

    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown --configs {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    capped = memory_cgroup.available()
    where = "yes" if capped else f"no (root and {memory_cgroup.ROOT} needed)"
    print(f"memory cgroups: {where}"
          f"; model {args.layers} x Dense({args.width}) + head, "
          f"{sum(variable_sizes(args.width, args.layers)):,} parameters", flush=True)
    if set(configs) & set(OFFLOADING):
        width, layers, batch, micro = shape("remat2", args)
        print(f"remat2, offload2: {layers} x Dense({width}) + head, global batch {batch} in "
              f"{micro} micro-batches", flush=True)
    with tempfile.TemporaryDirectory() as workdir:
        # The base in both counts: resident (shared libraries included) and the cgroup's
        # (pages this process brought in; libraries already cached are charged elsewhere).
        measured = run_config("base", args, None, workdir)["single-0"]
        base = {"rss": measured["rss_peak"], "cgroup": measured.get("cgroup_peak")}
        one = limit = None
        if args.cap:
            cap = float(args.cap)
            if cap <= 1:
                one = run_config("one", args, None, workdir)["single-0"]
                limit = cap_bytes(base["rss"], one["rss_peak"], cap)
                print(f"cap: {limit / (1 << 20):.0f} MiB = base {base['rss'] / (1 << 20):.0f} "
                      f"+ {cap} x what one process needs beyond it (resident counts)",
                      flush=True)
            else:
                limit = int(cap)
        if not capped and limit:
            print("no cgroups here: the cap is not enforced, peaks are measured and "
                  "compared with the plan", flush=True)
        results = {}
        tiny = argparse.Namespace(**dict(vars(args), **TINY))
        for config in configs:
            # The base of each process: the same program and strategy training a model
            # too small to matter (the runtime, its cluster and traced steps).
            bases = run_config(config, tiny, None, workdir) if args.base == "tiny" else {}
            figures = run_config(config, args, limit, workdir)
            planned = planned_bytes(config, args)
            for task, f in figures.items():
                f["planned_allocator"] = planned[task]
                for kind in ("rss", "cgroup"):
                    task_base = bases.get(task, {}).get(f"{kind}_peak", base[kind])
                    if task_base is not None:
                        f[f"base_{kind}"] = task_base
                        f[f"planned_{kind}"] = task_base + planned[task]
            results[config] = figures
            _print(config, figures)
    for config, figures in results.items():
        # Offloading against remat alone (same model); the rest against one process.
        reference = next((f.get("weight_sums") for f in results.get(
            "remat2" if config == "offload2" else "one", {}).values()
            if f.get("weight_sums")), None) if config != "remat2" else None
        for f in figures.values():
            if reference and f.get("weight_sums"):
                f["max_relative_weight_difference"] = max(
                    abs(a - b) / max(abs(b), 1e-3) for a, b in zip(f["weight_sums"], reference))
            f.pop("weight_sums", None)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"base": base, "one": one and {k: one.get(k) for k in ("rss_peak",
                                                                            "cgroup_peak")},
                   "cap": limit, "cgroups": capped,
                   "width": args.width, "layers": args.layers, "results": results},
                  f, indent=1)
    print(f"wrote {args.out}")


def _print(config, figures):
    mib = 1 << 20

    def against(kind, f):
        peak, planned = f.get(f"{kind}_peak"), f.get(f"planned_{kind}")
        if peak is None:
            return f"{kind} -"
        return (f"{kind} {peak / mib:5.0f} MiB" + (f" / plan {planned / mib:5.0f} = "
                                                   f"{peak / planned:4.2f}" if planned else
                                                   " / plan     0       "))

    for task, f in sorted(figures.items()):
        print(f"{config:9s} {task:8s} exit {f['exit']:>3}  {against('allocator', f)}  "
              f"{against('rss', f)}  {against('cgroup', f)}  oom kills "
              f"{f.get('oom_kills', '-')}", flush=True)


def _exit_on_sigterm(signum, frame):
    # As on Ctrl-C: run_config's cleanup (stop its processes, remove their cgroups) runs.
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    main()
