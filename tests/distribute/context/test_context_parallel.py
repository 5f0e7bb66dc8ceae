"""Context parallelism (issue 37): `DataParallelStrategy(context_parallel=C)` splits every
sequence over C replicas (two of 2C chunks each), attention gathers the keys and values.
Equal to one device with padding and causal masks and an attention-mask input; the keras-hub
backbones are in tests/conformance/test_keras_hub_backbones.py, the conformance column
`cp3` in the Keras conformance table."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from conftest import cpus, gpt2_language_model, graph_operations
from tfpar.plan import context_parallel as plan

from multi_worker_common import SEQUENCE_BATCH as BATCH  # noqa: E402
from multi_worker_common import SEQUENCE_EXAMPLES as EXAMPLES  # noqa: E402
from multi_worker_common import SEQUENCE_LENGTH as LENGTH  # noqa: E402
from multi_worker_common import SEQUENCE_VOCABULARY as VOCABULARY  # noqa: E402
from multi_worker_common import causal_attention_model as _attention_model  # noqa: E402
from multi_worker_common import sequence_data as _tokens  # noqa: E402


def _fit(strategy, make, x, y):
    with strategy.scope() if strategy else tf.distribute.get_strategy().scope():
        model = make()
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return model, history.history


def test_each_replica_is_handed_its_two_chunks_of_every_sequence():
    strategy = tfpar.DataParallelStrategy(cpus(2), context_parallel=2)
    positions = np.tile(np.arange(LENGTH, dtype="int32"), (4, 1)) + 100 * np.arange(4)[:, None]
    weights = np.arange(4, dtype="float32")  # Per example: every replica has them all.
    dataset = tf.data.Dataset.from_tensor_slices((positions, weights)).batch(4)
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))
    for c, (got, got_weights) in enumerate(zip(
            *(strategy.experimental_local_results(t) for t in batch))):
        held = plan.positions_of(c, 2, LENGTH)  # [0, 1, 6, 7] and [2, 3, 4, 5]
        np.testing.assert_array_equal(got.numpy(), positions[:, held])
        np.testing.assert_array_equal(got_weights.numpy(), weights)


@pytest.mark.parametrize("devices", [2, 4])
def test_causal_attention_with_padding_trains_predicts_and_evaluates_as_one_device(devices):
    x, y = _tokens()
    want, want_history = _fit(None, _attention_model, x, y)
    strategy = tfpar.DataParallelStrategy(cpus(devices), context_parallel=devices)
    got, history = _fit(strategy, _attention_model, x, y)
    np.testing.assert_allclose(history["loss"], want_history["loss"], rtol=1e-5)
    np.testing.assert_allclose(history["accuracy"], want_history["accuracy"], rtol=1e-6)
    initial = _attention_model().get_weights()
    assert max(np.abs(w - w0).max() for w, w0 in zip(want.get_weights(), initial)) > 1e-2
    for g, w in zip(got.get_weights(), want.get_weights()):
        np.testing.assert_allclose(g, w, atol=1e-5)
    # Predictions whole and in order (each example's sequence put back together).
    np.testing.assert_allclose(got.predict(x, batch_size=BATCH, verbose=0),
                               want.predict(x, batch_size=BATCH, verbose=0), atol=1e-5)
    np.testing.assert_allclose(got.evaluate(x, y, batch_size=BATCH, verbose=0),
                               want.evaluate(x, y, batch_size=BATCH, verbose=0), rtol=1e-5)


def test_an_attention_mask_input_is_split_by_queries_and_keeps_every_key():
    x, y = _tokens(1)
    rng = np.random.default_rng(2)
    mask = (rng.uniform(size=(EXAMPLES, LENGTH, LENGTH)) > 0.3).astype("int32")
    mask[:, :, 0] = 1  # (Every query sees at least the first key.)
    inputs = {"ids": x, "attention_mask": mask}
    make = lambda: _attention_model(with_mask_input=True)  # noqa: E731
    want, _ = _fit(None, make, inputs, y)
    got, _ = _fit(tfpar.DataParallelStrategy(cpus(2), context_parallel=2), make, inputs, y)
    for g, w in zip(got.get_weights(), want.get_weights()):
        np.testing.assert_allclose(g, w, atol=1e-5)


def test_the_keys_and_values_are_gathered_and_the_scores_are_a_replicas_rows(monkeypatch):
    """Each replica's attention scores are its L/C queries against one block of the L keys at
    a time (blocks of L/2 here: a loop of two per replica, never the whole L/C x L), and the traced
    forward gathers keys and values from the replicas (the padding mask too)."""
    from tfpar.distribute.context import sequence_split

    monkeypatch.setattr(sequence_split, "ATTENTION_BLOCK", LENGTH // 2)
    x, _ = _tokens()
    strategy = tfpar.DataParallelStrategy(cpus(2), context_parallel=2)
    with strategy.scope():
        model = _attention_model()
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(x).batch(BATCH))))

    @tf.function
    def forward(batch):
        return strategy.run(lambda b: model(b, training=True), args=(batch,))

    operations = graph_operations(forward.get_concrete_function(batch).graph)
    ranks = [op.outputs[0].shape.rank for op in operations if op.type == "CollectiveGatherV2"]
    # Per replica: keys and values ([batch, positions, heads, depth]); in one process the
    # padding mask is put together in the graph.
    assert ranks.count(4) == 4, ranks
    # [heads, queries, keys] of a block's probabilities, in each replica's loop over blocks.
    scores = [op.outputs[0].shape.as_list()[1:] for op in operations
              if op.type == "Exp" and op.outputs[0].shape.rank == 4]
    assert scores == [[2, LENGTH // 2, LENGTH // 2]] * 2, scores
    assert not [op for op in operations if op.type == "Softmax"]


def test_models_and_settings_it_cannot_split_are_refused_before_the_first_step():
    x, y = _tokens()
    strategy = tfpar.DataParallelStrategy(cpus(2), context_parallel=2)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        ids = keras.Input((LENGTH,), dtype="int32")
        h = keras.layers.Embedding(VOCABULARY, 8)(ids)
        h = keras.layers.MultiHeadAttention(2, 4)(h, h)
        h = keras.layers.Conv1D(8, 3, padding="same", name="conv")(h)
        model = keras.Model(ids, keras.layers.Dense(VOCABULARY)(h))
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # (Keras 3.10 wraps it in a RuntimeError of its model build, the message inside.)
    with pytest.raises((ValueError, RuntimeError),
                       match=r"layer 'conv' \(Conv1D\) is not known to act on each position "
                             r"alone"):
        model.fit(x, y, batch_size=BATCH, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0
    odd = np.zeros((4, 6), "int32")  # 6 positions do not split into 2 x 2 chunks
    with pytest.raises(ValueError, match=r"its length 6 does not split into 2 x 2 = 4"):
        model.fit(odd, odd, batch_size=4, verbose=0)
    with pytest.raises(ValueError, match="must equal the number of replicas"):
        tfpar.DataParallelStrategy(cpus(4), context_parallel=2)
    with pytest.raises(ValueError, match="Drop sync_every=2"):
        tfpar.DataParallelStrategy(cpus(2), context_parallel=2, sync_every=2)
    with pytest.raises(ValueError, match="an int >= 1"):
        tfpar.DataParallelStrategy(cpus(2), context_parallel=0)
    with pytest.raises(ValueError, match="TensorFlow's collectives do"):
        tfpar.DataParallelStrategy(cpus(2), context_parallel=2, communication="reduce_to_one")


def test_gpus_gather_by_the_collectives_nccl_not_the_in_process_nccl_ops():
    # No GPU here: build (not run) the ops TensorFlow would use for two GPUs.
    from tensorflow.python.distribute import cross_device_ops, cross_device_utils

    from tfpar.distribute.common.cross_device import make_cross_device_ops

    gpus = ("/job:localhost/replica:0/task:0/device:GPU:0",
            "/job:localhost/replica:0/task:0/device:GPU:1")
    keys = cross_device_utils.CollectiveKeys()
    assert isinstance(make_cross_device_ops("nccl", gpus, keys), tf.distribute.NcclAllReduce)
    ops = make_cross_device_ops("nccl", gpus, keys, gathers=True)
    assert isinstance(ops, cross_device_ops.CollectiveAllReduce)
    assert ops._options.implementation == (  # noqa: SLF001
        tf.distribute.experimental.CommunicationImplementation.NCCL)


def test_keras_hubs_gpt2_with_left_padding_trains_as_one_device_on_4_replicas(monkeypatch):
    """keras-hub's decoder blocks (their self-attention mask made from the whole sequence's
    padding and the positions) and learned positions (the replica's own) at C=4; rows padded
    at the start, so every causal query sees padded keys unless the gathered mask hides them.
    The attention makes its mask by blocks (of 8 keys here): the whole one is never read."""
    from tfpar.distribute.context import sequence_split

    pytest.importorskip("keras_hub")
    length = 16
    monkeypatch.setattr(sequence_split, "ATTENTION_BLOCK", length // 2)

    def make():
        keras.utils.set_random_seed(0)
        model = gpt2_language_model(length, VOCABULARY)
        model.compile(keras.optimizers.SGD(0.5),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    rng = np.random.default_rng(3)
    padding = np.ones((EXAMPLES, length), "int32")
    padding[::2, :5] = 0
    x = {"token_ids": rng.integers(1, VOCABULARY, (EXAMPLES, length)).astype("int32") * padding,
         "padding_mask": padding}
    y = rng.integers(0, VOCABULARY, (EXAMPLES, length)).astype("int32")
    want, _ = _fit(None, make, x, y)
    strategy = tfpar.DataParallelStrategy(cpus(4), context_parallel=4)
    got, _ = _fit(strategy, make, x, y)
    for g, w, variable in zip(got.get_weights(), want.get_weights(), want.weights):
        np.testing.assert_allclose(g, w, atol=2e-5, err_msg=variable.path)
    # The decoders' masks over the whole sequence ([batch, L/C, L]) are made, as keras-hub's
    # code asks, but read by nothing: the attention makes its mask block by block.
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))))

    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                    y, got(x, training=True), from_logits=True))
            return tape.gradient(loss, got.trainable_variables)
        return strategy.run(replica, args=(x, y))

    operations = step.get_concrete_function(*batch).graph.get_operations()

    def whole(tensor):
        return tensor.shape.rank == 3 and tensor.shape[1:] == [length // 4, length] \
            and tensor.dtype in (tf.bool, tf.int32)

    made = [t for op in operations for t in op.outputs if whole(t)]
    read = [(t.name, c.type) for t in made for c in t.consumers()
            if not any(whole(o) for o in c.outputs)]
    assert made and not read, read


@pytest.mark.parametrize("shard", ["optimizer", "parameters"])
def test_with_zero_each_replica_keeps_its_share_and_trains_as_one_device(shard):
    """Context parallelism composes with ZeRO: the replicas that split the sequence also
    split the optimizer state (and under stage 3 the weights, read where a layer uses them)."""
    x, y = _tokens()
    want, _ = _fit(None, _attention_model, x, y)
    strategy = tfpar.DataParallelStrategy(cpus(2), context_parallel=2, shard=shard)
    got, _ = _fit(strategy, _attention_model, x, y)
    for g, w in zip(got.get_weights(), want.get_weights()):
        np.testing.assert_allclose(g, w, atol=1e-5)
    held = [d.optimizer for d in strategy.memory_report(got).devices]
    assert max(held) < 0.8 * sum(held), held


@pytest.mark.slow
def test_two_worker_processes_split_the_sequences_and_train_as_one_device(tmp_path):
    """Context parallelism across processes: each worker reads every batch and keeps its
    chunks, attention gathers keys and values by collectives between the processes; the
    weights, evaluation and predictions (put back together, in order) equal one device's."""
    import json
    import os
    import subprocess
    import sys

    worker = os.path.join(os.path.dirname(__file__), "..", "..", "workers",
                          "context_parallel.py")
    run = subprocess.run([sys.executable, "-m", "tfpar.cli.launch", "--workers=2",
                          "--timeout=200", "--", sys.executable, worker, f"--out={tmp_path}"],
                         capture_output=True, text=True, timeout=260,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    x, y = _tokens()
    want, history = _fit(None, _attention_model, x, y)
    predictions = want.predict(x, batch_size=BATCH, verbose=0)
    for index in (0, 1):
        result = json.loads((tmp_path / f"worker-{index}.json").read_text())
        assert result["strategy"] == ("DataParallelStrategy(workers=2, replicas=2, "
                                      "communication='ring', context_parallel=2)")
        np.testing.assert_allclose(result["loss"], history["loss"], rtol=1e-5)
        np.testing.assert_allclose(result["evaluated"],
                                   want.evaluate(x, y, batch_size=BATCH, verbose=0), rtol=1e-5)
        saved = list(np.load(tmp_path / f"worker-{index}.npz").values())
        for got, expected in zip(saved[:-1], want.get_weights()):
            np.testing.assert_allclose(got, expected, atol=1e-5)
        np.testing.assert_allclose(saved[-1], predictions, atol=1e-5)


@pytest.mark.slow
def test_the_long_context_example_trains_on_two_workers():
    """examples/long_context.py under `tfpar launch --workers 2`: each worker says what it
    trained and its peaks, and the loss fell below chance (it copies the repeated block)."""
    pytest.importorskip("keras_hub")  # (The example's decoder; the oldest pair has none.)
    import math
    import os
    import re
    import subprocess
    import sys

    example = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples",
                           "long_context.py")
    run = subprocess.run([sys.executable, "-m", "tfpar.cli.launch", "--workers=2",
                          "--timeout=200", "--", sys.executable, example, "--length=256",
                          "--steps=24", "--hidden=32"],
                         capture_output=True, text=True, timeout=260,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    lines = re.findall(r"context_parallel=2, worker (\d): 256 tokens per sequence, (\d+) "
                       r"tokens/s, loss ([\d.]+); allocator [\d.]+ MiB \(peak ([\d.]+) MiB\)",
                       run.stdout)
    assert sorted(int(w) for w, *_ in lines) == [0, 1], run.stdout[-3000:]
    for _, speed, loss, peak in lines:
        assert int(speed) > 0 and float(peak) > 0
        assert float(loss) < 0.9 * math.log(256), run.stdout[-3000:]  # chance: ln(256)


def test_a_keras_hub_encoder_with_a_padding_mask_trains_as_one_device():
    """keras-hub's TransformerEncoder (no causal mask) builds a padding mask over its own
    keys ([batch, 1, L/C]); its attention gathers it over the whole sequence."""
    keras_hub = pytest.importorskip("keras_hub")

    def make():
        keras.utils.set_random_seed(0)
        ids = keras.Input((LENGTH,), dtype="int32", name="ids")
        padding = keras.Input((LENGTH,), dtype="int32", name="padding")
        x = keras_hub.layers.TokenAndPositionEmbedding(VOCABULARY, LENGTH, 8)(ids)
        x = keras_hub.layers.TransformerEncoder(16, 2, dropout=0.0)(x, padding_mask=padding)
        model = keras.Model([ids, padding], keras.layers.Dense(VOCABULARY)(x))
        model.compile(keras.optimizers.SGD(0.5),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    x, y = _tokens(4)
    inputs = {"ids": x, "padding": (x != 0).astype("int32")}
    want, _ = _fit(None, make, inputs, y)
    got, _ = _fit(tfpar.DataParallelStrategy(cpus(2), context_parallel=2), make, inputs, y)
    for g, w in zip(got.get_weights(), want.get_weights()):
        np.testing.assert_allclose(g, w, atol=1e-5)


def test_a_bfloat16_gather_moves_the_same_bits_and_gives_the_float32_gradient():
    """TensorFlow's collective gather takes no bfloat16 (mixed_bfloat16 models failed at the
    first step): its bits travel as float16, unchanged, and its gradient is the float32
    gather's, cast."""
    from tfpar.distribute.context.sequence_split import SequenceShards

    strategy = tfpar.DataParallelStrategy(cpus(2), context_parallel=2)
    shards = SequenceShards(2)
    weights = tf.constant(np.arange(1, 9, dtype="float32").reshape(1, 8, 1) / 8)

    def step(dtype):
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        # Values bfloat16 holds exactly (including one float16 cannot: 2**20).
        part = tf.cast(tf.reshape(tf.range(8) + 10 * replica, (1, 4, 2)), tf.float32)
        part = tf.tensor_scatter_nd_update(part, [[0, 0, 0]], [2.0 ** 20])
        part = tf.cast(part, dtype)
        with tf.GradientTape() as tape:
            tape.watch(part)
            whole = shards.gather(part)
            loss = tf.reduce_sum(tf.cast(whole, tf.float32) * weights * (1.0 + tf.cast(
                replica, tf.float32)))
        return tf.cast(whole, tf.float32), tf.cast(tape.gradient(loss, part), tf.float32)

    got, want = (strategy.experimental_local_results(strategy.run(step, args=(dtype,)))
                 for dtype in (tf.bfloat16, tf.float32))
    assert got[0][0].dtype == tf.float32
    for (whole, gradient), (whole32, gradient32) in zip(got, want):
        np.testing.assert_array_equal(whole.numpy(), whole32.numpy())
        np.testing.assert_array_equal(gradient.numpy(), gradient32.numpy())
    assert float(np.abs(got[0][1].numpy()).max()) > 0


def _custom_loop(strategy, model, optimizer, x, y, weights):
    """TensorFlow's custom-loop guide's step: per-token losses (the padding weighted out)
    over the global batch, `apply_gradients` in `strategy.run`."""
    per_token = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(BATCH))

    def replica_step(x, y, w):
        with tf.GradientTape() as tape:
            losses = per_token(y, model(x, training=True), sample_weight=w)
            loss = tf.nn.compute_average_loss(losses, global_batch_size=BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(x, y, w):
        return strategy.reduce("SUM", strategy.run(replica_step, args=(x, y, w)), axis=None)

    return [float(step(*batch)) for _ in range(2) for batch in dataset]


@pytest.mark.parametrize("shard", [None, "parameters"])
def test_a_custom_loop_with_adamw_clipping_and_padding_trains_as_one_device(shard):
    """The recipe in a custom loop (AdamW with weight decay and a global_clipnorm the
    gradient exceeds, padding weighted out, sequences whose later chunks are mostly padding)
    at C=2, with ZeRO-3 too, equal to one device. The optimizer is built before the loop:
    built at its first apply_gradients, inside tf.function, TensorFlow fails (the
    conformance table's known gap)."""
    x, y = _tokens()
    weights = (x > 0).astype("float32")
    results = []
    for strategy in (tf.distribute.get_strategy(),
                     tfpar.DataParallelStrategy(cpus(2), context_parallel=2, shard=shard)):
        with strategy.scope():
            model = _attention_model()
            optimizer = keras.optimizers.AdamW(0.02, weight_decay=0.1, global_clipnorm=0.05)
            optimizer.build(model.trainable_variables)
        losses = _custom_loop(strategy, model, optimizer, x, y, weights)
        results.append((losses, [np.asarray(w) for w in model.get_weights()]))
    (want_losses, want), (got_losses, got) = results
    np.testing.assert_allclose(got_losses, want_losses, atol=1e-5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5)
    assert max(np.abs(w - w0).max() for w, w0 in zip(want, _attention_model().get_weights())) \
        > 1e-3


def test_llamas_grouped_key_value_heads_travel_once(monkeypatch):
    """Llama repeats its 2 key/value heads to its 4 query heads before attention: the
    replicas gather the 2 distinct heads (half the bytes) and repeat them after."""
    from tfpar.distribute.context import sequence_split

    keras_hub = pytest.importorskip("keras_hub")
    gathered = []
    gather = sequence_split.SequenceShards.gather
    monkeypatch.setattr(sequence_split.SequenceShards, "gather",
                        lambda self, x, axis=1: gathered.append(x.shape.as_list())
                        or gather(self, x, axis))
    strategy = tfpar.DataParallelStrategy(cpus(2), context_parallel=2)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=VOCABULARY, num_layers=1, num_query_heads=4,
            num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)
    x = {"token_ids": np.ones((2, LENGTH), "int32"), "padding_mask": np.ones((2, LENGTH), "int32")}
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(x).batch(2))))

    @tf.function
    def forward(batch):
        return strategy.run(lambda b: backbone(b, training=True), args=(batch,))

    forward.get_concrete_function(batch)
    heads = [shape[2] for shape in gathered if len(shape) == 4]
    assert heads == [2] * 4, gathered  # Keys and values, on each of the 2 replicas.


def test_a_step_keeps_no_mask_between_steps():
    """The causal masks a replica makes (each block's) are computed in the step, not folded
    by Grappler into constants the traced function keeps: between steps the allocator holds
    the weights, the optimizer and the input, not L/C x L bytes per layer (with the
    positions a constant it held 16.8 MiB here; 0.8 MiB without)."""
    length = 4096
    before = tfpar.process_memory().allocator_bytes  # (Other tests' objects in this process.)
    strategy = tfpar.DataParallelStrategy(cpus(2), context_parallel=2)
    with strategy.scope():
        model = _attention_model(length=length)
    x = np.ones((2, length), "int32")
    model.fit(x, x % VOCABULARY, batch_size=2, epochs=2, verbose=0)
    held = tfpar.process_memory().allocator_bytes
    assert held is not None and held - before < 4 * 2 ** 20, (held - before) / 2 ** 20
