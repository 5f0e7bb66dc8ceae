"""Attention over blocks of keys with a recomputing backward (FlashAttention's order of work,
in TensorFlow ops): what lets a context-parallel replica attend its L/C queries to the whole
sequence's L keys without keeping the L/C x L scores.

The forward pass walks the keys in blocks with an online softmax (a running maximum,
denominator and weighted sum per query) and keeps only the output and each query's
log-sum-exp; the backward pass recomputes each block's probabilities from those. A replica's
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


def _after(*previous):
    """Ops made here wait for `previous` (every result of the last block): otherwise
    TensorFlow may run later blocks' scores first, or a block's sum last, holding many
    blocks at once (measured: a replica's peak grew as L^2/C)."""
    return tf.control_dependencies([p for p in previous if p is not None])


def attention(query, key, value, mask=None, scale=1.0, block=512, masked_rows="zero",
              keep=None):
    """softmax(scale * q k^T, masked) v over blocks of `block` keys.

    query: [batch, queries, heads, depth]; key: [batch, keys, heads, depth]; value: [batch,
    keys, heads, value_depth]; mask: None or bool [batch or 1, queries, keys] (True: the
    query sees the key); or, in its place, `keep(start, end)`: the mask's keys start:end,
    made when a block needs them (a causal or padding mask is never whole). Returns [batch,
    queries, heads, value_depth] in query's dtype; scores, softmax and sums in float32.
    """
    if masked_rows not in ("zero", "uniform"):
        raise ValueError(f"masked_rows is 'zero' or 'uniform'; got {masked_rows!r}")
    if mask is not None and keep is not None:
        raise ValueError("Pass a mask or a function that makes its blocks (keep), not both.")
    keys = key.shape[1]
    if keys is None:
        raise ValueError(f"Blockwise attention needs a static number of keys; got key of "
                         f"shape {key.shape}.")
    bounds = [(start, min(start + block, keys)) for start in range(0, keys, block)]
    dtype = query.dtype
    has_mask = mask is not None or keep is not None
    if mask is not None:
        mask = tf.cast(mask, tf.bool)
        keep = lambda start, end: mask[..., start:end]  # noqa: E731

    def scores_of(q, k, keep):
        scores = tf.einsum("bqhd,bkhd->bhqk", q, k) * scale
        if has_mask:
            scores = tf.where(keep[:, None], scores, _MASKED)
        return scores

    @tf.custom_gradient
    def run(query, key, value):
        q, k, v = (tf.cast(t, tf.float32) for t in (query, key, value))
        maximum = denominator = total = sees = None
        for start, end in bounds:
            with _after(total, denominator, maximum, sees):
                v_block = v[:, start:end]
                visible = keep(start, end) if has_mask else None
                scores = scores_of(q, k[:, start:end], visible)
            if visible is not None and masked_rows == "zero":
                row = tf.reduce_any(visible, axis=-1)
                sees = row if sees is None else tf.logical_or(sees, row)
            block_max = tf.reduce_max(scores, axis=-1)
            new_maximum = block_max if maximum is None else tf.maximum(maximum, block_max)
            probabilities = tf.exp(scores - new_maximum[..., None])
            part = tf.einsum("bhqk,bkhd->bhqd", probabilities, v_block)
            sums = tf.reduce_sum(probabilities, axis=-1)
            if maximum is None:
                denominator, total = sums, part
            else:
                correction = tf.exp(maximum - new_maximum)
                denominator = denominator * correction + sums
                total = total * correction[..., None] + part
            maximum = new_maximum
        out = total / denominator[..., None]  # [b, h, q, d]
        # (Kept apart, not as a log-sum-exp: next to a masked row's -1e9, a log of the
        # denominator would round away.)
        if sees is not None:  # [b or 1, 1, q]: whether the query sees any key.
            sees = sees[:, None]
            out = tf.where(sees[..., None], out, 0.0)

        def gradient(upstream):
            d_out = tf.transpose(tf.cast(upstream, tf.float32), [0, 2, 1, 3])
            delta = tf.reduce_sum(d_out * out, axis=-1)  # [b, h, q]
            d_q = tf.zeros_like(q)
            d_k, d_v = [], []
            for start, end in bounds:
                with _after(d_q, *(d_k[-1:] + d_v[-1:])):
                    k_block, v_block = k[:, start:end], v[:, start:end]
                    visible = keep(start, end) if has_mask else None
                    scores = scores_of(q, k_block, visible)
                    d_p = tf.einsum("bhqd,bkhd->bhqk", d_out, v_block)
                probabilities = tf.exp(scores - maximum[..., None]) / denominator[..., None]
                if sees is not None:  # (A row that sees no key gave zeros.)
                    probabilities = tf.where(sees[..., None], probabilities, 0.0)
                d_v.append(tf.einsum("bhqk,bhqd->bkhd", probabilities, d_out))
                d_scores = probabilities * (d_p - delta[..., None])
                if has_mask:  # A masked score passes no gradient.
                    d_scores = tf.where(visible[:, None], d_scores, 0.0)
                d_scores = d_scores * scale
                d_q += tf.einsum("bhqk,bkhd->bqhd", d_scores, k_block)
                d_k.append(tf.einsum("bhqk,bqhd->bkhd", d_scores, q))
            return (tf.cast(d_q, query.dtype), tf.cast(tf.concat(d_k, 1), key.dtype),
                    tf.cast(tf.concat(d_v, 1), value.dtype))

        return tf.cast(tf.transpose(out, [0, 2, 1, 3]), dtype), gradient

    return run(query, key, value)
