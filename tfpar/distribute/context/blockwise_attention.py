"""Attention over blocks of keys with a recomputing backward (FlashAttention's order of work,
in TensorFlow ops): what lets a context-parallel replica attend its L/C queries to the whole
sequence's L keys without keeping the L/C x L scores.

The forward pass walks the keys in blocks with an online softmax (a running maximum,
denominator and weighted sum per query) and keeps only the output and each query's maximum
and denominator; the backward pass recomputes each block's probabilities from those. The
blocks are the iterations of a loop, one at a time. A replica's
attention then holds its queries, the gathered keys and values, the mask, and one block of
scores at a time (scores O(L/C x block) per head, not O(L/C x L)).

Equal to Keras' softmax attention up to rounding, in both of Keras' masked semantics:
`masked_rows="zero"` (Keras' `Softmax` layer: a masked probability is zero, a query that
sees no key outputs zeros) and `masked_rows="uniform"` (`keras.ops.dot_product_attention`
on TensorFlow: masked scores set to a large negative, so a query that sees no key averages
every value). In both, a masked score passes no gradient.
"""

import tensorflow as tf

# Keras' large negatives: the `Softmax` layer's -1e9; TensorFlow's dot_product_attention's
# -0.7 x the float32 maximum. Any value that makes exp() underflow to 0 for a visible row
# gives the same numbers; a row with no visible key is handled by `masked_rows`.
_MASKED = -1e9


def attention(query, key, value, mask=None, scale=1.0, block=512, masked_rows="zero",
              keep=None):
    """softmax(scale * q k^T, masked) v over blocks of `block` keys.

    query: [batch, queries, heads, depth]; key: [batch, keys, heads, depth]; value: [batch,
    keys, heads, value_depth]; mask: None or bool [batch or 1, queries, keys] (True: the
    query sees the key); or, in its place, `keep(start, end)`: the mask's keys start:end
    (tensors), made when a block needs them (a causal or padding mask is never whole).
    Returns [batch, queries, heads, value_depth] in query's dtype; scores, softmax and sums
    in float32.

    The blocks are the iterations of a `tf.while_loop` (one at a time), forward and
    backward: the traced step is the same size whatever the number of keys. (Unrolled, a
    step of 24,576 positions held ~1 GiB of graph outside TensorFlow's allocator: the
    longest trainable sequence stopped growing with C.)
    """
    if masked_rows not in ("zero", "uniform"):
        raise ValueError(f"masked_rows is 'zero' or 'uniform'; got {masked_rows!r}")
    if mask is not None and keep is not None:
        raise ValueError("Pass a mask or a function that makes its blocks (keep), not both.")
    keys = key.shape[1]
    if keys is None:
        raise ValueError(f"Blockwise attention needs a static number of keys; got key of "
                         f"shape {key.shape}.")
    block = min(block, keys)
    blocks = -(-keys // block)
    padded = blocks * block - keys  # Keys past the end of the last block: masked.
    dtype = query.dtype
    if mask is not None:
        mask = tf.cast(mask, tf.bool)
        keep = lambda start, end: mask[..., start:end]  # noqa: E731
    has_mask = keep is not None

    def visible_in(i):
        if not has_mask:
            return None
        start = i * block
        end = tf.minimum(start + block, keys)
        visible = keep(start, end)
        # The last block's keys past the end: not seen.
        return tf.pad(visible, [[0, 0], [0, 0], [0, start + block - end]]) if padded else visible

    def scores_of(q, k_block, visible, i):
        scores = tf.einsum("bqhd,bkhd->bhqk", q, k_block) * scale
        if has_mask:
            scores = tf.where(visible[:, None], scores, _MASKED)
        if padded:  # Past the last key: no weight even in a row that sees no key.
            real = tf.range(i * block, (i + 1) * block) < keys
            scores = tf.where(real, scores, float("-inf"))
        return scores

    def block_of(x, i):
        return tf.slice(x, [0, i * block, 0, 0], [-1, block, -1, -1])

    def loop(body, state):
        # One block at a time (parallel_iterations=1): its scores are all a replica holds.
        return tf.while_loop(lambda i, *_: i < blocks, body, (tf.constant(0), *state),
                             parallel_iterations=1)[1:]

    @tf.custom_gradient
    def run(query, key, value):
        q, k, v = (tf.cast(t, tf.float32) for t in (query, key, value))
        if padded:
            k, v = (tf.pad(t, [[0, 0], [0, padded], [0, 0], [0, 0]]) for t in (k, v))
        batch, queries, heads = tf.shape(q)[0], tf.shape(q)[1], tf.shape(q)[2]
        rows = tf.stack([batch, heads, queries])
        sees = (tf.zeros_like(tf.reduce_any(visible_in(0), axis=-1))
                if has_mask and masked_rows == "zero" else tf.zeros([0, 0], tf.bool))

        def forward(i, maximum, denominator, total, sees):
            visible = visible_in(i)
            scores = scores_of(q, block_of(k, i), visible, i)
            if has_mask and masked_rows == "zero":
                sees = tf.logical_or(sees, tf.reduce_any(visible, axis=-1))
            new_maximum = tf.maximum(maximum, tf.reduce_max(scores, axis=-1))
            probabilities = tf.exp(scores - new_maximum[..., None])
            correction = tf.exp(maximum - new_maximum)  # (0 at the first block: -inf.)
            denominator = denominator * correction + tf.reduce_sum(probabilities, axis=-1)
            total = (total * correction[..., None]
                     + tf.einsum("bhqk,bkhd->bhqd", probabilities, block_of(v, i)))
            return i + 1, new_maximum, denominator, total, sees

        maximum, denominator, total, sees = loop(forward, (
            tf.fill(rows, float("-inf")), tf.zeros(rows),
            tf.zeros(tf.concat([rows, tf.shape(v)[3:]], 0)), sees))
        out = total / denominator[..., None]  # [b, h, q, d]
        # (Kept apart, not as a log-sum-exp: next to a masked row's -1e9, a log of the
        # denominator would round away.)
        if has_mask and masked_rows == "zero":  # [b or 1, 1, q]: the query sees a key.
            sees = sees[:, None]
            out = tf.where(sees[..., None], out, 0.0)

        def gradient(upstream):
            d_out = tf.transpose(tf.cast(upstream, tf.float32), [0, 2, 1, 3])
            delta = tf.reduce_sum(d_out * out, axis=-1)  # [b, h, q]

            def backward(i, d_q, d_k, d_v):
                k_block, v_block = block_of(k, i), block_of(v, i)
                visible = visible_in(i)
                scores = scores_of(q, k_block, visible, i)
                d_p = tf.einsum("bhqd,bkhd->bhqk", d_out, v_block)
                probabilities = tf.exp(scores - maximum[..., None]) / denominator[..., None]
                if has_mask and masked_rows == "zero":  # (A row that sees no key: zeros.)
                    probabilities = tf.where(sees[..., None], probabilities, 0.0)
                d_v = d_v.write(i, tf.einsum("bhqk,bhqd->bkhd", probabilities, d_out))
                d_scores = probabilities * (d_p - delta[..., None])
                if has_mask:  # A masked score passes no gradient.
                    d_scores = tf.where(visible[:, None], d_scores, 0.0)
                d_scores = d_scores * scale
                d_q += tf.einsum("bhqk,bkhd->bqhd", d_scores, k_block)
                d_k = d_k.write(i, tf.einsum("bhqk,bqhd->bkhd", d_scores, q))
                return i + 1, d_q, d_k, d_v

            d_q, d_k, d_v = loop(backward, (
                tf.zeros_like(q), tf.TensorArray(tf.float32, blocks),
                tf.TensorArray(tf.float32, blocks)))
            d_k, d_v = (_joined(t.stack())[:, :keys] for t in (d_k, d_v))
            return (tf.cast(d_q, query.dtype), tf.cast(d_k, key.dtype),
                    tf.cast(d_v, value.dtype))

        return tf.cast(tf.transpose(out, [0, 2, 1, 3]), dtype), gradient

    return run(query, key, value)


def _joined(blocks):
    """[blocks, batch, block, heads, depth] -> [batch, blocks x block, heads, depth]."""
    shape = tf.shape(blocks)
    joined = tf.transpose(blocks, [1, 0, 2, 3, 4])
    return tf.reshape(joined, tf.concat([shape[1:2], [shape[0] * shape[2]], shape[3:]], 0))
