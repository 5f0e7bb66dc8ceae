"""A keras-hub causal LM trained as keras-hub's fine-tuning guides train one (AdamW with
weight decay, `global_clipnorm`, a warmup then a cosine decay, `mixed_bfloat16`, padded
sequences whose padding is masked out of the loss by `sample_weight`) under each kind of
tfpar strategy, against the same recipe on one device (issue 35).

The batch is built so that replicas differ: the first half of each batch holds long
sequences, the second mostly padding, so a loss mean taken per replica instead of over the
global batch's real tokens, or a clip of one replica's gradient, shows.
"""

import keras
import numpy as np
import pytest

import tfpar
from harness import cpus

keras_hub = pytest.importorskip("keras_hub")

VOCABULARY, LENGTH, EXAMPLES, BATCH, EPOCHS = 32, 8, 32, 16, 2
# The guides' `global_clipnorm=1.0` is never reached by a model this small (its first
# gradient's norm is about 0.27): 0.1 is, so the clipping acts in every step.
CLIP = 0.1
# Mixed precision: the 1e-2 (bfloat16 rounds each sum where it is made, and the
# order of sums differs with the layout).
ATOL = 1e-2


def _data():
    """Sequences of 2 to LENGTH + 1 tokens, padded with 0: inputs, next-token targets and
    the targets' padding mask as sample weights, as keras-hub's CausalLMPreprocessor gives."""
    rng = np.random.default_rng(0)
    lengths = np.where(np.arange(EXAMPLES) % BATCH < BATCH // 2,
                       rng.integers(LENGTH - 1, LENGTH + 2, EXAMPLES),
                       rng.integers(2, 4, EXAMPLES))
    tokens = rng.integers(1, VOCABULARY, (EXAMPLES, LENGTH + 1)).astype("int32")
    padding = np.arange(LENGTH + 1)[None, :] < lengths[:, None]
    tokens = np.where(padding, tokens, 0).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": padding[:, :-1].astype("int32")}
    return x, tokens[:, 1:], padding[:, 1:].astype("float32")


def _causal_lm():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, dropout=0.0, max_sequence_length=LENGTH)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=EPOCHS * EXAMPLES // BATCH, warmup_target=1e-2, warmup_steps=2)
    model.compile(
        optimizer=keras.optimizers.AdamW(schedule, weight_decay=0.01, global_clipnorm=CLIP),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"])
    return model


def _layout(mesh=None):
    """Megatron's split of each GPT-2 block over the 'model' axis, by keras-hub's paths."""
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[r".*self_attention/(query|key|value)/kernel"] = (None, "model", None)
    layout_map[r".*self_attention/attention_output/kernel"] = ("model", None, None)
    layout_map[r".*feedforward_intermediate_dense/kernel"] = (None, "model")
    layout_map[r".*feedforward_output_dense/kernel"] = ("model", None)
    return layout_map


def _mesh():
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
                                         keras.distribution.list_devices()[:4])
    return tfpar.MeshStrategy(mesh, _layout(mesh))


STRATEGIES = {
    "dp2": lambda: tfpar.DataParallelStrategy(cpus(2)),
    "zero1": lambda: tfpar.DataParallelStrategy(cpus(2), shard="optimizer"),
    "zero2": lambda: tfpar.DataParallelStrategy(cpus(2), shard="gradients"),
    "zero3": lambda: tfpar.DataParallelStrategy(cpus(2), shard="parameters"),
    "pipe_r2k2": lambda: tfpar.PipelineStrategy(cpus(4), num_micro_batches=2, num_replicas=2,
                                                schedule="1f1b"),
    "pipe_tp": lambda: tfpar.PipelineStrategy(cpus(4), num_micro_batches=2, num_stages=2,
                                              schedule="1f1b", tensor_parallel=2,
                                              layout_map=_layout()),
    "mesh": _mesh,
    # Each sequence split over the replicas (chunks 0 and 3 of 4 on one, mostly padding in
    # the second half of a batch): the loss's mean over real tokens and the clip are global.
    "cp2": lambda: tfpar.DataParallelStrategy(cpus(2), context_parallel=2),
    "cp2_zero3": lambda: tfpar.DataParallelStrategy(cpus(2), context_parallel=2,
                                                    shard="parameters"),
}


def _train(strategy=None):
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        if strategy is None:
            model = _causal_lm()
        else:
            with strategy.scope():
                model = _causal_lm()
        x, y, weights = _data()
        history = model.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=EPOCHS,
                            shuffle=False, verbose=0)
        return model, history.history
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.fixture(scope="module")
def one_device():
    model, history = _train()
    return [np.asarray(w, "float32") for w in model.get_weights()], history


def test_the_recipe_clips_and_masks_on_one_device(one_device):
    """The rows below test what they name: on one device the first step's gradient exceeds
    the clip threshold, and the padding changes the loss."""
    model = _causal_lm()
    x, y, weights = _data()
    import tensorflow as tf

    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        loss = model.compute_loss(x, y, logits, sample_weight=weights)
    norm = tf.linalg.global_norm(tape.gradient(loss, model.trainable_variables))
    assert float(norm) > 2 * CLIP
    unmasked = model.compute_loss(x, y, logits)
    assert abs(float(unmasked) - float(loss)) > 1e-2
    weights, _ = one_device
    assert max(np.abs(w - w0).max() for w, w0 in zip(weights, model.get_weights())) > 1e-3


@pytest.mark.parametrize("sid", sorted(STRATEGIES))
def test_keras_hub_causal_lm_recipe_trains_as_on_one_device(sid, one_device):
    want, want_history = one_device
    model, history = _train(STRATEGIES[sid]())
    got = [np.asarray(w, "float32") for w in model.get_weights()]
    worst = max(np.abs(g - w).max() for g, w in zip(got, want))
    assert worst < ATOL, (sid, worst)
    np.testing.assert_allclose(history["loss"], want_history["loss"], atol=ATOL)
