"""Ring attention (context parallelism): the plan (pure Python) and attention with the
sequence split over logical CPUs, equal to attention on one device (outputs and gradients)."""

import doctest

import numpy as np
import pytest
import tensorflow as tf
from conftest import cpus

from tfpar.distribute.context.ring_attention import ring_attention
from tfpar.plan import context_parallel as plan


def _attention(q, k, v, causal, key_mask):
    """Attention on one device, written plainly."""
    scores = tf.einsum("bqhd,bkhd->bhqk", q, k) / float(q.shape[-1]) ** 0.5
    keep = tf.ones_like(scores, tf.bool)
    if causal:
        keep &= tf.cast(tf.linalg.band_part(tf.ones(scores.shape[-2:]), -1, 0), tf.bool)
    if key_mask is not None:
        keep &= key_mask[:, None, None, :]
    scores = tf.where(keep, scores, -1e9)
    return tf.einsum("bhqk,bkhd->bqhd", tf.nn.softmax(scores, -1), v)


def _inputs(length, seed=0):
    rng = np.random.default_rng(seed)
    return [tf.constant(rng.standard_normal((2, length, 3, 4)), tf.float32) for _ in range(3)]


@pytest.mark.parametrize("c, causal, padded", [(2, True, False), (4, True, True),
                                               (2, False, True), (3, True, False)])
def test_ring_attention_equals_one_device_in_outputs_and_gradients(c, causal, padded):
    length = 4 * c  # Two chunks of 2 per device.
    q, k, v = _inputs(length)
    key_mask = None
    if padded:  # The second example's last 3 positions are padding.
        key_mask = tf.constant([[True] * length, [True] * (length - 3) + [False] * 3])
    upstream = tf.constant(np.random.default_rng(1).standard_normal(q.shape), tf.float32)
    results = []
    for run in (lambda: _attention(q, k, v, causal, key_mask),
                lambda: ring_attention(q, k, v, cpus(c), causal=causal, key_mask=key_mask)):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = run()
        results.append([out] + tape.gradient(out, [q, k, v], output_gradients=upstream))
    for want, got, name in zip(*results, ("output", "dq", "dk", "dv")):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, err_msg=name)
    assert float(tf.reduce_max(tf.abs(results[0][3]))) > 1e-3  # The gradients are not nil.


def test_each_device_computes_on_its_own_chunks_and_hands_its_keys_on():
    """Traced: every score block (an einsum of queries and keys) runs on the device of its
    queries, each device computes as many (a balanced causal split), and each hands keys and
    values to the next one C-1 times."""
    c = 4
    q, k, v = _inputs(4 * c)

    @tf.function
    def attend(q, k, v):
        return ring_attention(q, k, v, cpus(c), causal=True)

    graph = attend.get_concrete_function(q, k, v).graph
    scores = [op for op in graph.get_operations()
              if op.type == "Einsum" and "bqhd,bkhd" in op.get_attr("equation").decode()]
    per_device = {}
    for op in scores:
        per_device[op.device] = per_device.get(op.device, 0) + 1
    assert len(per_device) == c
    # 2 query chunks x 2 key chunks x C steps, causal: every device the same count.
    assert len(set(per_device.values())) == 1, per_device
    assert sum(per_device.values()) == sum(
        sum(1 for a in plan.chunks_of(d, c) for step in range(c)
            for b in plan.chunks_of(plan.holder_at(d, step, c), c)
            if plan.block(a, b) != plan.SKIP) for d in range(c))


def test_the_plan_balances_causal_work_and_refuses_what_does_not_split():
    for c in (1, 2, 3, 4, 8):
        work = [plan.blocks_computed(d, c) for d in range(c)]
        assert len(set(work)) == 1, (c, work)  # Balanced: contiguous halves would not be.
        assert sum(work) == pytest.approx((2 * c) ** 2 / 2)  # Half of all blocks: causal.
    with pytest.raises(ValueError, match="pad the sequence to a multiple of 6"):
        plan.check(10, 3)
    with pytest.raises(ValueError, match="number of devices >= 1"):
        plan.check(8, 0)
    assert doctest.testmod(plan).failed == 0
