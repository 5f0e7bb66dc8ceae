"""The paper scale, from the plan: a 7B-parameter transformer on 64 GPUs over 8 hosts, for
each layout tfpar builds: memory per device, bytes each device sends per step by axis, and
checkpoint bytes written per host. Planned, not measured (no GPU here): the formulas are
`tfpar.plan`'s, and the figures below them say how each held on the small cases measured
here.

    python benchmarks/cluster_scale.py [--params_per_layer ...] [--out FILE]

The model: Llama-7B's shapes (32 layers of hidden 4096: attention q, k, v, o of 4096 x 4096
and an MLP of 3 x 4096 x 11008; embedding and head of 32000 x 4096: 6.74B parameters),
float32 weights and Adam (16 bytes per parameter of state: weights, gradients, 2 slots).
Activations are left out of memory (they depend on the sequence length, micro-batch and
recomputation, the same for every layout of a stage); a stage boundary and a tensor-parallel
pair's output are one micro-batch of 1 x 2048 tokens x 4096 in bfloat16 (16 MiB), with 16
micro-batches per step where there is a pipeline or tensor parallelism.
"""

import argparse
import json
import os

from tfpar.plan import communication, sharding
from tfpar.plan.memory import MemoryConfig, estimate_memory

HOSTS, GPUS_PER_HOST = 8, 8
LAYERS, HIDDEN, MLP, VOCAB = 32, 4096, 11008, 32000
BOUNDARY_BYTES = 2048 * HIDDEN * 2
MICRO_BATCHES = 16
GIB = 1 << 30

# name: (R, K, T, shard). Devices numbered replica-major as PipelineStrategy's grid (a
# replica's K x T devices together: on one host when they fit, T innermost).
LAYOUTS = {
    "data R=64": (64, 1, 1, None),
    "data R=64, ZeRO-1": (64, 1, 1, "optimizer"),
    "data R=64, ZeRO-2": (64, 1, 1, "gradients"),
    "data R=64, ZeRO-3": (64, 1, 1, "parameters"),
    "pipeline K=8 x data R=8, ZeRO-1": (8, 8, 1, "optimizer"),
    "tensor T=8 x data R=8, ZeRO-1": (8, 1, 8, "optimizer"),
    "tensor T=8 x pipeline K=4 x data R=2, ZeRO-1": (2, 4, 8, "optimizer"),
}


def variable_sizes():
    """The model's trainable variables in order (elements)."""
    layer = [HIDDEN * HIDDEN] * 4 + [HIDDEN * MLP] * 3 + [HIDDEN] * 2
    return [VOCAB * HIDDEN] + layer * LAYERS + [HIDDEN, VOCAB * HIDDEN]


def plan(layout):
    r, k, t, shard = LAYOUTS[layout]
    sizes = variable_sizes()
    params = sum(sizes)
    if k == 1 and t == 1:
        config = MemoryConfig("sharded" if shard else "data", r, shard=shard)
    else:
        config = MemoryConfig("pipeline", k, shard=shard, num_replicas=r, tensor_parallel=t,
                              reshard_after_forward=False)
    estimate = estimate_memory(sizes, config)
    stage = sharding.STAGES[shard]
    if k == 1 and t == 1:  # Data parallelism: the whole gradient in a ring (ZeRO-3 1.5x).
        sends = {"data": communication.data_parallel_bytes(4 * params, r, stage) if r > 1
                 else 0, "pipe": 0, "model": 0}
    else:
        # The busiest device: a middle stage's (two neighbours), its share of the stage's
        # gradients in the data ring, its boundaries by scatter-gather (1/T across, the rest
        # all-gathered in its group), its pairs' all-reduces, the first stage's token ids.
        sends = communication.device_step_bytes(
            4 * params, BOUNDARY_BYTES, stage=min(1, k - 1), num_replicas=r, num_stages=k,
            tensor_parallel=t, zero_stage=stage, num_micro_batches=MICRO_BATCHES,
            layer_pairs_per_stage=2 * LAYERS // k, input_bytes=MICRO_BATCHES * 2048 * 4)
    state = 16 * params
    # Owner-written (tfpar.keras.owner_saving): each host its workers' shares. Gathered
    # (`.weights.h5` on every worker, as a multi-worker program must save): every worker
    # writes the whole state, 8 copies per host.
    checkpoint = {"owners": state / HOSTS if stage else state,
                  "gathered": GPUS_PER_HOST * state}
    return {"params": params, "memory_per_device": estimate.peak, "sends": sends,
            "busiest_sends": sum(sends.values()), "checkpoint_per_host": checkpoint,
            "crosses_hosts": _crosses_hosts(r, k, t)}


def _crosses_hosts(r, k, t):
    """The axes whose groups span hosts, devices numbered (r, k, t) host-major."""
    axes = []
    if t > GPUS_PER_HOST:
        axes.append("model")
    if k > 1 and t * k > GPUS_PER_HOST:
        axes.append("pipe")
    if r > 1 and r * k * t > GPUS_PER_HOST:
        axes.append("data")
    return axes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "cluster_scale.json"))
    args = parser.parse_args()
    rows = {name: plan(name) for name in LAYOUTS}
    params = next(iter(rows.values()))["params"]
    print(f"{params / 1e9:.2f}B parameters (Llama-7B shapes), fp32 + Adam, {HOSTS} hosts x "
          f"{GPUS_PER_HOST} GPUs; GiB")
    print(f"{'layout':44s} {'memory':>7s} {'data':>7s} {'pipe':>7s} {'model':>7s} "
          f"{'sends':>7s} {'ckpt/host owners':>16s} {'gathered':>9s}  across hosts")
    for name, row in rows.items():
        s = row["sends"]
        print(f"{name:44s} {row['memory_per_device'] / GIB:7.1f} {s['data'] / GIB:7.2f} "
              f"{s['pipe'] / GIB:7.2f} {s['model'] / GIB:7.2f} {row['busiest_sends'] / GIB:7.2f} "
              f"{row['checkpoint_per_host']['owners'] / GIB:16.1f} "
              f"{row['checkpoint_per_host']['gathered'] / GIB:9.1f}  "
              f"{', '.join(row['crosses_hosts'])}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "cluster_scale", "command": "python benchmarks/cluster_scale.py",
                   "hosts": HOSTS, "gpus_per_host": GPUS_PER_HOST, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
