"""Blockwise attention with a recomputing backward (context parallelism's attention core):
equal to softmax attention as Keras computes it, in both of Keras' masked semantics, for
any block size; its backward keeps no block of scores from the forward."""

import numpy as np
import pytest
import tensorflow as tf

from tfpar.distribute.context import blockwise_attention

from conftest import graph_operations as operations

SCALE = 0.5


def _keras_attention(q, k, v, mask, masked_rows):
    """Keras' two paths: its `Softmax` layer (masked probabilities zero, so a row that sees
    no key gives zeros) and TensorFlow's `dot_product_attention` (masked scores set to a large
    negative: such a row averages every value)."""
    scores = tf.einsum("bqhd,bkhd->bhqk", q, k) * SCALE
    if mask is not None:
        scores = tf.where(mask[:, None], scores,
                          -1e9 if masked_rows == "zero" else -0.7 * 3.38953e38)
    probabilities = tf.nn.softmax(scores, axis=-1)
    if mask is not None and masked_rows == "zero":
        probabilities = tf.where(mask[:, None], probabilities, 0.0)
    return tf.einsum("bhqk,bkhd->bqhd", probabilities, v)


def _inputs():
    rng = np.random.default_rng(0)
    batch, queries, keys, heads, depth = 2, 6, 11, 3, 4
    q, k = (tf.constant(rng.normal(size=(batch, n, heads, depth)), tf.float32)
            for n in (queries, keys))
    v = tf.constant(rng.normal(size=(batch, keys, heads, depth + 1)), tf.float32)
    upstream = tf.constant(rng.normal(size=(batch, queries, heads, depth + 1)), tf.float32)
    mask = rng.random((batch, queries, keys)) > 0.4
    mask[0, 2] = False  # A query that sees no key.
    return q, k, v, upstream, tf.constant(mask)


def _value_and_gradients(attention, q, k, v, upstream):
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        out = attention(q, k, v)
        loss = tf.reduce_sum(out * upstream)
    return [out] + tape.gradient(loss, [q, k, v])


@pytest.mark.parametrize("masked_rows", ["zero", "uniform"])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("block", [3, 4, 11, 64])
def test_equal_to_keras_softmax_attention_and_its_gradients(masked_rows, masked, block):
    q, k, v, upstream, mask = _inputs()
    mask = mask if masked else None
    want = _value_and_gradients(lambda *t: _keras_attention(*t, mask, masked_rows),
                                q, k, v, upstream)
    got = _value_and_gradients(
        lambda *t: blockwise_attention.attention(*t, mask, SCALE, block, masked_rows),
        q, k, v, upstream)
    for name, g, w in zip(("output", "query", "key", "value"), got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), atol=2e-6, err_msg=name)
    if masked:  # The row that sees no key: zeros, or the mean of the values.
        row = got[0][0, 2].numpy()
        expected = 0.0 if masked_rows == "zero" else v[0].numpy().mean(axis=0)
        np.testing.assert_allclose(row, np.broadcast_to(expected, row.shape), atol=1e-6)


def test_the_traced_step_keeps_no_whole_score_matrix():
    """Traced forward and backward: every score-shaped tensor ([batch, heads, queries, x])
    is one block of keys wide (4: the last block's 3 keys padded) or the values' depth (5),
    never all 11; each block is an iteration of a loop (the step's size does not grow with
    the keys)."""
    q, k, v, upstream, mask = _inputs()

    @tf.function
    def step(q, k, v):
        return _value_and_gradients(
            lambda *t: blockwise_attention.attention(*t, mask, SCALE, 4, "zero"),
            q, k, v, upstream)

    graph = step.get_concrete_function(q, k, v).graph
    widths = {op.outputs[0].shape[-1] for op in operations(graph)
              if op.type in ("Exp", "Einsum", "Mul") and op.outputs
              and op.outputs[0].shape.rank == 4 and op.outputs[0].shape[1] == 3
              and op.outputs[0].shape[2] == 6}  # [batch, heads, queries, keys]
    assert widths == {4, 5}, widths
    loops = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]
    assert len(loops) == 2  # Forward and backward.


def test_bad_arguments_are_refused_clearly():
    q, k, v, _, _ = _inputs()
    with pytest.raises(ValueError, match="masked_rows is 'zero' or 'uniform'"):
        blockwise_attention.attention(q, k, v, masked_rows="ones")


@pytest.mark.parametrize("masked_rows", ["zero", "uniform"])
def test_a_mask_made_by_blocks_gives_what_the_whole_mask_gives(masked_rows):
    q, k, v, upstream, mask = _inputs()
    whole = _value_and_gradients(
        lambda *t: blockwise_attention.attention(*t, mask, SCALE, 4, masked_rows), q, k, v,
        upstream)
    made = []
    by_blocks = _value_and_gradients(
        lambda *t: blockwise_attention.attention(
            *t, scale=SCALE, block=4, masked_rows=masked_rows,
            keep=lambda start, end: made.append((int(start), int(end)))
            or mask[..., start:end]),
        q, k, v, upstream)
    for g, w in zip(by_blocks, whole):
        np.testing.assert_array_equal(g.numpy(), w.numpy())
    assert sorted(set(made)) == [(0, 4), (4, 8), (8, 11)]
    with pytest.raises(ValueError, match="not both"):
        blockwise_attention.attention(q, k, v, mask, keep=lambda start, end: None)
