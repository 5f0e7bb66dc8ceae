"""Halving-doubling all-reduce: what each replica exchanges with whom, step by step. Pure
Python (the TensorFlow ops that carry it out: `tfpar.distribute.common.pair_exchanges`).

Of `world` replicas, the largest power of two q <= world form the core; each of the
r = world - q others first hands its buffer to core replica rank - q and gets the result
back at the end (the "fold" and "unfold" of Rabenseifner's algorithm). In the core:

- recursive doubling (`DOUBLING`, for small, latency-bound buffers): in step k each replica
  swaps its whole buffer with replica rank ^ 2^k and adds: log2(q) steps, each sending the
  whole buffer;
- halving-doubling (`HALVING_DOUBLING`, Rabenseifner's, for large buffers): the buffer cut
  into q chunks, a reduce-scatter by recursive halving (in each step a replica sends half of
  the chunks it holds to its partner and adds the partner's copy of the other half) leaves
  replica i with chunk i summed; an all-gather by recursive doubling, in reverse, copies the
  sums back: 2 log2(q) steps sending 2 (q-1)/q of the buffer, a ring's bytes in
  2 log2(q) steps where a ring takes 2 (q-1).

    >>> [(s.kind, s.partner) for s in plan(1, 4, HALVING_DOUBLING)]
    [('halve', 3), ('halve', 0), ('double', 0), ('double', 3)]
    >>> [(s.kind, s.partner) for s in plan(4, 5, DOUBLING)]
    [('give', 0), ('take_result', 0)]
"""

import dataclasses

DOUBLING = "recursive_doubling"
HALVING_DOUBLING = "halving_doubling"
ALGORITHMS = (DOUBLING, HALVING_DOUBLING)

# Buffers up to this size go by recursive doubling: fewer steps, more bytes (measured:
# benchmarks/all_reduce_algorithms.py, BUILD_NOTES).
DOUBLING_BYTES = 64 << 10

# Each step's kind, for a replica:
GIVE = "give"  # fold: send the whole buffer to `partner` (a core replica), then wait.
TAKE = "take"  # fold: receive `partner`'s whole buffer and add it.
SWAP = "swap"  # recursive doubling: swap whole buffers with `partner` and add.
HALVE = "halve"  # send chunks `send`, keep chunks `keep` plus the partner's copy of them.
DOUBLE = "double"  # swap the chunks held (`keep`) for the partner's (`send`: theirs).
GIVE_RESULT = "give_result"  # unfold: send the result to `partner`.
TAKE_RESULT = "take_result"  # unfold: receive the result from `partner`.


@dataclasses.dataclass(frozen=True)
class Step:
    """One exchange of a replica with `partner`. `keep` and `send` are chunk ranges
    (start, stop) of the core's q chunks: for HALVE the chunks kept and sent; for DOUBLE
    the chunks held before and the partner's (held after it as well)."""

    kind: str
    partner: int
    keep: tuple = (0, 0)
    send: tuple = (0, 0)


def choose(nbytes, world, doubling_bytes=DOUBLING_BYTES):
    """The algorithm for a buffer of `nbytes` over `world` replicas: recursive doubling up
    to `doubling_bytes` (latency-bound), halving-doubling above.

    >>> choose(4096, 8), choose(16 << 20, 8)
    ('recursive_doubling', 'halving_doubling')
    """
    _check_world(world)
    return DOUBLING if nbytes <= doubling_bytes else HALVING_DOUBLING


def core_size(world):
    """The largest power of two <= `world` (the replicas that run the exchanges).

    >>> core_size(8), core_size(6), core_size(1)
    (8, 4, 1)
    """
    _check_world(world)
    return 1 << (world.bit_length() - 1)


def _check_world(world):
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"The number of replicas must be an integer >= 1. Received: "
                         f"{world!r}")


def _check(rank, world, algorithm):
    _check_world(world)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be a replica index in [0, {world}). Received: {rank!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"Unknown all-reduce algorithm {algorithm!r}. Use one of: "
                         f"{', '.join(repr(a) for a in ALGORITHMS)}.")


def plan(rank, world, algorithm=HALVING_DOUBLING):
    """The steps of replica `rank` of `world` in an all-reduce by `algorithm`, in order."""
    _check(rank, world, algorithm)
    q = core_size(world)
    if rank >= q:  # Outside the core: hand over, wait for the result.
        return [Step(GIVE, rank - q), Step(TAKE_RESULT, rank - q)]
    extra = rank + q if rank + q < world else None
    steps = [Step(TAKE, extra)] if extra is not None else []
    if algorithm == DOUBLING:
        steps += [Step(SWAP, rank ^ d) for d in _distances(q)]
    else:
        steps += _halving_then_doubling(rank, q)
    if extra is not None:
        steps.append(Step(GIVE_RESULT, extra))
    return steps


def _distances(q):
    """1, 2, 4, ... < q."""
    d = 1
    while d < q:
        yield d
        d *= 2


def _halving_then_doubling(rank, q):
    lo, hi, halves = 0, q, []
    for d in reversed(list(_distances(q))):  # q/2, q/4, ..., 1
        middle = lo + d
        lower, upper = (lo, middle), (middle, hi)
        keep, send = (lower, upper) if not rank & d else (upper, lower)
        halves.append(Step(HALVE, rank ^ d, keep, send))
        lo, hi = keep
    doubles = [Step(DOUBLE, s.partner, s.keep, s.send) for s in reversed(halves)]
    return halves + doubles


def chunk_elements(elements, world):
    """Elements per chunk: the buffer padded to a multiple of the core's chunk count."""
    q = core_size(world)
    return -(-elements // q)


def simulate(buffers, algorithm=HALVING_DOUBLING):
    """Runs every replica's plan on `buffers` (one list of numbers per replica) and
    returns what each ends with: a check of the plans, with no TensorFlow (the ops follow
    the same steps)."""
    world = len(buffers)
    q = core_size(world)
    per_chunk = chunk_elements(len(buffers[0]), world)
    size = len(buffers[0])
    held = [list(b) + [0] * (per_chunk * q - size) for b in buffers]
    plans = [plan(r, world, algorithm) for r in range(world)]

    def piece(values, chunks):
        return values[chunks[0] * per_chunk:chunks[1] * per_chunk]

    def put(values, chunks, new):
        values[chunks[0] * per_chunk:chunks[1] * per_chunk] = new

    # Steps run in rounds: round t is every replica's t-th step of the same phase; the
    # two sides of an exchange read what both held before it.
    for phase in ((GIVE, TAKE), (SWAP, HALVE, DOUBLE), (GIVE_RESULT, TAKE_RESULT)):
        own = [[s for s in p if s.kind in phase] for p in plans]
        for t in range(max(len(s) for s in own)):
            before = [list(h) for h in held]
            for r in range(world):
                if t >= len(own[r]):
                    continue
                s = own[r][t]
                theirs = before[s.partner]
                if s.kind in (TAKE, SWAP):
                    held[r] = [a + b for a, b in zip(before[r], theirs)]
                elif s.kind == TAKE_RESULT:
                    held[r] = list(theirs)
                elif s.kind == HALVE:
                    put(held[r], s.keep, [a + b for a, b in
                                          zip(piece(before[r], s.keep), piece(theirs, s.keep))])
                elif s.kind == DOUBLE:
                    put(held[r], s.send, piece(theirs, s.send))
    return [h[:size] for h in held]


def bytes_sent(nbytes, world, algorithm):
    """Bytes the busiest replica sends in one all-reduce of `nbytes` ("ring" as well).

    >>> bytes_sent(1024, 8, "ring"), bytes_sent(1024, 8, HALVING_DOUBLING)
    (1792, 1792)
    >>> bytes_sent(1024, 8, DOUBLING)
    3072
    """
    _check_world(world)
    if algorithm == "ring":
        return 2 * (world - 1) * nbytes // world
    q = core_size(world)
    fold = nbytes if world > q else 0  # A core replica that also sends the result back.
    if algorithm == DOUBLING:
        return fold + nbytes * (q.bit_length() - 1)
    _check(0, world, algorithm)
    return fold + 2 * (q - 1) * (-(-nbytes // q))


def sequential_steps(world, algorithm):
    """Exchanges one after another in one all-reduce (its latency in messages).

    >>> sequential_steps(8, "ring"), sequential_steps(8, HALVING_DOUBLING), \
sequential_steps(8, DOUBLING)
    (14, 6, 3)
    """
    _check_world(world)
    if algorithm == "ring":
        return 2 * (world - 1)
    q = core_size(world)
    fold = 2 if world > q else 0
    log_q = q.bit_length() - 1
    return fold + (log_q if algorithm == DOUBLING else 2 * log_q)
