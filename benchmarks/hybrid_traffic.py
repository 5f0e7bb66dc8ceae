"""Bytes each hybrid layout sends per training step across 4 (or 8) worker processes,
measured on the wire, against the Megatron/DeepSpeed formulas.

Each layout runs as a job of its own: `tfpar launch --workers 4 --coordinator` (a chief
that runs the program, 4 workers that hold the stages, one CPU device each, all in a
private network namespace), `tfpar.PipelineStrategy(num_replicas=R, num_stages=K,
tensor_parallel=T, shard=..., cluster_resolver=...)`. The chief reads the namespace's
loopback counters (`/proc/net/dev`, bytes sent by every process of the job) before and
after `--steps` steps of `fit` (after a fit of 2 warm-up steps) and divides. The formula
(`tfpar.plan.communication.layout_step_bytes`) counts the gradient reduction over the data
axis, the stage boundaries' activations and their gradients, the tensor-parallel pairs'
reductions, plus the batch the chief sends each step; the wire adds gRPC framing and the
runtime's own requests.

Where the bytes concentrate: the chief also reads every TCP socket's bytes acked and received
(`ss -tinp`) before and after, attributes them to the task whose process owns the socket, and
sets each task's sends against its role's formula (`device_step_bytes`: its stage and tensor
rank; the chief's: the batch).

    python benchmarks/hybrid_traffic.py [--workers 4|8] [--steps 5] [--only TEXT] [--out FILE]

The model is `benchmarks/hybrid.py`'s (8 x Dense(512) split Megatron's way under tensor
parallelism, a 10-way head, Adam), global batch 256, 4 micro-batches, 1F1B.
"""

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _common import command_line, hidden_mlp, write_json  # noqa: E402

LAYOUTS_BY_WORKERS = {}
LAYOUTS = {  # name: (R, K, T, shard), over 4 worker processes
    "pipeline, K=4": (1, 4, 1, None),
    "pipeline K=2 x data R=2": (2, 2, 1, None),
    "pipeline K=2 x data R=2, ZeRO-1": (2, 2, 1, "optimizer"),
    "pipeline K=2 x data R=2, ZeRO-3": (2, 2, 1, "parameters"),
    "pipeline K=2 x tensor T=2": (1, 2, 2, None),
    "tensor T=2 x data R=2": (2, 1, 2, None),
    "tensor T=4": (1, 1, 4, None),
}
LAYOUTS_BY_WORKERS[4] = LAYOUTS
LAYOUTS_BY_WORKERS[8] = {
    "pipeline, K=8": (1, 8, 1, None),
    "pipeline K=4 x data R=2": (2, 4, 1, None),
    "pipeline K=2 x data R=4": (4, 2, 1, None),
    "pipeline K=2 x data R=4, ZeRO-1": (4, 2, 1, "optimizer"),
    "pipeline K=2 x data R=4, ZeRO-3": (4, 2, 1, "parameters"),
    "pipeline K=2 x tensor T=2 x data R=2": (2, 2, 2, None),
}
ALL_LAYOUTS = {**LAYOUTS_BY_WORKERS[4], **LAYOUTS_BY_WORKERS[8]}


def loopback_sent():
    """Bytes sent over loopback in this network namespace so far."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def bytes_by_task(since=None):
    """({task name: [bytes sent, bytes received]}, {(task, peer task): bytes sent}) over the
    TCP sockets of this network namespace (`ss`: each socket's bytes acked and received,
    attributed to its process, named by the TF_CONFIG in its environment, and its peer to
    the process owning the peer's address; processes without one are "other").

    `since`: a `socket_counters()` snapshot; each socket then counts what it carried after
    it (a socket opened since: all of it). (Totals subtracted instead went negative when
    gRPC replaced a connection between the snapshots: -29 MiB "per step" measured.)"""
    sockets = socket_counters()
    if since is not None:
        earlier = {(pid, local, peer): (sent, received)
                   for pid, local, peer, sent, received in since}
        sockets = [[pid, local, peer, sent - earlier.get((pid, local, peer), (0, 0))[0],
                    received - earlier.get((pid, local, peer), (0, 0))[1]]
                   for pid, local, peer, sent, received in sockets]
    return _by_task(sockets)


def socket_counters():
    """[[pid, local address, peer address, bytes acked, bytes received]] of this network
    namespace's TCP sockets (`ss -tinpH`)."""
    import re
    import subprocess as sp

    out = sp.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    sockets, current = [], None  # [pid, local, peer, sent, received]
    for line in out.splitlines():
        if not line[:1].isspace():
            fields = line.split()
            found = re.search(r"pid=(\d+)", line)
            current = [int(found[1]) if found else None, fields[3] if len(fields) > 4 else None,
                       fields[4] if len(fields) > 4 else None, 0, 0]
            sockets.append(current)
            continue
        sent, received = (re.search(rf"{key}:(\d+)", line) for key in ("bytes_acked",
                                                                           "bytes_received"))
        if current is not None:
            current[3] += int(sent[1]) if sent else 0
            current[4] += int(received[1]) if received else 0
    return sockets


def _by_task(sockets):
    owner = {local: pid for pid, local, _, _, _ in sockets if pid is not None}
    names = {}

    def name_of(pid):
        if pid not in names:
            names[pid] = "other"
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(item.split(b"=", 1) for item in f.read().split(b"\0")
                               if b"=" in item)
                task = json.loads(env[b"TF_CONFIG"])["task"]
                names[pid] = f"{task['type']}:{task['index']}"
            except (OSError, KeyError, ValueError, TypeError):
                pass
        return names[pid]

    tasks, pairs = {}, {}
    for pid, _, peer, sent, received in sockets:
        if pid is None:
            continue
        totals = tasks.setdefault(name_of(pid), [0, 0])
        totals[0] += sent
        totals[1] += received
        pair = (name_of(pid), name_of(owner[peer]) if peer in owner else "other")
        pairs[pair] = pairs.get(pair, 0) + sent
    return tasks, pairs


def measure(layout, args):
    """On the chief: trains the layout's strategy and returns its bytes per step."""
    import tfpar

    r, k, t, shard = ALL_LAYOUTS[layout]
    tfpar.virtual_cpus(max(2, r))  # One per pipeline replica: each is fed from one.
    import numpy as np
    import tensorflow as tf

    from tfpar.cli.train import megatron_layout_map
    from tfpar.plan import communication, sharding

    strategy = tfpar.PipelineStrategy(
        num_replicas=r, num_stages=k, tensor_parallel=t, shard=shard, schedule="1f1b",
        num_micro_batches=args.micro_batches,
        layout_map=megatron_layout_map(args.layers) if t > 1 else None,
        cluster_resolver=tf.distribute.cluster_resolver.TFConfigClusterResolver())
    with strategy.scope():
        model = hidden_mlp(args.width, args.layers)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.global_batch, args.width), dtype=np.float32)
    y = (np.arange(args.global_batch) % 10).astype("int32")
    # fit, not train_on_batch: Keras' train_on_batch hands every replica the whole batch
    # (under stock MirroredStrategy too), which doubles each replica's work at R=2.
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
    before, sockets = loopback_sent(), socket_counters()
    model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0)
    sent = (loopback_sent() - before) / args.steps
    tasks, pairs = bytes_by_task(since=sockets)
    per_task = {name: [b / args.steps for b in both] for name, both in tasks.items()}
    per_pair = {f"{a} -> {b}": bytes_ / args.steps for (a, b), bytes_ in pairs.items()
                if bytes_ > 0}
    boundary = 4 * args.width * args.global_batch // r // args.micro_batches
    replica_input = x.nbytes // r  # What a tensor-parallel first stage all-gathers.
    formula = communication.layout_step_bytes(
        4 * model.count_params(), boundary, r, k, t, sharding.STAGES[shard],
        args.micro_batches, layer_pairs_per_stage=args.layers // 2 // k,
        input_bytes=replica_input)
    formula["inputs"] = x.nbytes + y.nbytes
    # Each worker's role: worker w is device (replica, stage, rank) in the strategy's grid,
    # numbered replica-major, rank innermost.
    per_device = {}
    for w in range(r * k * t):
        stage, rank = (w // t) % k, w % t
        per_device[f"worker:{w}"] = sum(communication.device_step_bytes(
            4 * model.count_params(), boundary, stage, r, k, t, sharding.STAGES[shard],
            args.micro_batches, layer_pairs_per_stage=args.layers // 2 // k,
            rank=rank, input_bytes=replica_input).values())
    per_device["chief:0"] = formula["inputs"]
    return {"measured": sent, "formula": formula, "per_task": per_task,
            "per_task_formula": per_device, "per_pair": per_pair}


def run_layout(layout, args):
    """Runs `layout` as a job of its own; returns what its chief measured."""
    command = [sys.executable, "-m", "tfpar.cli.launch", f"--workers={args.workers}",
               "--coordinator",
               "--network=private", "--timeout=600", "--", sys.executable,
               os.path.abspath(__file__), f"--layout={layout}"] + [
        f"--{key}={value}" for key, value in vars(args).items()
        if key not in ("out", "layout", "only")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=700)
    found = [line.split("RESULT ", 1)[1] for line in done.stdout.splitlines()
             if "RESULT " in line]
    if done.returncode or not found:
        raise RuntimeError(f"{layout}: exit {done.returncode}\n{done.stdout[-3000:]}")
    return json.loads(found[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--global_batch", type=int, default=256)
    parser.add_argument("--micro_batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--workers", type=int, default=4, choices=sorted(LAYOUTS_BY_WORKERS),
                        help="worker processes (each its set of layouts)")
    parser.add_argument("--only", default=None,
                        help="run the layouts whose name contains this text (e.g. ZeRO)")
    parser.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "hybrid_traffic.json"))
    args = parser.parse_args()
    if args.layout:
        print("RESULT " + json.dumps(measure(args.layout, args)), flush=True)
        return
    mib = 1 << 20
    print(f"MLP {args.layers}x{args.width} + head, Adam, global batch {args.global_batch}, "
          f"{args.micro_batches} micro-batches, {args.workers} worker processes; MiB per step")
    print(f"{'layout':34s} {'measured':>9s} {'formula':>8s} {'ratio':>6s}   "
          f"{'data':>6s} {'pipe':>6s} {'model':>6s} {'inputs':>6s}")
    rows = {}
    for layout in LAYOUTS_BY_WORKERS[args.workers]:
        if args.only and args.only not in layout:
            continue
        result = run_layout(layout, args)
        formula = result["formula"]
        total = sum(formula.values())
        rows[layout] = dict(result, formula_total=total,
                            ratio=round(result["measured"] / total, 3))
        print(f"{layout:34s} {result['measured'] / mib:9.2f} {total / mib:8.2f} "
              f"{result['measured'] / total:6.2f}   "
              + " ".join(f"{formula[axis] / mib:6.2f}"
                         for axis in ("data", "pipe", "model", "inputs")), flush=True)
        # Where the bytes concentrate: each task's sends against its role's formula.
        tasks = sorted(result["per_task_formula"])
        sends = {name: result["per_task"].get(name, [0, 0])[0] for name in tasks}
        busiest = max(sends, key=sends.get)
        rows[layout]["busiest"] = {
            "task": busiest, "sent": sends[busiest],
            "formula": result["per_task_formula"][busiest],
            "ratio": round(sends[busiest] / max(result["per_task_formula"][busiest], 1), 3)}
        print("    sent by task (formula): " + ", ".join(
            f"{name} {sends[name] / mib:.2f} ({result['per_task_formula'][name] / mib:.2f})"
            for name in tasks) + f"; busiest {busiest}", flush=True)
        print(f"    {busiest} sent to: " + ", ".join(
            f"{pair.split(' -> ')[1]} {sent / mib:.2f}"
            for pair, sent in sorted(result["per_pair"].items())
            if pair.startswith(f"{busiest} -> ")), flush=True)
    write_json(args.out, {"benchmark": "hybrid_traffic",
                          "command": command_line("hybrid_traffic", argparse.Namespace(**{
                              k: v for k, v in vars(args).items() if k != "layout"})),
                          "rows": rows})


if __name__ == "__main__":
    main()
