"""Model and data shared by the multi-worker tests and their worker processes."""

import time

import numpy as np

GLOBAL_BATCH = 16
EXAMPLES = 128
LEARNING_RATE = 0.1


def data(examples=EXAMPLES):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(examples, 4)).astype("float32"),
            (np.arange(examples) % 3).astype("int32"))


def model():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(3)])


# The Megatron MLP of the tensor-parallel tests: Dense -> [Dense(4h, column) -> Dense(h,
# row)] x 2 -> head, one Megatron MLP per stage when cut in two.
MEGATRON_HIDDEN, MEGATRON_INPUTS, MEGATRON_OUTPUTS = 8, 6, 3


def megatron_mlp(seed=0):
    import keras

    keras.utils.set_random_seed(seed)
    h = MEGATRON_HIDDEN
    return keras.Sequential([
        keras.Input((MEGATRON_INPUTS,)),
        keras.layers.Dense(h, name="embed"),
        keras.layers.Dense(4 * h, activation="relu", name="mlp_in_0"),
        keras.layers.Dense(h, name="mlp_out_0"),
        keras.layers.Dense(4 * h, activation="gelu", name="mlp_in_1"),
        keras.layers.Dense(h, activation="tanh", name="mlp_out_1"),
        keras.layers.Dense(MEGATRON_OUTPUTS, name="head"),
    ], name="megatron")


def megatron_layout(mesh=None):
    import keras

    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[r".*mlp_in_\d/kernel"] = (None, "model")   # Column: output units split.
    layout_map[r".*mlp_out_\d/kernel"] = ("model", None)  # Row: input features split.
    return layout_map


def megatron_data(n=64):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, MEGATRON_INPUTS)).astype("float32"),
            rng.normal(size=(n, MEGATRON_OUTPUTS)).astype("float32"))


def gpt2(vocabulary=16, length=8, layers=2, block=None):
    """A GPT-2 style decoder of keras-hub's layers (token and position embedding, 2
    `TransformerDecoder` blocks with causal self-attention, hidden 16, 2 heads) and a head
    over the vocabulary: each block is one node of the model, its attention and MLP
    layers inside."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    tokens = keras.Input((length,), dtype="int32", name="token_ids")
    x = keras_hub.layers.TokenAndPositionEmbedding(vocabulary, length, 16,
                                                   name="embedding")(tokens)
    for i in range(layers):
        x = (block or keras_hub.layers.TransformerDecoder)(32, 2, dropout=0.0,
                                                           name=f"transformer_layer_{i}")(x)
    model = keras.Model(tokens, keras.layers.Dense(vocabulary, name="lm_head")(x))
    # epsilon 1e-3: the key bias's gradient is 0 in exact arithmetic (softmax ignores a
    # shift shared by a row's scores), and Adam's default 1e-7 would scale its rounding
    # noise, which differs with the order of sums, up to the size of a step.
    model.compile(keras.optimizers.Adam(0.01, epsilon=1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def gpt2_layout(mesh=None):
    """Megatron's split of a GPT-2 block, by keras-hub's variable paths."""
    import keras

    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[r".*self_attention/(query|key|value)/kernel"] = (None, "model", None)  # heads
    layout_map[r".*self_attention/attention_output/kernel"] = ("model", None, None)
    layout_map[r".*feedforward_intermediate_dense/kernel"] = (None, "model")
    layout_map[r".*feedforward_output_dense/kernel"] = ("model", None)
    return layout_map


def optimizer(name="sgd"):
    import keras

    if name == "adam":
        return keras.optimizers.Adam(0.01)
    if name == "sgd_momentum":
        return keras.optimizers.SGD(LEARNING_RATE, momentum=0.9)
    if name == "adamw_clip":
        # A large model's recipe: weight decay, and a clipping threshold every step's
        # gradient exceeds (the global norm: over every owner's share under ZeRO).
        return keras.optimizers.AdamW(0.01, weight_decay=0.1, global_clipnorm=0.05)
    if name == "adamw_clip_ema":  # The same, keeping moving averages of the weights.
        return keras.optimizers.AdamW(0.01, weight_decay=0.1, global_clipnorm=0.05,
                                      use_ema=True, ema_momentum=0.9,
                                      ema_overwrite_frequency=3)
    return keras.optimizers.SGD(LEARNING_RATE)


def loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _callback_base():
    import keras

    return keras.callbacks.Callback


class SlowDown(_callback_base()):
    """Makes each step take a while, so a worker can be killed mid-epoch."""

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.05)


class CrashAt(_callback_base()):
    """Kills this worker hard in the middle of epoch `epoch` (0-based)."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch
        self.current = -1

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.current == self.epoch and batch == 3:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)


# Context parallelism: token sequences, a third padded at the end and a third at the start,
# and a causal attention model whose keys' padding is masked.
SEQUENCE_LENGTH, SEQUENCE_VOCABULARY, SEQUENCE_EXAMPLES, SEQUENCE_BATCH = 8, 16, 24, 12


def sequence_data(seed=0, length=SEQUENCE_LENGTH, examples=SEQUENCE_EXAMPLES):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, SEQUENCE_VOCABULARY, size=(examples, length)).astype("int32")
    x[::3, length - 3:] = 0
    x[1::3, :3] = 0
    return x, rng.integers(0, SEQUENCE_VOCABULARY, size=(examples, length)).astype("int32")


def causal_attention_model(length=SEQUENCE_LENGTH, with_mask_input=False):
    """Embedding(mask_zero) -> causal MultiHeadAttention, its keys' padding masked (and an
    attention-mask input) -> LayerNormalization -> Dense, per position; SGD."""
    import keras

    keras.utils.set_random_seed(0)
    ids = keras.Input((length,), dtype="int32", name="ids")
    inputs = [ids]
    x = keras.layers.Embedding(SEQUENCE_VOCABULARY, 8, mask_zero=True)(ids)
    kwargs = {}
    if with_mask_input:
        mask = keras.Input((length, length), dtype="int32", name="attention_mask")
        inputs.append(mask)
        kwargs["attention_mask"] = mask
    keys = keras.ops.not_equal(ids, 0)  # (Keras' MHA takes its keys' padding as value_mask.)
    h = keras.layers.MultiHeadAttention(2, 4, name="attention")(
        x, x, value_mask=keys, use_causal_mask=True, **kwargs)
    h = keras.layers.LayerNormalization()(h + x)
    model = keras.Model(inputs, keras.layers.Dense(SEQUENCE_VOCABULARY)(h))
    model.compile(keras.optimizers.SGD(0.5),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model
