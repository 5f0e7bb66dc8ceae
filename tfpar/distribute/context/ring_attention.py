"""Ring attention (context parallelism): dot-product attention with the sequence split over
C devices, the keys and values passed round the ring, an online softmax (the plan:
`tfpar.plan.context_parallel`).

Each device keeps its two chunks of queries (an early and a late one, for causal load
balancing) and, at each of the C steps, computes their attention to the keys and values it
holds, then hands those to the next device. The softmax is accumulated online (a running
maximum, denominator and weighted sum per query), so no device ever holds the whole sequence's
scores: its scores are one chunk of queries against one chunk of keys at a time. Gradients
come from TensorFlow's autodiff through the ring (each op on its device). Equal to attention
on one device (`tests/distribute/context/test_ring_attention.py`).

Not yet: a recomputing backward (the forward's blocks are kept for the gradient), attention
layers rewired to it, and rings across processes.
"""

import tensorflow as tf

from tfpar.plan import context_parallel as plan

# Masked scores: a large finite negative (not -inf, whose differences are NaN), and each
# masked probability zeroed outright, so a block with no visible key adds nothing.
_MASKED = -1e30


def _chunk(x, index, size):
    return x[:, index * size:(index + 1) * size]


def _block(q, k, v, keep, scale, state):
    """One block of the online softmax: queries `q` [b, sq, h, d] against keys `k` and
    values `v` [b, sk, h, d], `keep` [b or 1, 1, sq, sk] (1 where a key is visible);
    `state` (maximum, denominator, weighted sum) updated."""
    maximum, denominator, total = state
    scores = tf.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = tf.where(keep > 0, scores, _MASKED)
    new_maximum = tf.maximum(maximum, tf.reduce_max(scores, axis=-1, keepdims=True))
    probabilities = tf.exp(scores - new_maximum) * keep
    correction = tf.exp(maximum - new_maximum)
    denominator = denominator * correction + tf.reduce_sum(probabilities, -1, keepdims=True)
    total = total * correction + tf.einsum("bhqk,bkhd->bhqd", probabilities, v)
    return new_maximum, denominator, total


def ring_attention(query, key, value, devices, causal=False, key_mask=None, scale=None):
    """Attention of `query` to `key`/`value` ([batch, sequence, heads, head dim] each), the
    sequence split over `devices` as `tfpar.plan.context_parallel` plans it: the output
    [batch, sequence, heads, head dim] in sequence order.

    `causal`: each position attends to itself and the positions before it. `key_mask`
    [batch, sequence] (bool): the keys that may be attended to (padding: False); it travels
    with its keys. `scale`: the scores' factor (default 1/sqrt(head dim)). Every query must
    see at least one key.
    """
    devices = list(devices)
    c = len(devices)
    length = query.shape[1]
    plan.check(length, c)
    size = length // (2 * c)
    scale = (1.0 / float(query.shape[-1]) ** 0.5) if scale is None else scale
    dtype = query.dtype
    ones = tf.ones([query.shape[0] if key_mask is not None else 1, length], dtype)
    mask = ones if key_mask is None else tf.cast(key_mask, dtype)
    # Each device's queries and (at first) keys, values and key mask: its two chunks.
    mine, held = [], []
    for d, device in enumerate(devices):
        chunks = plan.chunks_of(d, c)
        with tf.device(device):
            mine.append([(a, _chunk(query, a, size)) for a in chunks])
            held.append([(b, _chunk(key, b, size), _chunk(value, b, size),
                          _chunk(mask, b, size)) for b in chunks])
    states = []
    for d, device in enumerate(devices):
        with tf.device(device):
            states.append([
                (tf.fill([query.shape[0], query.shape[2], size, 1], tf.cast(_MASKED, dtype)),
                 tf.zeros([query.shape[0], query.shape[2], size, 1], dtype),
                 tf.zeros([query.shape[0], query.shape[2], size, query.shape[3]], dtype))
                for _ in mine[d]])
    diagonal = tf.linalg.band_part(tf.ones([size, size], dtype), -1, 0)
    for step in range(c):
        for d, device in enumerate(devices):
            with tf.device(device):
                for i, (a, q) in enumerate(mine[d]):
                    for b, k, v, m in held[d]:
                        kind = plan.block(a, b, causal)
                        if kind == plan.SKIP:
                            continue
                        keep = m[:, None, None, :]
                        if kind == plan.DIAGONAL:
                            keep = keep * diagonal[None, None]
                        states[d][i] = _block(q, k, v, keep, scale, states[d][i])
        if step < c - 1:  # Each device hands what it holds to the next.
            passed = []
            for d in range(c):
                source = held[(d - 1) % c]
                with tf.device(devices[d]):
                    passed.append([tuple(tf.identity(t) if not isinstance(t, int) else t
                                         for t in item) for item in source])
            held = passed
    outputs = [None] * (2 * c)
    for d, device in enumerate(devices):
        with tf.device(device):
            for (a, _), (_, denominator, total) in zip(mine[d], states[d]):
                outputs[a] = tf.transpose(total / denominator, [0, 2, 1, 3])
    return tf.concat(outputs, axis=1)
