"""Process-wide collective group keys, so strategies of any size coexist.

Every stock `MirroredStrategy` numbers its collective groups from 1. A second
strategy with a different number of replicas then joins group 1 with the wrong
size and TensorFlow aborts ("joining a group with size 4, but that group has
size 2"). Each tfpar strategy takes its own block of keys instead.

Strategies whose collectives cross workers number their blocks apart from the
one-host ones: the n-th cross-worker strategy of every worker gets the same block
whatever local strategies a worker made before it (a local PipelineStrategy on one
worker only used to shift the keys of that worker's next multi-worker strategy, and
both waited forever). That the workers made the same cross-worker strategies in
the same order is checked when each is made (`tfpar.distribute.common.rendezvous`).
"""

import itertools
import threading

# Keys a strategy may use: one per distinct device group it reduces over.
_BLOCK = 1000
# Blocks start far above the keys others use in the same process: a stock MirroredStrategy
# numbers its groups from 1, and DTensor (tfpar.MeshStrategy, keras.distribution) takes
# 2048 x n + g for its n-th partition of a mesh into groups g = 0, 1, ... (TensorFlow's
# dtensor/mlir/collectives.cc); a key that two of them give different devices aborts both
# ("joining a group that is already full").
_FIRST_LOCAL_BLOCK = 1 << 18  # Keys from 262,144,000: DTensor reaches them after 128k bases.
# Cross-worker blocks start here, far above any number of one-host strategies.
_FIRST_CLUSTER_BLOCK = 1 << 19
_lock = threading.Lock()
_blocks = {False: itertools.count(_FIRST_LOCAL_BLOCK),
           True: itertools.count(_FIRST_CLUSTER_BLOCK)}


def next_key_base(across_workers=False):
    """The base of a fresh block; keys base+1 .. base+_BLOCK are the caller's."""
    with _lock:
        return next(_blocks[across_workers]) * _BLOCK


def cluster_index(key_base):
    """0 for the first cross-worker strategy of this process, 1 for the next, ..."""
    return key_base // _BLOCK - _FIRST_CLUSTER_BLOCK


# The top half of each block: groups of two replicas (tfpar's point-to-point exchanges,
# `tfpar.distribute.zero.zero_collectives`), numbered down from the top, clear of the
# strategy's own.
_PAIR_KEYS = _BLOCK // 2


def broadcast_key(key_base):
    """The group key of tfpar's own broadcasts over all the replicas of the strategy at
    `key_base` (stage-3 reads across workers), between the strategy's keys (numbered up
    from the bottom) and the pairs' (numbered down from the top, at most 496 of them)."""
    return key_base + _PAIR_KEYS


def pairs_fit(num_replicas):
    """Whether a block has a key for every pair of `num_replicas` replicas (up to 32)."""
    return num_replicas * (num_replicas - 1) // 2 <= _PAIR_KEYS


# Below the broadcast key: the groups of a hierarchical all-reduce across hosts
# (`tfpar.distribute.common.hierarchical_reduce`), one per host and one per index of a
# replica on its host, clear of TensorFlow's own (numbered up from the bottom: one per
# device group the strategy reduces over).
_HIERARCHY_KEYS = 100


def hierarchy_key(key_base, index):
    """The group key of the `index`-th group of the hierarchical all-reduce of the strategy
    at `key_base` (hosts first, then the groups across hosts)."""
    if not 0 <= index < _HIERARCHY_KEYS:
        raise ValueError(f"A hierarchical all-reduce has group keys for {_HIERARCHY_KEYS} "
                         f"groups (hosts plus replicas per host); this needs group {index}.")
    return key_base + _PAIR_KEYS - _HIERARCHY_KEYS + index


def tensor_group_key(key_base, index):
    """The group key of the `index`-th tensor-parallel group (a stage's T devices in one
    pipeline replica) of the pipeline at `key_base`: the hierarchy's region, which a
    pipeline, never reducing over hosts, leaves free."""
    return hierarchy_key(key_base, index)


def pair_key(key_base, first, second, num_replicas):
    """The group key of replicas `first` < `second` (of `num_replicas`) in the block at
    `key_base` (`pairs_fit(num_replicas)` must hold)."""
    if not pairs_fit(num_replicas):
        raise ValueError(f"No group key for every pair of {num_replicas} replicas.")
    index = first * (2 * num_replicas - first - 1) // 2 + (second - first - 1)
    return key_base + _BLOCK - index


# Halving-doubling all-reduces (`tfpar.distribute.common.pair_exchanges`) exchange in
# groups of two, one group per pair of replicas that meet: (i, i ^ 2^level) at each level
# of the core, (i, i + core) when the replicas are not a power of two. Their keys lie in a
# region of their own above every block (int32 keys end at 2^31): each strategy has 2^20
# there, room for 32,768 replicas.
_FIRST_EXCHANGE_KEY = 1 << 30
_EXCHANGE_KEYS = 1 << 20
_EXCHANGE_STRATEGIES = 512  # Per kind (one-host, cross-worker) and process.
_LEVELS = 32
# A strategy's place among the halving-doubling ones of its kind, taken when its exchanges
# are made: other strategies (the suite makes hundreds in one process) take none. Workers
# make their cross-worker strategies in the same order (checked), so they agree.
_exchange_slots = {}
_exchange_counts = {False: itertools.count(), True: itertools.count()}


def exchange_slot(key_base):
    """The halving-doubling slot of the strategy at `key_base` (0 for the first such
    strategy of its kind in this process), taken on first call."""
    block = key_base // _BLOCK
    with _lock:
        if block not in _exchange_slots:
            _exchange_slots[block] = next(_exchange_counts[block >= _FIRST_CLUSTER_BLOCK])
        return _exchange_slots[block]


def exchange_key(key_base, lower, level):
    """The group key of the pair of replicas that meet at `level` of a halving-doubling
    all-reduce of the strategy at `key_base`, `lower` the lower replica of the two."""
    across_workers = key_base // _BLOCK >= _FIRST_CLUSTER_BLOCK
    index = exchange_slot(key_base)
    if not 0 <= index < _EXCHANGE_STRATEGIES:
        raise ValueError(f"Halving-doubling all-reduces have group keys for "
                         f"{_EXCHANGE_STRATEGIES} halving-doubling strategies of a process; "
                         f"this is its {index + 1}th. Use communication='ring' for more "
                         f"strategies.")
    pair = lower * _LEVELS + level
    if not (0 <= level < _LEVELS and 0 <= pair < _EXCHANGE_KEYS):
        raise ValueError(f"No group key for replica {lower} at level {level}: "
                         f"halving-doubling reaches {_EXCHANGE_KEYS // _LEVELS} replicas.")
    kind = _EXCHANGE_STRATEGIES if across_workers else 0
    return _FIRST_EXCHANGE_KEY + (kind + index) * _EXCHANGE_KEYS + pair
