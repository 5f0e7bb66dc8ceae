"""Choosing the all-reduce implementation for a device list, and the bytes each device
sends per training step under each way of splitting the work. Pure Python.

Bytes per step, per device (the busiest), from the Megatron-LM and DeepSpeed papers
(a ring all-reduce of S bytes over n devices sends 2 (n-1)/n S from each,
`layouts.ring_all_reduce_bytes`):

    data parallel, G gradient bytes over R replicas   2 (R-1)/R G          (all-reduce)
    ZeRO stage 1 or 2                                  2 (R-1)/R G          (reduce-scatter
                                                                            + all-gather)
    ZeRO stage 3                                       1.5 x 2 (R-1)/R G    (weights gathered
                                                                            again for backward)
    pipeline, boundary activation A per micro-batch,   M A forward + M A backward (a middle
      M micro-batches, K stages                        stage; the first or last sends one way)
    tensor parallel over T, L column+row layer pairs,  L M 2 x 2 (T-1)/T A (one all-reduce
      output A per micro-batch                         forward, one backward, per pair)
    ... and its stage boundaries (Megatron's           M A / T to the neighbour stage's
      scatter-gather), per neighbour and direction     same rank + M (T-1)/T A all-gathered
    ... and the first stage's input, B per step        (T-1)/T B all-gathered
"""

from tfpar.errors import CommunicationError
from tfpar.plan.layouts import ring_all_reduce_bytes

AUTO = "auto"
NCCL = "nccl"
RING = "ring"
REDUCE_TO_ONE = "reduce_to_one"
HIERARCHICAL = "hierarchical"
# Replicas exchange in pairs: log2(n) steps for small buffers, 2 log2(n) for large ones,
# where a ring takes 2 (n-1) (`tfpar.plan.halving_doubling`).
HALVING_DOUBLING = "halving_doubling"
COMMUNICATIONS = (AUTO, NCCL, RING, REDUCE_TO_ONE, HIERARCHICAL, HALVING_DOUBLING)
# The ones that pack gradients into `bytes_per_pack` collectives.
PACKING = (RING, HALVING_DOUBLING)

# The CPU all-reduce "auto" picks on one host. Measured (benchmarks/data_parallel.py,
# BUILD_NOTES.md): summing on one CPU beats the ring by ~5-8% in step time, since
# local CPU "devices" share memory and the ring only adds steps.
CPU_DEFAULT = REDUCE_TO_ONE


# Across workers only collectives can reduce: NCCL on GPUs, the ring elsewhere, pairs of
# replicas by halving-doubling, or hierarchically over hosts (`tfpar.plan.host_hierarchy`:
# within each host, then one slice per replica across the hosts).
MULTI_WORKER = (AUTO, NCCL, RING, HALVING_DOUBLING, HIERARCHICAL)


def select_communication(requested, device_types, multi_worker=False, physical_gpus=None):
    """Returns the concrete all-reduce implementation for `requested`.

    Args:
      requested: one of `COMMUNICATIONS` (`MULTI_WORKER` when `multi_worker`).
      device_types: the device type of each local replica, e.g. `["GPU", "GPU"]`.
      multi_worker: reduce across worker processes too.
      physical_gpus: for each local replica on a GPU, the physical GPU it runs on
        (logical GPUs can be carved from one). NCCL refuses two replicas on one
        physical GPU: "auto" takes the ring there, as stock TensorFlow does.

    >>> select_communication("auto", ["GPU", "GPU"])
    'nccl'
    >>> select_communication("auto", ["CPU", "CPU"])
    'reduce_to_one'
    >>> select_communication("auto", ["GPU", "GPU"], physical_gpus=["GPU:0", "GPU:0"])
    'ring'
    """
    if requested not in COMMUNICATIONS:
        raise CommunicationError(
            f"Unknown communication {requested!r}. Use one of: "
            f"{', '.join(repr(c) for c in COMMUNICATIONS)}.")
    if multi_worker and requested not in MULTI_WORKER:
        raise CommunicationError(
            f"communication={requested!r} only works on one host. Across workers use "
            f"{', '.join(repr(c) for c in MULTI_WORKER)}.")
    types = [t.upper() for t in device_types]
    all_gpus = bool(types) and all(t == "GPU" for t in types)
    owners = [g for g in (physical_gpus or ()) if g is not None]
    shared = sorted({g for g in owners if owners.count(g) > 1})
    if requested == AUTO:
        if all_gpus:
            return RING if shared else NCCL
        return RING if multi_worker else CPU_DEFAULT
    if requested == NCCL and all_gpus and shared:
        raise CommunicationError(
            f"communication='nccl' needs one replica per physical GPU, but several replicas "
            f"run on logical GPUs of {', '.join(map(str, shared))} (NCCL refuses duplicate "
            f"GPUs). Use communication='auto' or 'ring', or one logical GPU per physical GPU.")
    if requested == NCCL and not all_gpus:
        others = sorted(set(t for t in types if t != "GPU"))
        raise CommunicationError(
            f"communication='nccl' needs every replica on a GPU: NCCL only runs on "
            f"NVIDIA GPUs, but the devices include {', '.join(others)} devices. Use "
            f"communication='auto' (or 'ring') on CPUs.")
    return requested


def check_bytes_per_pack(bytes_per_pack, default):
    """Validates `bytes_per_pack`; None becomes `default`."""
    if bytes_per_pack is None:
        return default
    if not isinstance(bytes_per_pack, int) or isinstance(bytes_per_pack, bool) or bytes_per_pack < 0:
        raise ValueError(
            f"bytes_per_pack must be an integer >= 0 (or None). Received: {bytes_per_pack!r}")
    return bytes_per_pack


# --- Gradient compression -----------------------------------------------------------------

COMPRESSIONS = (None, "fp16", "bf16")


def check_compression(compression, shard=None):
    """`compression` if tfpar compresses gradients that way for the wire ("fp16", "bf16",
    or None for full precision); a ValueError that says what to pass otherwise.

    >>> check_compression("bf16")
    'bf16'
    """
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be 'fp16', 'bf16' or None. Received: "
                         f"{compression!r}")
    if compression and shard == "parameters":
        raise ValueError(
            f"compression={compression!r} with shard={shard!r} is not supported yet: ZeRO-3's "
            f"gradients and weight reads are not compressed. Use shard='optimizer' or "
            f"'gradients' (ZeRO-1/2, whose gradient sums compress), or no compression.")
    return compression


def check_sharded_communication(communication, shard, multi_worker=False):
    """`communication` unless ZeRO (`shard`) cannot reduce with it: a ValueError then.

    >>> check_sharded_communication("ring", "optimizer")
    'ring'
    """
    if shard and (communication == HALVING_DOUBLING
                  or (communication == HIERARCHICAL and multi_worker)):
        raise ValueError(
            f"communication={communication!r} with shard={shard!r} is not supported yet: "
            f"ZeRO reduces its gradient buckets itself. Use communication='auto' or 'ring' "
            f"with shard=, or drop shard=.")
    return communication


# --- Bytes per training step ------------------------------------------------------------

def data_parallel_bytes(gradient_bytes, num_replicas, zero_stage=0):
    """Bytes each of `num_replicas` replicas sends per step to reduce `gradient_bytes` of
    gradients (and, under ZeRO, gather the updated or sharded weights).

    >>> data_parallel_bytes(1000, 4), data_parallel_bytes(1000, 4, zero_stage=3)
    (1500.0, 2250.0)
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3. Received: {zero_stage!r}")
    volume = ring_all_reduce_bytes(gradient_bytes, num_replicas)
    return 1.5 * volume if zero_stage == 3 else volume


def pipeline_bytes(boundary_bytes, num_stages, num_micro_batches=1):
    """Bytes the busiest stage of a `num_stages` pipeline sends per step: each
    micro-batch's activation (`boundary_bytes`) to the next stage and its gradient (the
    same size) to the previous one; with 2 stages each sends one way only.

    >>> pipeline_bytes(100, 1), pipeline_bytes(100, 2, 8), pipeline_bytes(100, 4, 8)
    (0, 800, 1600)
    """
    directions = min(2, num_stages - 1)
    return directions * num_micro_batches * boundary_bytes


def tensor_parallel_bytes(activation_bytes, tensor_parallel, num_layer_pairs,
                          num_micro_batches=1):
    """Bytes each of `tensor_parallel` devices sends per step for `num_layer_pairs`
    Megatron pairs (a column- then a row-parallel layer) whose output is
    `activation_bytes` per micro-batch: per pair and micro-batch, one all-reduce of the
    output forward and one of its gradient backward (Shoeybi et al. 2019).

    >>> tensor_parallel_bytes(1000, 2, num_layer_pairs=3, num_micro_batches=4)
    24000.0
    """
    return (num_layer_pairs * num_micro_batches * 2
            * ring_all_reduce_bytes(activation_bytes, tensor_parallel))


def device_step_bytes(gradient_bytes, boundary_bytes, stage=0, num_replicas=1, num_stages=1,
                      tensor_parallel=1, zero_stage=0, num_micro_batches=1,
                      layer_pairs_per_stage=0, rank=0, input_bytes=0):
    """Bytes one device (stage `stage`, tensor-parallel `rank`) of an R x K x T layout sends
    in one training step, by axis: {"data", "pipe", "model"} (arguments as
    `layout_step_bytes`). Its share of its stage's gradients (an even K x T-th of one
    copy's) in a ring over the R replicas; each micro-batch's activation to the next stage
    and its gradient to the previous one (none past either end); its tensor-parallel pairs'
    all-reduces. Under tensor parallelism every rank sends 1/T of each boundary tensor to the
    same rank of the neighbour stage, and the ranks all-gather the rest (Megatron's
    scatter-gather), and the first stage's ranks all-gather the replica's input
    (`input_bytes` per step) from the slices fed to each. Under ZeRO-3 a pipeline replica
    reads its stage's weights from their owners once per step (not per layer and again in
    the backward, as data parallelism does): the bytes of ZeRO-1, a reduce-scatter and an
    all-gather.

    >>> device_step_bytes(1000, 10, stage=0, num_replicas=2, num_stages=2, num_micro_batches=4)
    {'data': 500.0, 'pipe': 40.0, 'model': 0}
    >>> device_step_bytes(0, 10, stage=0, num_stages=2, tensor_parallel=2, num_micro_batches=4,
    ...                   rank=1, input_bytes=80)
    {'data': 0, 'pipe': 20.0, 'model': 60.0}
    """
    r, k, t, m = num_replicas, num_stages, tensor_parallel, num_micro_batches
    if not 0 <= stage < k:
        raise ValueError(f"stage must be in [0, {k}). Received: {stage!r}")
    if not 0 <= rank < t:
        raise ValueError(f"rank must be in [0, {t}). Received: {rank!r}")
    neighbours = (stage > 0) + (stage < k - 1)
    gathered = (neighbours * m * boundary_bytes + (input_bytes if stage == 0 else 0)) * (t - 1) / t
    return {"data": data_parallel_bytes(gradient_bytes / (k * t), r, min(zero_stage, 1))
            if r > 1 else 0,
            "pipe": neighbours * m * boundary_bytes / t,
            "model": tensor_parallel_bytes(boundary_bytes, t, layer_pairs_per_stage, m)
            + gathered if t > 1 else 0}


def layout_step_bytes(gradient_bytes, boundary_bytes, num_replicas=1, num_stages=1,
                      tensor_parallel=1, zero_stage=0, num_micro_batches=1,
                      layer_pairs_per_stage=0, input_bytes=0):
    """Bytes all the devices of an R x K x T layout send in one training step, by axis
    (the Megatron/DeepSpeed formulas summed over the devices, `device_step_bytes`):
    {"data", "pipe", "model"}.

    `gradient_bytes`: one model copy's gradients; `boundary_bytes`: one micro-batch's
    activation between two stages, and the output of each tensor-parallel layer pair (a
    column then a row layer), `layer_pairs_per_stage` of them in each stage; `input_bytes`:
    one replica's batch per step, which a tensor-parallel first stage all-gathers. A reduction
    that sums on one device and sends the sum back moves as many bytes in all as a ring
    does, so these totals hold for both.

    >>> layout_step_bytes(1000, 10, num_replicas=2, num_stages=2, num_micro_batches=4)
    {'data': 2000.0, 'pipe': 160.0, 'model': 0}
    >>> layout_step_bytes(1000, 10, num_stages=2, tensor_parallel=2, num_micro_batches=4,
    ...                   layer_pairs_per_stage=2)
    {'data': 0, 'pipe': 80.0, 'model': 720.0}
    """
    total = {"data": 0, "pipe": 0, "model": 0}
    for stage in range(num_stages):
        for rank in range(tensor_parallel):
            device = device_step_bytes(gradient_bytes, boundary_bytes, stage, num_replicas,
                                       num_stages, tensor_parallel, zero_stage,
                                       num_micro_batches, layer_pairs_per_stage, rank,
                                       input_bytes)
            for axis, value in device.items():
                total[axis] += num_replicas * value
    return total
