"""Gradient compression (`DataParallelStrategy(compression=...)`): the replicas' gradients
summed in float16 or bfloat16, against a one-device emulation of the same rounding."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar

BATCH, REPLICAS = 16, 2
WIRE = {"fp16": tf.float16, "bf16": tf.bfloat16}


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    # One replica's half of every batch has inputs 300x larger: its gradients are too.
    x[np.arange(64) % BATCH >= BATCH // REPLICAS] *= 300.0
    return x, (np.arange(64) % 3).astype("int32")


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(3)])
    model.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _emulated(compression):
    """One device: each step's gradient is the sum of the replicas' (each half of the
    batch, normalized by the global batch), each cast to the wire type (float16: divided
    by the replicas first), summed in it and cast back."""
    model = _model()
    x, y = _data()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    for start in range(0, len(x), BATCH):
        parts = []
        for r in range(REPLICAS):
            rows = slice(start + r * BATCH // REPLICAS, start + (r + 1) * BATCH // REPLICAS)
            with tf.GradientTape() as tape:
                loss = loss_fn(y[rows], model(x[rows], training=True)) / BATCH
            grads = tape.gradient(loss, model.trainable_variables)
            if compression is None:
                parts.append(grads)
                continue
            scale = 1.0 / REPLICAS if compression == "fp16" else 1.0
            parts.append([tf.cast(g * scale, WIRE[compression]) for g in grads])
        summed = [tf.add_n(list(g)) for g in zip(*parts)]
        if compression is not None:
            summed = [tf.cast(g, tf.float32) / scale for g in summed]
        model.optimizer.apply(summed, model.trainable_variables)
    return model.get_weights()


def _difference(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a, b))


def _mean_difference(a, b):
    return float(np.mean(np.concatenate([np.abs(u - v).ravel() for u, v in zip(a, b)])))


@pytest.mark.parametrize("compression, shard", [("fp16", None), ("bf16", None),
                                                ("fp16", "optimizer"), ("bf16", "gradients")])
def test_replicas_sum_in_the_wire_type_as_the_emulation_does(compression, shard):
    """Also under ZeRO-1/2, whose gradient sums are its own collectives (each summed on its
    owner): the same rounding."""
    strategy = tfpar.DataParallelStrategy(["/cpu:0", "/cpu:1"], compression=compression,
                                          shard=shard)
    assert strategy.compression == compression and compression in repr(strategy)
    model = _trained_as_emulated(strategy, compression)
    # What the replicas sum is in the wire type: half the bytes of float32 (a custom
    # loop's step, traced: the strategy's sums of the gradients).
    assert _summed_types(strategy, model) == {WIRE[compression]}


@pytest.mark.parametrize("compression, shard", [("bf16", None), ("fp16", "optimizer")])
def test_pipeline_replicas_sum_each_stage_in_the_wire_type(compression, shard):
    """R=2 pipeline replicas of 2 stages: each stage's gradients summed over its copies in
    the wire type, the same rounding as two data-parallel replicas (a pipeline's replica
    gradients are one device's on its half of the batch)."""
    from conftest import cpus

    strategy = tfpar.PipelineStrategy(cpus(4), num_replicas=2, num_stages=2,
                                      num_micro_batches=2, compression=compression,
                                      shard=shard)
    assert f"compression={compression!r}" in repr(strategy)
    _trained_as_emulated(strategy, compression)


def _trained_as_emulated(strategy, compression):
    """The model after one epoch under `strategy`, checked against the emulation."""
    with strategy.scope():
        model = _model()
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    got = model.get_weights()
    emulated, exact = _emulated(compression), _emulated(None)
    # The rounding is the emulation's (identical on TensorFlow 2.21; on 2.19 a float32
    # difference in a replica's gradient moved a few float16 roundings by one step: 4e-6 at
    # most, 4e-8 on average), and every weight's differs from full precision's.
    assert _difference(got, emulated) < 1e-5, _difference(got, emulated)
    assert _mean_difference(got, exact) > 10 * max(_mean_difference(got, emulated), 1e-9), (
        _mean_difference(got, exact), _mean_difference(got, emulated))
    return model


def _summed_types(strategy, model):
    """The types of what the replicas' gradients are summed as in a traced training step."""
    x, y = _data()

    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(replica, (x, y))

    graph = step.get_concrete_function(x[:BATCH], y[:BATCH]).graph
    return {op.outputs[0].dtype for op in graph.get_operations()
            if op.type in ("AddN", "CollectiveReduceV2", "NcclAllReduce")
            and op.outputs[0].shape.rank}


def test_without_compression_nothing_changes():
    strategy = tfpar.DataParallelStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = _model()
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert strategy.compression is None
    assert _difference(model.get_weights(), _emulated(None)) < 1e-5
    assert _summed_types(strategy, model) == {tf.float32}


@pytest.mark.parametrize("kwargs, message", [
    ({"compression": "int8"}, "compression must be 'fp16', 'bf16' or None"),
    ({"compression": "fp16", "shard": "parameters"}, "not supported yet: ZeRO-3"),
])
def test_unsupported_compression_is_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tfpar.DataParallelStrategy(["/cpu:0", "/cpu:1"], **kwargs)


def test_the_training_binary_passes_compression_to_the_data_strategy_only():
    from tfpar.cli import factory

    assert factory.make_strategy("data", 4, compression="bf16").compression == "bf16"
    with pytest.raises(ValueError, match="compression='fp16' is for the data strategy"):
        factory.make_strategy("model", 4, compression="fp16")
