"""ZeRO sharding plans as plain data: which replica owns which variable.

tfpar shards whole variables (as PyTorch's ZeroRedundancyOptimizer does): each
variable has one owner replica, which keeps its optimizer state (stage 1), its
reduced gradient (stage 2) and, at stage 3, the variable itself. Owners are chosen
to even out bytes; `imbalance` says how far the largest shard is above 1/N.

    >>> owners([400, 100, 300, 200], 2)
    [0, 1, 1, 0]
"""

STAGES = {None: 0, "optimizer": 1, "gradients": 2, "parameters": 3}


def check_shard(shard):
    """The ZeRO stage (0-3) of a `shard=` argument, or a ValueError saying what is accepted."""
    if shard not in STAGES:
        raise ValueError(
            f"shard must be None (no sharding), 'optimizer' (ZeRO stage 1), 'gradients' "
            f"(stage 2) or 'parameters' (stage 3). Received: shard={shard!r}")
    return STAGES[shard]


def check_reshard(shard, reshard_after_forward):
    """Whether a stage-3 replica frees the weights it gathered for a layer's forward pass
    and gathers them again for its backward pass (FSDP's reshard_after_forward): the
    default (None) under shard="parameters". ValueError for a value that is not a bool, or
    True without stage 3 (nothing is gathered there).

    >>> check_reshard("parameters", None), check_reshard("optimizer", None)
    (True, False)
    """
    stage = check_shard(shard)
    if reshard_after_forward is None:
        return stage == 3
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward must be True, False or None. Received: "
                         f"reshard_after_forward={reshard_after_forward!r}")
    if reshard_after_forward and stage != 3:
        raise ValueError(
            f"reshard_after_forward=True frees and gathers again the weights a replica reads "
            f"from their owners, which only shard='parameters' does. Received: "
            f"shard={shard!r}. Pass shard='parameters', or drop reshard_after_forward.")
    return reshard_after_forward


def collectives_for(communication, across_workers=False, pair_groups=True):
    """How shards move: "nccl" (NCCL reduce-scatter and all-gather) when the strategy
    all-reduces with NCCL, on one host or across workers; "pairwise" across workers on
    CPUs (TensorFlow has no CPU reduce-scatter: each replica sends each other replica the
    part it owns, two-replica broadcasts, and sums what it receives) when every pair of
    replicas can have a group of its own (`pair_groups`); else "all_reduce" (gradients
    all-reduced, each replica keeping its own). Except under "nccl", the all-gather goes
    through the strategy's cross-device ops.

    >>> collectives_for("nccl"), collectives_for("reduce_to_one"), collectives_for("ring")
    ('nccl', 'all_reduce', 'all_reduce')
    >>> collectives_for("ring", across_workers=True)
    'pairwise'
    >>> collectives_for("ring", across_workers=True, pair_groups=False)
    'all_reduce'
    """
    if communication == "nccl":
        return "nccl"
    return "pairwise" if across_workers and pair_groups else "all_reduce"


def next_owner(loads):
    """The replica that takes the next variable: the least loaded, ties to the lowest index."""
    return min(range(len(loads)), key=lambda r: (loads[r], r))


def owners(sizes, num_shards):
    """The owner replica of each variable, in the order variables are created: each goes
    to the least-loaded replica so far. The order, not a sort, decides, because a
    strategy assigns each variable when Keras creates it; every worker creates the same
    variables in the same order, so every worker makes the same plan."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1. Received: {num_shards}")
    loads = [0] * num_shards
    result = []
    for size in sizes:
        owner = next_owner(loads)
        result.append(owner)
        loads[owner] += size
    return result


DEFAULT_BUCKET_BYTES = 25 << 20  # PyTorch DDP's default bucket: a few per model, each big.


def buckets(num_bytes, bucket_bytes):
    """Groups of variable indices whose gradients travel together, last variables first.

    Backpropagation produces the gradients of the last layers first: a bucket made of
    them can be reduced while earlier layers still compute. Each bucket holds at most
    `bucket_bytes` (a larger variable travels alone); 0 puts everything in one bucket.

    >>> buckets([40, 40, 40, 100], 80)
    [[3], [2, 1], [0]]
    """
    result, size = [], 0
    for index in reversed(range(len(num_bytes))):
        if not result or (bucket_bytes and size + num_bytes[index] > bucket_bytes):
            result.append([])
            size = 0
        result[-1].append(index)
        size += num_bytes[index]
    return result


def shard_sizes(sizes, owner_of, num_shards):
    """Total size owned by each replica."""
    totals = [0] * num_shards
    for size, owner in zip(sizes, owner_of):
        totals[owner] += size
    return totals


def imbalance(sizes, num_shards):
    """Largest shard / (total / N): 1.0 is a perfect split."""
    total = sum(sizes)
    if not total:
        return 1.0
    return max(shard_sizes(sizes, owners(sizes, num_shards), num_shards)) * num_shards / total
