"""Context parallelism's plan (plain Python): which part of a sequence each of C devices
holds, and which blocks of attention each computes as keys and values go round the ring.

A sequence of length N is cut into 2C equal chunks; device d holds chunks d and 2C-1-d (its
queries, and at first its keys and values). Under a causal mask a query attends to keys at
or before it, so chunk a needs chunks b <= a; pairing an early chunk with a late one gives
every device the same work (Megatron-Core's and Llama 3's load balancing), where contiguous
halves would leave device 0 with one block and device C-1 with C. Without a causal mask the
chunks are the sequence in order, two per device alike.

At ring step s (0 .. C-1) device d holds the keys and values of device (d - s) mod C and
computes, for each pair (its query chunk a, the held key chunk b), one of:
"full" (b before a, or no causal mask), "diagonal" (b == a: causal within the chunk) or
"skip" (b after a).

    >>> chunks_of(0, 2), chunks_of(1, 2)
    ((0, 3), (1, 2))
    >>> [block(a, b) for a, b in ((3, 1), (1, 1), (1, 3))]
    ['full', 'diagonal', 'skip']
"""

FULL, DIAGONAL, SKIP = "full", "diagonal", "skip"


def check(sequence_length, devices):
    """Validates a split of `sequence_length` positions over `devices` devices."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"context parallelism needs a number of devices >= 1. Received: "
                         f"{devices!r}")
    if sequence_length % (2 * devices):
        raise ValueError(
            f"A sequence of {sequence_length} positions does not split into 2 x {devices} = "
            f"{2 * devices} equal chunks (two per device, for causal load balancing): pad "
            f"the sequence to a multiple of {2 * devices}.")


def chunks_of(device, devices):
    """The two chunks (of 2 x `devices`) that `device` holds: one early, one late."""
    return device, 2 * devices - 1 - device


def block(query_chunk, key_chunk, causal=True):
    """What a query chunk computes against a key chunk: FULL, DIAGONAL or SKIP."""
    if not causal or key_chunk < query_chunk:
        return FULL
    return DIAGONAL if key_chunk == query_chunk else SKIP


def holder_at(device, step, devices):
    """Whose keys and values `device` holds at ring step `step`."""
    return (device - step) % devices


def blocks_computed(device, devices, causal=True):
    """How many (query chunk, key chunk) blocks `device` computes over the whole ring
    (a diagonal counts as half).

    >>> [blocks_computed(d, 4) for d in range(4)]
    [8.0, 8.0, 8.0, 8.0]
    """
    total = 0.0
    for step in range(devices):
        for a in chunks_of(device, devices):
            for b in chunks_of(holder_at(device, step, devices), devices):
                kind = block(a, b, causal)
                total += {FULL: 1.0, DIAGONAL: 0.5, SKIP: 0.0}[kind]
    return total


def ring_bytes(key_value_bytes, devices):
    """Bytes one device sends to sum attention over the ring: its held keys and values
    (`key_value_bytes` for its share of the sequence) passed on C - 1 times.

    >>> ring_bytes(1000, 4)
    3000
    """
    return (devices - 1) * key_value_bytes


def positions_of(device, devices, length):
    """The sequence positions (of `length`) that `device` holds, in its order: its early
    chunk, then its late one.

    >>> positions_of(0, 2, 8), positions_of(1, 2, 8)
    ([0, 1, 6, 7], [2, 3, 4, 5])
    """
    size = length // (2 * devices)
    return [chunk * size + i for chunk in chunks_of(device, devices) for i in range(size)]


def global_order(devices, length):
    """Where each position of the sequence is among the devices' parts laid end to end
    (device 0's part, then device 1's, ...): index i of the result is the place of
    position i, so gathering the concatenated parts at these places restores the order.

    >>> global_order(2, 8)
    [0, 1, 4, 5, 6, 7, 2, 3]
    """
    held = [p for device in range(devices) for p in positions_of(device, devices, length)]
    place = {position: index for index, position in enumerate(held)}
    return [place[position] for position in range(length)]
