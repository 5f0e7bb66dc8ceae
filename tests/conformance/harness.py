"""Keras conformance harness: one Keras feature trained under a strategy and on one device.

A `Feature` is a tiny model, its compile arguments, its data and its fit arguments. `run(sid,
feature)` builds it under strategy `sid` (None: one device, no strategy) from the same seed,
fits it on the same global batches, then evaluates and predicts; the `Result` holds everything
as numpy. `reference(name)` is the one-device run, computed once per feature.

Only tfpar's public API is used. The module imports no pytest, so the multi-worker worker
process (tests/workers/conformance_worker.py) runs the same features.
"""

import contextlib
import dataclasses
import functools
import os
import pickle
import tempfile
from typing import Any, Callable, Optional

import keras
import numpy as np
import tensorflow as tf

import tfpar

EXAMPLES = 48
BATCH = 16
EPOCHS = 1  # each epoch costs a distributed iterator (~0.8 s on 4 replicas)
SEED = 0
ATOL = RTOL = 1e-5


def cpus(n):
    return [f"/cpu:{i}" for i in range(n)]


# --- Strategies ------------------------------------------------------------------------------

STRATEGIES = {
    "dp2": lambda: tfpar.DataParallelStrategy(cpus(2)),
    "dp4": lambda: tfpar.DataParallelStrategy(cpus(4)),
    "mp": lambda: tfpar.ModelParallelStrategy(cpus(2)),
    "gpipe": lambda: tfpar.PipelineStrategy(cpus(2), num_micro_batches=4, schedule="gpipe"),
    "1f1b": lambda: tfpar.PipelineStrategy(cpus(2), num_micro_batches=4, schedule="1f1b"),
    "pipe_r2k2": lambda: tfpar.PipelineStrategy(cpus(4), num_micro_batches=2, num_replicas=2,
                                                schedule="1f1b"),
    "pipe_zero1": lambda: _pipeline_zero("optimizer"),
    "pipe_zero2": lambda: _pipeline_zero("gradients"),
    "pipe_zero3": lambda: _pipeline_zero("parameters"),
    "zero1": lambda: tfpar.DataParallelStrategy(cpus(2), shard="optimizer"),
    "zero2": lambda: tfpar.DataParallelStrategy(cpus(2), shard="gradients"),
    "zero3": lambda: tfpar.DataParallelStrategy(cpus(2), shard="parameters"),
    "zb": lambda: tfpar.PipelineStrategy(cpus(2), num_micro_batches=4,
                                         schedule="zero_bubble_h1"),
    "2bw": lambda: tfpar.PipelineStrategy(cpus(2), num_micro_batches=4, schedule="2bw"),
    # The replicas' gradients summed in bfloat16 (the coarser of the two wire types).
    "dp2_bf16": lambda: tfpar.DataParallelStrategy(cpus(2), compression="bf16"),
    # Periodic averaging: each replica steps alone, the weights averaged every 2 steps.
    "dp2_local": lambda: tfpar.DataParallelStrategy(cpus(2), sync_every=2),
    # Halving-doubling over 3 replicas: the third hands its buffer to the first, the first
    # two exchange halves, the sum goes back.
    "dp3_hd": lambda: tfpar.DataParallelStrategy(cpus(3), communication="halving_doubling"),
    # Context parallelism: every sequence split over 3 replicas (6 positions: chunks of 1,
    # replica c holding positions c and 5 - c).
    "cp3": lambda: tfpar.DataParallelStrategy(cpus(3), context_parallel=3),
}
# "pipe_zero1/2/3": pipe_r2k2 with ZeRO stage 1, 2 or 3 over each stage's 2 replicas
# (expected.PIPELINE_ZERO_FEATURES, expected.PIPELINE_ZERO23_FEATURES).
# "dp2" and "1f1b" run every feature; "mp" and "zero3" (expected.MP_FEATURES,
# expected.ZERO3_FEATURES), "dp4", "zero1", "zero2", "gpipe", "pipe_r2k2", "zb"
# (zero-bubble H1: the backward split into input and weight gradients) and "2bw" run on
# representative subsets (expected.DP4_FEATURES, expected.PIPELINE_REPLICA_FEATURES: those
# whose numbers depend on the replica count, as dp2 runs all; expected.ZERO1_FEATURES,
# expected.ZERO2_FEATURES, expected.GPIPE_FEATURES, expected.SPLIT_BACKWARD_FEATURES: stage 3
# and 1F1B share their code and run on all; expected.TWO_BW_FEATURES; "dp2_bf16", gradients
# summed in bfloat16: expected.COMPRESSION_FEATURES; "dp2_local", periodic averaging:
# expected.LOCAL_SGD_FEATURES; "dp3_hd", halving-doubling all-reduces:
# expected.HALVING_DOUBLING_FEATURES; "cp3", context parallelism:
# expected.CONTEXT_PARALLEL_FEATURES). (The subsets keep the
# suite's time down: a cell costs 2-14 s, mostly TensorFlow tracing.)
SUBSET_COLUMNS = ("dp4", "zero1", "zero2", "gpipe", "pipe_r2k2", "zb", "2bw", "pipe_zero1",
                  "pipe_zero2", "pipe_zero3", "mp", "zero3", "dp2_bf16", "dp2_local", "dp3_hd",
                  "cp3")
STRATEGY_IDS = [s for s in STRATEGIES if s not in SUBSET_COLUMNS]
# keras.distribution on TensorFlow (tfpar.MeshStrategy): a (2, 2) mesh, each batch split
# over the data axis and the features' two hidden Dense layers split over the model axis as
# a Megatron pair, column then row (a representative subset of features,
# expected.MESH_FEATURES).
MESH = "mesh"


def _mesh_strategy():
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
                                         keras.distribution.list_devices()[:4])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*d1/kernel"] = (None, "model")
    layout_map[".*d1/bias"] = ("model",)
    layout_map[".*d2/kernel"] = ("model", None)
    return tfpar.MeshStrategy(mesh, layout_map)


STRATEGIES[MESH] = _mesh_strategy
# A tensor-parallel pipeline (K=2 stages x T=2 devices): the features' d1 split by columns
# (its bias too) and d2 by rows, as the mesh column splits them, each on its stage's 2 CPUs
# (expected.PIPELINE_TP_FEATURES).
PIPE_TP = "pipe_tp"


def _pipeline_tensor_parallel():
    return tfpar.PipelineStrategy(cpus(4), num_micro_batches=2, num_stages=2, schedule="1f1b",
                                  tensor_parallel=2, layout_map=_megatron_layout_map())


STRATEGIES[PIPE_TP] = _pipeline_tensor_parallel


def _megatron_layout_map():
    layout_map = keras.distribution.LayoutMap(None)
    layout_map[".*d1/kernel"] = (None, "model")
    layout_map[".*d1/bias"] = ("model",)
    layout_map[".*d2/kernel"] = ("model", None)
    return layout_map


# The same split with zero bubble (K=2 x T=2: the backward's all-reduces in its input pass),
# and over 2 replicas with ZeRO-3 (R=2 x T=2, one stage: each shard on one owner), each stage
# run replicated by peer collectives (expected.PIPELINE_TP_VARIANT_FEATURES).
STRATEGIES["pipe_tp_zb"] = lambda: tfpar.PipelineStrategy(
    cpus(4), num_micro_batches=2, num_stages=2, schedule="zero_bubble_h1", tensor_parallel=2,
    layout_map=_megatron_layout_map())
STRATEGIES["tp_zero3"] = lambda: tfpar.PipelineStrategy(
    cpus(4), num_micro_batches=2, num_replicas=2, num_stages=1, schedule="1f1b",
    tensor_parallel=2, shard="parameters", layout_map=_megatron_layout_map())
# Gradients summed in bfloat16 under ZeRO-1 (each owner's sum) and over 2 pipeline replicas
# (each stage's sum) (expected.COMPRESSION_FEATURES).
STRATEGIES["zero1_bf16"] = lambda: tfpar.DataParallelStrategy(cpus(2), shard="optimizer",
                                                              compression="bf16")
STRATEGIES["pipe_r2k2_bf16"] = lambda: tfpar.PipelineStrategy(
    cpus(4), num_micro_batches=2, num_replicas=2, schedule="1f1b", compression="bf16")
# (Made after STRATEGY_IDS, as the mesh and pipe_tp: not columns of every feature.)
SUBSET_COLUMNS += ("pipe_tp_zb", "tp_zero3", "zero1_bf16", "pipe_r2k2_bf16")
# How each strategy splits a global batch: replicas (each its own loss mean) and micro-batches.
# ("mw2": DataParallelStrategy over 2 worker processes, one replica each.)
REPLICAS = {"dp2": 2, "dp4": 4, "mp": 1, "gpipe": 1, "1f1b": 1, "pipe_r2k2": 2, "mw2": 2,
            "zero1": 2, "zero2": 2, "zero3": 2, "zb": 1, "2bw": 1, MESH: 1, "pipe_zero1": 2,
            "pipe_zero2": 2, "pipe_zero3": 2, PIPE_TP: 1, "dp2_bf16": 2, "dp2_local": 2,
            "dp3_hd": 3, "pipe_tp_zb": 1, "tp_zero3": 2, "zero1_bf16": 2, "pipe_r2k2_bf16": 2}
MICRO_BATCHES = {"dp2": 1, "dp4": 1, "mp": 1, "gpipe": 4, "1f1b": 4, "pipe_r2k2": 2, "mw2": 1,
                 "zero1": 1, "zero2": 1, "zero3": 1, "zb": 4, "2bw": 4, MESH: 1,
                 "pipe_zero1": 2, "pipe_zero2": 2, "pipe_zero3": 2, PIPE_TP: 2, "dp2_bf16": 1,
                 "dp2_local": 1, "dp3_hd": 1, "pipe_tp_zb": 2, "tp_zero3": 2, "zero1_bf16": 1,
                 "pipe_r2k2_bf16": 2}


def _pipeline_zero(shard):
    return tfpar.PipelineStrategy(cpus(4), num_micro_batches=2, num_replicas=2,
                                  schedule="1f1b", shard=shard)


# Columns whose evaluate and predict run another column's code (named): ZeRO-1/2 keep whole
# weights on every replica as DP 2 does, and GPipe and zero-bubble H1 run 1F1B's forward pass
# (the schedules differ in the training step only), pipe_zero1/2 pipe_r2k2's. Their cells
# compare training (weights, history, anything saved); evaluate and predict (~1/3 of a cell)
# are compared on the named column. 2BW keeps its own: its weights come in versions.
INFERENCE_OF = {"zero1": "dp2", "zero2": "dp2", "gpipe": "1f1b", "zb": "1f1b",
                "pipe_zero1": "pipe_r2k2", "pipe_zero2": "pipe_r2k2", "dp2_bf16": "dp2",
                "zero1_bf16": "dp2"}


def infers(sid, feature):
    """Whether the cell (sid, feature) runs evaluate and predict."""
    return feature.inference and (sid not in INFERENCE_OF or feature.after is not None)


def make_strategy(sid):
    """A fresh strategy per run: no state carries over from one cell to the next."""
    return None if sid is None else STRATEGIES[sid]()


# --- Data ------------------------------------------------------------------------------------

@dataclasses.dataclass
class Data:
    x: Any
    y: Any
    sample_weight: Any = None
    fit_sample_weight: Any = None  # when set, fit uses it instead of sample_weight


def classification(n=EXAMPLES, seed=0, inputs=4, classes=3):
    rng = np.random.default_rng(seed)
    return Data(rng.normal(size=(n, inputs)).astype("float32"),
                rng.integers(0, classes, n).astype("int32"))


def weighted(n=EXAMPLES):
    data = classification(n)
    data.sample_weight = np.random.default_rng(1).uniform(0.2, 2.0, n).astype("float32")
    return data


def binary(n=EXAMPLES):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = ((x[:, 0] + 0.5 * rng.normal(size=n)) > 0).astype("float32")[:, None]
    return Data(x, y)


def two_heads(n=EXAMPLES):
    data = classification(n)
    rng = np.random.default_rng(4)
    return Data(data.x, {"cls": data.y, "reg": rng.normal(size=(n, 1)).astype("float32")})


def two_inputs(n=EXAMPLES):
    rng = np.random.default_rng(5)
    x = [rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")]
    y = [rng.integers(0, 3, n).astype("int32"), rng.normal(size=(n, 2)).astype("float32")]
    return Data(x, y)


def sequences(n=EXAMPLES, steps=6, vocab=10):
    """Token ids padded with zeros at the end (lengths 2..6), per-timestep labels."""
    rng = np.random.default_rng(6)
    lengths = rng.integers(2, steps + 1, n)
    ids = rng.integers(1, vocab, size=(n, steps)).astype("int32")
    ids[np.arange(steps)[None, :] >= lengths[:, None]] = 0
    per_step = rng.integers(0, 3, size=(n, steps)).astype("int32")
    return Data(ids, per_step)


def sequence_classes(n=EXAMPLES):
    data = sequences(n)
    return Data(data.x, data.y[:, 0])


def replica_skewed(n=EXAMPLES):
    """Classification data whose second half of every batch (replica 1 of 2, replicas 2-3 of
    4, the later micro-batches) is 6x larger: that part's gradient alone exceeds a clipping
    threshold the other part's does not reach."""
    data = classification(n)
    rows = np.arange(n) % BATCH >= BATCH // 2
    data.x[rows] *= 6.0
    return data


def overflowing_on_one_replica(n=EXAMPLES):
    """Classification data whose first batch's second half is 50x larger: under
    mixed_float16 its loss-scaled gradients overflow (one device skips that step and halves
    the scale), the first half's do not."""
    data = classification(n)
    data.x[BATCH // 2:BATCH] *= 50.0
    return data


# --- Models ----------------------------------------------------------------------------------

def mlp(outputs=3, activation=None, first=None, second=None, inputs=4):
    """Input -> Dense(8, tanh) -> Dense(8, relu) -> Dense(outputs): three layers, so a pipeline
    of 2 stages can cut it. `first`/`second`: extra Dense keyword arguments."""
    first = {"activation": "tanh", **(first or {})}
    return keras.Sequential([
        keras.Input((inputs,)),
        keras.layers.Dense(8, name="d1", **first),
        keras.layers.Dense(8, activation="relu", name="d2", **(second or {})),
        keras.layers.Dense(outputs, activation=activation, name="out"),
    ])


def scce(**kwargs):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, **kwargs)


def adam(**kwargs):
    return keras.optimizers.Adam(0.01, **kwargs)


def basic_compile(**extra):
    return lambda: dict(optimizer=adam(), loss=scce(), metrics=["accuracy"], **extra)


@keras.saving.register_keras_serializable("tfpar_conformance")
def per_example_loss(y_true, y_pred):
    """A plain loss function returning one loss per example; compile reduces it."""
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


@keras.saving.register_keras_serializable("tfpar_conformance")
def penalized_loss(y_true, y_pred):
    return per_example_loss(y_true, y_pred) + 0.1 * keras.ops.mean(keras.ops.square(y_pred), -1)


@keras.saving.register_keras_serializable("tfpar_conformance")
class ActivityPenalty(keras.layers.Layer):
    """Identity that adds 0.05 x mean(x^2) of its input with `self.add_loss`."""

    def call(self, inputs):
        self.add_loss(0.05 * keras.ops.mean(keras.ops.square(inputs)))
        return inputs


def with_add_loss():
    return keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(8, activation="tanh", name="d1"),
        ActivityPenalty(name="penalty"),
        keras.layers.Dense(8, activation="relu", name="d2"), keras.layers.Dense(3, name="out")])


def batchnorm_model(synchronized=False):
    return keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(8, use_bias=False, name="d1"),
        keras.layers.BatchNormalization(synchronized=synchronized, name="bn"),
        keras.layers.Activation("relu", name="relu"), keras.layers.Dense(3, name="out")])


def dropout_model():
    return keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(8, activation="relu", name="d1"),
        keras.layers.Dropout(0.3, seed=7, name="drop"), keras.layers.Dense(3, name="out")])


def two_head_model():
    inputs = keras.Input((4,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="d1")(inputs)
    h = keras.layers.Dense(8, activation="relu", name="d2")(h)
    return keras.Model(inputs, {"cls": keras.layers.Dense(3, name="cls")(h),
                                "reg": keras.layers.Dense(1, name="reg")(h)})


def two_input_two_output_model():
    a, b = keras.Input((4,), name="a"), keras.Input((3,), name="b")
    h = keras.layers.Concatenate(name="join")([keras.layers.Dense(6, name="da")(a),
                                               keras.layers.Dense(6, name="db")(b)])
    h = keras.layers.Dense(8, activation="tanh", name="d1")(h)
    h = keras.layers.Dense(8, activation="relu", name="d2")(h)
    return keras.Model([a, b], [keras.layers.Dense(3, name="cls")(h),
                                keras.layers.Dense(2, name="reg")(h)])


def metric_heads_model():
    inputs = keras.Input((4,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="d1")(inputs)
    h = keras.layers.Dense(8, activation="relu", name="d2")(h)
    return keras.Model(inputs, {"cls": keras.layers.Dense(3, activation="softmax", name="cls")(h),
                                "reg": keras.layers.Dense(1, name="reg")(h)})


def masked_rnn_model():
    return keras.Sequential([
        keras.Input((6,), dtype="int32"),
        keras.layers.Embedding(10, 4, mask_zero=True, name="emb"),
        keras.layers.GRU(4, return_sequences=True, name="gru"),
        keras.layers.Dense(3, name="out")])


def masked_pooling_model():
    return keras.Sequential([
        keras.Input((6,), dtype="int32"),
        keras.layers.Embedding(10, 4, mask_zero=True, name="emb"),
        keras.layers.GlobalAveragePooling1D(name="pool"),
        keras.layers.Dense(8, activation="tanh", name="d1"), keras.layers.Dense(3, name="out")])


@keras.saving.register_keras_serializable("tfpar_conformance")
class CustomStepModel(keras.Model):
    """A functional model with its own train_step written with `self.compute_loss`."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss * tf.distribute.get_strategy().num_replicas_in_sync)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def relu_mlp():
    """mlp() with ReLU first: large inputs give large activations and gradients (no tanh to
    saturate them)."""
    return mlp(first={"activation": "relu"})


def masked_dense_model():
    """Embedding(mask_zero=True) -> Dense d1 -> Dense d2 -> Dense out, per time step: the
    padding mask passes through every Dense (a tensor-parallel column/row pair included) to
    the loss."""
    return keras.Sequential([
        keras.Input((6,), dtype="int32"),
        keras.layers.Embedding(10, 4, mask_zero=True, name="emb"),
        keras.layers.Dense(8, activation="tanh", name="d1"),
        keras.layers.Dense(8, activation="relu", name="d2"),
        keras.layers.Dense(3, name="out")])


def causal_attention_model():
    """Embedding(mask_zero=True) -> causal self-attention (its padding mask from the
    embedding) -> Dense, per time step: the model context parallelism splits by positions."""
    keras.utils.set_random_seed(SEED)
    ids = keras.Input((6,), dtype="int32")
    x = keras.layers.Embedding(10, 4, mask_zero=True, name="emb")(ids)
    h = keras.layers.MultiHeadAttention(2, 2, name="attention")(x, x, use_causal_mask=True)
    return keras.Model(ids, keras.layers.Dense(3, name="out")(h))


def custom_step_model():
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, activation="tanh", name="d1")(inputs)
    h = keras.layers.Dense(8, activation="relu", name="d2")(h)
    return CustomStepModel(inputs, keras.layers.Dense(3, name="out")(h))


@keras.saving.register_keras_serializable("tfpar_conformance")
class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d1 = keras.layers.Dense(8, activation="tanh", name="d1")
        self.d2 = keras.layers.Dense(8, activation="relu", name="d2")
        self.out = keras.layers.Dense(3, name="out")

    def call(self, inputs):
        return self.out(self.d2(self.d1(inputs)))


def subclassed_model():
    model = Subclassed()
    model.build((None, 4))
    return model


def frozen_model():
    model = mlp()
    model.get_layer("d1").trainable = False
    return model


def nested_model():
    inner = keras.Sequential([keras.layers.Dense(8, activation="tanh", name="d1"),
                              keras.layers.Dense(8, activation="relu", name="d2")], name="inner")
    inputs = keras.Input((4,))
    h = inner(inputs)
    h = keras.layers.Dense(8, activation="tanh", name="d3")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="out")(h))


# --- After-fit checks that need a file --------------------------------------------------------

def saved_and_loaded(model, data, directory):
    path = os.path.join(directory, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)  # called outside any strategy scope
    return {"loaded_predict": loaded.predict(data.x, batch_size=BATCH, verbose=0)}


def exported_and_served(model, data, directory):
    path = os.path.join(directory, "exported")
    model.export(path, verbose=False)
    loaded = tf.saved_model.load(path)  # kept: its variables must outlive the call
    served = loaded.serve(tf.constant(data.x))
    return {"served": np.asarray(served)}


# --- Custom training loops --------------------------------------------------------------------

def custom_loop(model, strategy, feature, data):
    """`fit` replaced by a custom loop as TensorFlow's and Keras' distributed-training guides
    write one: a distributed dataset of global batches, `strategy.run` of a replica step
    whose loss is the per-example losses over the *global* batch
    (`tf.nn.compute_average_loss`), scaled by the optimizer (`scale_loss`: a
    LossScaleOptimizer's scale) before the tape's gradient, then
    `optimizer.apply_gradients`; the step returns the replicas' losses summed. History: the
    mean of the steps' losses per epoch. (No strategy: the default one, one device.)"""
    strategy = strategy or tf.distribute.get_strategy()
    per_example = scce(reduction=None)
    optimizer = model.optimizer
    batches = tf.data.Dataset.from_tensor_slices((data.x, data.y)).batch(feature.batch_size)
    dataset = strategy.experimental_distribute_dataset(batches)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            losses = per_example(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(losses, global_batch_size=feature.batch_size)
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(x, y):
        losses = strategy.run(replica_step, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    history = {"loss": []}
    for _ in range(feature.epochs):
        history["loss"].append(np.mean([float(step(x, y)) for x, y in dataset]))
    return history


# --- Features --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    build: Callable[[], Any]
    compile: Callable[[], dict]
    data: Callable[[], Data] = classification
    fit_kwargs: dict = dataclasses.field(default_factory=dict)
    batch_size: int = BATCH
    epochs: int = EPOCHS
    atol: float = ATOL
    rtol: float = RTOL
    policy: Optional[str] = None
    # Compile arguments of a second compile (under the scope) followed by a second fit.
    recompile: Optional[Callable[[], dict]] = None
    # (model, data, directory) -> {name: array}: extra outputs compared with `predict`.
    after: Optional[Callable] = None
    # (model, strategy or None, feature, data) -> history: a training loop of its own in
    # place of `fit` (custom_loop).
    loop: Optional[Callable] = None
    summary: str = ""
    # False for rows whose subject is the optimizer's step alone (optimizer arguments and
    # classes, clipping, accumulation, loss scaling): their weights and training history
    # are compared, and evaluate/predict, which such a row does not change, are left to the
    # other rows of each column (a cell's evaluate and predict cost ~40% of it).
    inference: bool = True
    # False for rows whose model, inputs and outputs are the base row's
    # (loss_sum_over_batch_size: the plain MLP): their predict would run the base row's
    # forward pass on other weights, which are compared; their evaluate (losses, weights,
    # metrics) is compared.
    predicts: bool = True


# The rows whose subject is the optimizer's step (see Feature.inference).
STEP_ONLY = ("gradient_accumulation", "custom_loop_accumulation", "custom_loop_loss_scale",
             "clip_global_norm_one_replica", "clip_norm_one_replica", "clip_value_one_replica",
             "overflow_one_replica", "adamw_recipe", "custom_loop_clip", "attention_recipe",
             "attention_custom_loop")
BASE_ROW = "loss_sum_over_batch_size"
# The rows whose predict is the base row's (see Feature.predicts).
BASE_OUTPUTS = ("loss_sum", "loss_none_custom_fn", "loss_mean_with_sample_weight",
                "sample_weight", "class_weight", "kernel_regularizer", "activity_regularizer",
                "frozen_layer", "custom_loop")


def _features():
    f = [
        Feature("loss_sum_over_batch_size", mlp, basic_compile(), epochs=2,
                summary="SparseCategoricalCrossentropy, default reduction"),
        Feature("loss_sum", mlp, lambda: dict(optimizer=adam(), loss=scce(reduction="sum")),
                summary='reduction="sum"'),
        Feature("loss_mean_with_sample_weight", mlp,
                lambda: dict(optimizer=adam(), loss=scce(reduction="mean_with_sample_weight")),
                data=weighted, summary='reduction="mean_with_sample_weight" with sample weights'),
        Feature("loss_none_custom_fn", mlp,
                lambda: dict(optimizer=adam(), loss=per_example_loss),
                summary="plain function returning per-example losses, reduced by compile"),
        Feature("sample_weight", mlp, basic_compile(), data=weighted,
                summary="fit/evaluate with sample_weight"),
        Feature("class_weight", mlp, basic_compile(),
                fit_kwargs={"class_weight": {0: 1.0, 1: 2.0, 2: 0.5}}, summary="class_weight"),
        Feature("multi_output_loss_weights", two_head_model,
                lambda: dict(optimizer=adam(), loss={"cls": scce(), "reg": "mse"},
                             loss_weights={"cls": 1.0, "reg": 0.5},
                             metrics={"cls": ["accuracy"]}),
                data=two_heads, summary="two outputs, two losses, loss_weights"),
        Feature("masked_rnn_per_timestep", masked_rnn_model, basic_compile(), data=sequences,
                summary="Embedding(mask_zero=True) -> GRU(return_sequences) -> per-step loss"),
        Feature("masked_pooling", masked_pooling_model, basic_compile(), data=sequence_classes,
                summary="Embedding(mask_zero=True) -> GlobalAveragePooling1D"),
        Feature("uneven_global_batch", mlp, basic_compile(),
                data=lambda: classification(36), batch_size=18,
                summary="global batch 18 (not a multiple of 4 replicas or micro-batches)"),
        Feature("partial_last_batch", mlp, basic_compile(), data=lambda: classification(42),
                summary="42 examples in batches of 16: the last batch has 10"),
        Feature("metrics_confusion", lambda: mlp(1, "sigmoid"),
                lambda: dict(optimizer=adam(), loss="binary_crossentropy",
                             metrics=[keras.metrics.Precision(name="precision"),
                                      keras.metrics.Recall(name="recall"),
                                      keras.metrics.AUC(name="auc"),
                                      keras.metrics.F1Score(threshold=0.5, name="f1")]),
                data=binary, epochs=2, summary="Precision, Recall, AUC, F1Score"),
        Feature("metrics_iou_r2", metric_heads_model,
                lambda: dict(optimizer=adam(),
                             loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
                             metrics={"cls": [keras.metrics.MeanIoU(
                                          3, sparse_y_pred=False, name="iou")],
                                      "reg": [keras.metrics.R2Score(name="r2")]}),
                data=two_heads, epochs=2, summary="MeanIoU, R2Score"),
        Feature("batchnorm", batchnorm_model, basic_compile(),
                summary="BatchNormalization (weights and moving statistics)"),
        Feature("batchnorm_synchronized", lambda: batchnorm_model(True), basic_compile(),
                summary="BatchNormalization(synchronized=True)"),
        Feature("dropout_seeded", dropout_model, basic_compile(), summary="Dropout(0.3, seed=7)"),
        Feature("kernel_regularizer", lambda: mlp(first={"kernel_regularizer": "l2"}),
                basic_compile(), summary="kernel_regularizer (fit and evaluate loss)"),
        Feature("activity_regularizer", lambda: mlp(second={"activity_regularizer": "l2"}),
                basic_compile(), summary="activity_regularizer (fit and evaluate loss)"),
        Feature("add_loss", with_add_loss, basic_compile(),
                summary="a layer calling self.add_loss (fit and evaluate loss)"),
        Feature("recompile", mlp, basic_compile(), epochs=1,
                recompile=lambda: dict(
                    optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=penalized_loss,
                    metrics=[keras.metrics.SparseTopKCategoricalAccuracy(2, name="top2")]),
                summary="fit, compile again (optimizer, learning rate, loss, metrics), fit"),
        Feature("steps_per_execution", mlp, basic_compile(steps_per_execution=2),
                summary="steps_per_execution=2"),
        Feature("gradient_accumulation", mlp,
                lambda: dict(optimizer=adam(gradient_accumulation_steps=2), loss=scce()),
                summary="optimizer gradient_accumulation_steps=2"),
        Feature("jit_compile", mlp, basic_compile(jit_compile=True), summary="jit_compile=True"),
        Feature("jit_compile_batchnorm", batchnorm_model, basic_compile(jit_compile=True),
                summary="jit_compile=True, BatchNormalization (its statistics written out of "
                        "the compiled call)"),
        Feature("jit_compile_dropout", dropout_model, basic_compile(jit_compile=True),
                summary="jit_compile=True, Dropout(0.3, seed=7) (its seed written out of the "
                        "compiled call)"),
        Feature("jit_compile_add_loss", with_add_loss, basic_compile(jit_compile=True),
                summary="jit_compile=True, a layer calling self.add_loss"),
        Feature("jit_compile_batchnorm_synchronized", lambda: batchnorm_model(True),
                basic_compile(jit_compile=True),
                summary="jit_compile=True, BatchNormalization(synchronized=True)"),
        Feature("mixed_bfloat16", mlp, basic_compile(),
                policy="mixed_bfloat16", atol=1e-2, rtol=1e-2,
                summary='set_global_policy("mixed_bfloat16"), tolerance 1e-2'),
        Feature("mixed_float16", mlp,
                lambda: dict(optimizer=keras.optimizers.LossScaleOptimizer(adam()), loss=scce()),
                policy="mixed_float16", atol=1e-2, rtol=1e-2,
                summary='set_global_policy("mixed_float16") + LossScaleOptimizer, tolerance 1e-2'),
        Feature("custom_train_step", custom_step_model,
                lambda: dict(optimizer=adam(), loss=scce()),
                summary="Model subclass overriding train_step with self.compute_loss"),
        Feature("subclassed_model", subclassed_model, basic_compile(),
                summary="subclassed keras.Model"),
        Feature("multi_input_output", two_input_two_output_model,
                lambda: dict(optimizer=adam(), loss=[scce(), "mse"],
                             metrics=[["accuracy"], ["mae"]]),
                data=two_inputs, summary="functional model, 2 inputs and 2 outputs (lists)"),
        Feature("frozen_layer", frozen_model, basic_compile(),
                summary="layer.trainable=False before compile"),
        Feature("nested_model", nested_model, basic_compile(),
                summary="a Sequential inside a functional model"),
        Feature("save_keras_load", mlp, basic_compile(), after=saved_and_loaded,
                summary="model.save(.keras), load_model outside the strategy predicts the same"),
        Feature("export_savedmodel", mlp, basic_compile(), after=exported_and_served,
                summary="model.export (SavedModel), tf.saved_model.load(...).serve"),
        Feature("custom_loop", mlp, lambda: dict(optimizer=adam(), loss=scce()),
                loop=custom_loop, epochs=2,
                summary="custom loop: strategy.run + apply_gradients, loss over the global "
                        "batch (tf.nn.compute_average_loss)"),
        Feature("custom_loop_accumulation", mlp,
                lambda: dict(optimizer=adam(gradient_accumulation_steps=2), loss=scce()),
                loop=custom_loop, epochs=2,
                summary="custom loop, optimizer gradient_accumulation_steps=2"),
        Feature("custom_loop_loss_scale", mlp,
                lambda: dict(optimizer=keras.optimizers.LossScaleOptimizer(adam()),
                             loss=scce()),
                loop=custom_loop, policy="mixed_float16", atol=1e-2, rtol=1e-2,
                summary='custom loop, set_global_policy("mixed_float16") + '
                        "LossScaleOptimizer (scale_loss), tolerance 1e-2"),
    ] + _recipe_features() + _optimizer_features()
    return {feature.name: feature for feature in f}


def sgd(**kwargs):
    return keras.optimizers.SGD(0.1, **kwargs)


def _recipe_features():
    """Recipes users train large models with, on data that differs across replicas."""
    return [
        Feature("clip_global_norm_one_replica", mlp,
                lambda: dict(optimizer=sgd(global_clipnorm=0.1), loss=scce()),
                data=replica_skewed,
                summary="SGD(global_clipnorm=0.1); one replica's part alone over the threshold"),
        Feature("clip_norm_one_replica", mlp,
                lambda: dict(optimizer=sgd(clipnorm=0.1), loss=scce()), data=replica_skewed,
                summary="SGD(clipnorm=0.1); one replica's part alone over the threshold"),
        Feature("clip_value_one_replica", mlp,
                lambda: dict(optimizer=sgd(clipvalue=0.02), loss=scce()), data=replica_skewed,
                summary="SGD(clipvalue=0.02); one replica's part alone over the threshold"),
        Feature("overflow_one_replica", relu_mlp,
                lambda: dict(optimizer=keras.optimizers.LossScaleOptimizer(sgd()), loss=scce()),
                data=overflowing_on_one_replica, policy="mixed_float16", atol=1e-2, rtol=1e-2,
                summary='mixed_float16 + LossScaleOptimizer; one replica\'s part of the first '
                        'batch overflows (one device skips the step), tolerance 1e-2'),
        Feature("adamw_recipe", mlp, lambda: dict(
                    optimizer=keras.optimizers.AdamW(
                        keras.optimizers.schedules.CosineDecay(
                            0.0, 4, warmup_target=0.02, warmup_steps=2),
                        weight_decay=0.1, global_clipnorm=1.0),
                    loss=scce()),
                data=replica_skewed, epochs=2,
                summary="AdamW(weight_decay=0.1, global_clipnorm=1.0), warmup then cosine decay"),
        Feature("custom_loop_clip", mlp,
                lambda: dict(optimizer=sgd(global_clipnorm=0.1), loss=scce()),
                loop=custom_loop, data=replica_skewed,
                summary="custom loop (apply_gradients in strategy.run), SGD(global_clipnorm=0.1), "
                        "one replica's part alone over the threshold"),
        Feature("masked_dense_sum", masked_dense_model,
                lambda: dict(optimizer=adam(), loss=scce(reduction="sum")), data=sequences,
                summary="Embedding(mask_zero=True) -> Dense -> Dense, per-step loss summed"),
        Feature("masked_dense_mean", masked_dense_model, basic_compile(), data=sequences,
                summary="Embedding(mask_zero=True) -> Dense -> Dense, per-step mean loss"),
        Feature("causal_attention", causal_attention_model, basic_compile(), data=sequences,
                batch_size=20,
                summary="Embedding(mask_zero=True) -> causal MultiHeadAttention -> Dense, "
                        "per-step mean loss; batches of 20 (the last 8)"),
        # The recipe on the model context parallelism splits: a sequence's later positions
        # are mostly padding, so its replicas' parts differ (cp3: replica 0 holds positions
        # 0 and 5, replica 2 positions 2 and 3).
        Feature("attention_recipe", causal_attention_model, lambda: dict(
                    optimizer=keras.optimizers.LossScaleOptimizer(_adamw(ATTENTION_CLIP)),
                    loss=scce()),
                data=sequences, batch_size=20, epochs=2, policy="mixed_float16",
                atol=1e-2, rtol=1e-2,
                summary="causal attention: mixed_float16 + LossScaleOptimizer(AdamW(weight_decay"
                        f"=0.1, global_clipnorm={ATTENTION_CLIP}), warmup then cosine decay), "
                        "padding masks, tolerance 1e-2"),
        Feature("jit_compile_recipe", causal_attention_model, lambda: dict(
                    optimizer=keras.optimizers.LossScaleOptimizer(_adamw(ATTENTION_CLIP)),
                    loss=scce(), jit_compile=True),
                data=sequences, batch_size=20, epochs=2, policy="mixed_float16",
                atol=1e-2, rtol=1e-2,
                summary="jit_compile=True, causal attention: mixed_float16 + "
                        "LossScaleOptimizer(AdamW(weight_decay=0.1, global_clipnorm="
                        f"{ATTENTION_CLIP}), warmup then cosine decay), padding masks, "
                        "tolerance 1e-2"),
        Feature("attention_custom_loop", causal_attention_model,
                lambda: dict(optimizer=_adamw(ATTENTION_CLIP), loss=scce()),
                loop=custom_loop, data=sequences, batch_size=20, epochs=2,
                summary="causal attention, custom loop (per-token losses over the global "
                        f"batch), AdamW(weight_decay=0.1, global_clipnorm={ATTENTION_CLIP})"),
    ]


# Below the attention model's first gradient norm (about 0.5), so the clip acts.
ATTENTION_CLIP = 0.1


def _adamw(global_clipnorm):
    schedule = keras.optimizers.schedules.CosineDecay(0.0, 4, warmup_target=0.02,
                                                      warmup_steps=2)
    return keras.optimizers.AdamW(schedule, weight_decay=0.1, global_clipnorm=global_clipnorm)


# Every argument of Keras' optimizer base class (`OPTIMIZER_BASE.__init__`) and every optimizer
# class in `keras.optimizers` has a row: the feature that trains with it (a row of its own, or
# an existing one). tests/conformance/test_optimizer_rows.py reads the installed Keras and
# fails on an argument or class without one.
OPTIMIZER_ARGUMENT_ROWS = {
    "learning_rate": "opt_learning_rate_schedule",
    "weight_decay": "opt_weight_decay",
    "clipnorm": "clip_norm_one_replica",
    "clipvalue": "clip_value_one_replica",
    "global_clipnorm": "clip_global_norm_one_replica",
    "use_ema": "opt_use_ema",
    "ema_momentum": "opt_ema_momentum",
    "ema_overwrite_frequency": "opt_ema_overwrite_frequency",
    "loss_scale_factor": "opt_loss_scale_factor",
    "gradient_accumulation_steps": "gradient_accumulation",
    "name": "opt_name",
}
OPTIMIZER_CLASS_ROWS = {
    "Adam": "loss_sum_over_batch_size", "LossScaleOptimizer": "mixed_float16",
    "SGD": "opt_SGD", "AdamW": "opt_AdamW", "Adadelta": "opt_Adadelta",
    "Adafactor": "opt_Adafactor", "Adagrad": "opt_Adagrad", "Adamax": "opt_Adamax",
    "Ftrl": "opt_Ftrl", "Lamb": "opt_Lamb", "Lion": "opt_Lion", "Nadam": "opt_Nadam",
    "RMSprop": "opt_RMSprop", "Muon": "opt_Muon", "ScheduleFreeAdamW": "opt_ScheduleFreeAdamW",
    "MultiOptimizer": "opt_MultiOptimizer",
}


def keras_before(release):
    """Whether the installed Keras is older than `release` ("3.13.0")."""
    from tfpar.keras import internals

    return internals.installed("keras") < internals.release(release)


def _optimizer(name, *args, **kwargs):
    return lambda: dict(optimizer=getattr(keras.optimizers, name)(*args, **kwargs), loss=scce())


def _multi_optimizer():
    return dict(optimizer=keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(
        adam(), {".*d1/.*": keras.optimizers.SGD(0.1)})), loss=scce())


def _optimizer_features():
    """One row per optimizer argument and class (`OPTIMIZER_ARGUMENT_ROWS`,
    `OPTIMIZER_CLASS_ROWS`) that has no row elsewhere; classes a Keras release lacks are
    left out there."""
    schedule = lambda: keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.5)  # noqa: E731
    rows = [
        ("opt_learning_rate_schedule", lambda: dict(optimizer=keras.optimizers.Adam(
            schedule()), loss=scce()), "Adam(ExponentialDecay(0.02, 2, 0.5))"),
        ("opt_weight_decay", lambda: dict(optimizer=adam(weight_decay=0.05), loss=scce()),
         "Adam(weight_decay=0.05)"),
        ("opt_use_ema", lambda: dict(optimizer=adam(use_ema=True), loss=scce()),
         "Adam(use_ema=True)"),
        ("opt_ema_momentum", lambda: dict(optimizer=adam(use_ema=True, ema_momentum=0.5),
                                          loss=scce()), "Adam(use_ema=True, ema_momentum=0.5)"),
        ("opt_ema_overwrite_frequency", lambda: dict(
            optimizer=adam(use_ema=True, ema_overwrite_frequency=2), loss=scce()),
         "Adam(use_ema=True, ema_overwrite_frequency=2)"),
        ("opt_loss_scale_factor", lambda: dict(optimizer=adam(loss_scale_factor=64.0),
                                               loss=scce()), "Adam(loss_scale_factor=64.0)"),
        ("opt_name", lambda: dict(optimizer=adam(name="renamed"), loss=scce()),
         'Adam(name="renamed")'),
        ("opt_SGD", _optimizer("SGD", 0.05, momentum=0.9, nesterov=True),
         "SGD(0.05, momentum=0.9, nesterov=True)"),
        ("opt_AdamW", _optimizer("AdamW", 0.01, weight_decay=0.1), "AdamW(weight_decay=0.1)"),
        ("opt_Adadelta", _optimizer("Adadelta", 1.0), "Adadelta(1.0)"),
        ("opt_Adafactor", _optimizer("Adafactor", 0.05), "Adafactor(0.05)"),
        ("opt_Adagrad", _optimizer("Adagrad", 0.1), "Adagrad(0.1)"),
        ("opt_Adamax", _optimizer("Adamax", 0.01), "Adamax(0.01)"),
        ("opt_Ftrl", _optimizer("Ftrl", 0.1), "Ftrl(0.1)"),
        ("opt_Lamb", _optimizer("Lamb", 0.01), "Lamb(0.01)"),
        ("opt_Lion", _optimizer("Lion", 0.001), "Lion(0.001)"),
        ("opt_Nadam", _optimizer("Nadam", 0.01), "Nadam(0.01)"),
        # epsilon 1e-3: with Keras' 1e-7 a gradient entry near 0 moves its weight by about
        # lr / sqrt(1 - rho) whatever its size, so its sign, which rounding in a different
        # order of sums can flip, decides the weight (ZeRO-3 failed 1 run of 2 here).
        ("opt_RMSprop", _optimizer("RMSprop", 0.01, epsilon=1e-3),
         "RMSprop(0.01, epsilon=1e-3)"),
        ("opt_Muon", _optimizer("Muon", 0.01), "Muon(0.01)"),
        ("opt_ScheduleFreeAdamW", _optimizer("ScheduleFreeAdamW", 0.01),
         "ScheduleFreeAdamW(0.01)"),
        ("opt_MultiOptimizer", _multi_optimizer,
         'MultiOptimizer(Adam, {"d1/.*": SGD(0.1)})'),
    ]
    known = set(dir(keras.optimizers))
    return [Feature(name, mlp, make, data=replica_skewed, summary=summary)
            for name, make, summary in rows
            if not name.startswith("opt_") or name[4:] not in OPTIMIZER_CLASS_ROWS
            or name[4:] in known]


FEATURES = {name: dataclasses.replace(feature, inference=False)
            if name in STEP_ONLY or name.startswith("opt_")
            else dataclasses.replace(feature, predicts=False) if name in BASE_OUTPUTS
            else feature
            for name, feature in _features().items()}
FEATURE_NAMES = list(FEATURES)


# --- Running a cell --------------------------------------------------------------------------

@dataclasses.dataclass
class Result:
    weights: list
    history: dict
    evaluate: dict
    predict: Any
    extras: dict
    names: list  # variable paths, in the order of `weights`


def _numpy(tree):
    return tf.nest.map_structure(lambda t: np.asarray(t), tree)


@contextlib.contextmanager
def _policy(name):
    if name is None:
        yield
        return
    keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _fit(model, feature, data, strategy=None, **extra):
    if feature.loop is not None:
        return feature.loop(model, strategy, feature, data)
    weights = data.sample_weight if data.fit_sample_weight is None else data.fit_sample_weight
    return model.fit(data.x, data.y, sample_weight=weights,
                     batch_size=feature.batch_size, epochs=feature.epochs, shuffle=False,
                     verbose=0, **{**feature.fit_kwargs, **extra}).history


def run(sid, feature, strategy=None):
    """Trains `feature` under strategy `sid` (None: one device) and returns a `Result`.

    An exception from the first fit gets two attributes: `iterations_run` (the optimizer's
    step counter) and `weights_unchanged` (the model still has its initial weights), to tell
    an error raised before the first step from one raised later.
    """
    if isinstance(feature, str):
        feature = FEATURES[feature]
    strategy = strategy if strategy is not None else make_strategy(sid)
    data = feature.data()

    def scope():
        return strategy.scope() if strategy is not None else contextlib.nullcontext()

    with _policy(feature.policy):
        with scope():
            keras.utils.set_random_seed(SEED)
            model = feature.build()
            model.compile(**feature.compile())
        initial = [np.array(w) for w in model.get_weights()]
        try:
            history = _fit(model, feature, data, strategy)
        except Exception as error:  # noqa: BLE001 - annotated and re-raised
            error.iterations_run = int(model.optimizer.iterations.numpy()) \
                if model.optimizer.built else 0
            error.weights_unchanged = all(
                np.array_equal(a, b) for a, b in zip(initial, model.get_weights()))
            raise
        if feature.recompile is not None:
            with scope():
                model.compile(**feature.recompile())
            second = _fit(model, feature, data)
            history = {key: history.get(key, []) + second.get(key, [])
                       for key in {**history, **second}}
        evaluate, predict = {}, None
        if infers(sid, feature):
            evaluate = model.evaluate(data.x, data.y, sample_weight=data.sample_weight,
                                      batch_size=feature.batch_size, verbose=0,
                                      return_dict=True)
            if feature.predicts:
                predict = model.predict(data.x, batch_size=feature.batch_size, verbose=0)
        extras = {}
        if feature.after is not None:
            with tempfile.TemporaryDirectory() as directory:
                extras = feature.after(model, data, directory)
        return Result(weights=[np.array(w) for w in model.get_weights()],
                      history={k: [np.asarray(e) for e in v] for k, v in history.items()},
                      evaluate={k: np.asarray(v) for k, v in evaluate.items()},
                      predict=None if predict is None else _numpy(predict),
                      extras=_numpy(extras),
                      names=[w.path for w in model.weights])


def _shared_path(name):
    # pytest-xdist gives its processes one run id: a reference one process computed is
    # read by the other instead of computed again.
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run_id:
        return None
    return os.path.join(tempfile.gettempdir(), f"tfpar-conformance-{run_id}", f"{name}.pkl")


@functools.lru_cache(maxsize=None)
def reference(name):
    """The one-device run of feature `name` (computed once per test run)."""
    path = _shared_path(name)
    if path is not None and os.path.exists(path):
        with open(path, "rb") as f:
            return pickle.load(f)
    result = run(None, FEATURES[name])
    if path is not None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.{os.getpid()}", "wb") as f:
            pickle.dump(result, f)
        os.replace(f"{path}.{os.getpid()}", path)  # Whole or absent for the other reader.
    return result


# --- Comparing -------------------------------------------------------------------------------

def _max_difference(got, want):
    got, want = np.asarray(got, dtype="float64"), np.asarray(want, dtype="float64")
    if got.shape != want.shape:
        return float("inf")
    return float(np.max(np.abs(got - want))) if got.size else 0.0


def differences(got, want):
    """{component: max absolute difference}: weights, each history key, each evaluate key,
    predict and the extras (inf when shapes or keys do not match)."""
    out = {}
    if len(got.weights) != len(want.weights):
        out["weights"] = float("inf")
    else:
        for name, g, w in zip(want.names, got.weights, want.weights):
            out[f"weight:{name}"] = _max_difference(g, w)
    for part in ("history", "evaluate"):
        mine, theirs = getattr(got, part), getattr(want, part)
        for key in set(mine) | set(theirs):
            out[f"{part}:{key}"] = (_max_difference(mine[key], theirs[key])
                                    if key in mine and key in theirs else float("inf"))
    out["predict"] = max(_tree_differences(got.predict, want.predict))
    for key in set(got.extras) | set(want.extras):
        out[f"extra:{key}"] = (max(_tree_differences(got.extras[key], want.extras[key]))
                               if key in got.extras and key in want.extras else float("inf"))
    return out


def _tree_differences(got, want):
    try:
        tf.nest.assert_same_structure(got, want)
    except (ValueError, TypeError):
        return [float("inf")]
    return [_max_difference(g, w) for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want))]


PARTS = ("weights", "history", "evaluate", "predict", "extras")


def failures(got, want, atol=ATOL, rtol=RTOL, parts=PARTS):
    """Components (of `parts`) that differ by more than atol + rtol x |reference|, with their
    largest difference (or what is wrong: missing, shape, structure, not finite)."""
    bad = {}
    pairs = []
    if "weights" in parts:
        pairs += [(f"weight:{n}", g, w) for n, g, w in zip(want.names, got.weights, want.weights)]
    for part in ("history", "evaluate"):
        if part in parts:
            mine, theirs = getattr(got, part), getattr(want, part)
            pairs += [(f"{part}:{k}", mine.get(k), theirs.get(k))
                      for k in set(mine) | set(theirs)]
    if "predict" in parts and not (got.predict is None and want.predict is None):
        pairs += [("predict", got.predict, want.predict)]
    if "extras" in parts:
        pairs += [(f"extra:{k}", got.extras.get(k), want.extras.get(k))
                  for k in set(got.extras) | set(want.extras)]
    if "weights" in parts and len(got.weights) != len(want.weights):
        bad["weights"] = f"{len(got.weights)} arrays, want {len(want.weights)}"
    for name, g, w in pairs:
        if g is None or w is None:
            bad[name] = "missing"
            continue
        try:
            tf.nest.assert_same_structure(g, w)
        except (ValueError, TypeError):
            bad[name] = "structure differs"
            continue
        for a, b in zip(tf.nest.flatten(g), tf.nest.flatten(w)):
            a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
            if a.shape != b.shape:
                bad[name] = f"shape {a.shape} != {b.shape}"
            elif not np.all(np.isfinite(a)):
                bad[name] = "not finite"
            elif not np.allclose(a, b, atol=atol, rtol=rtol):
                bad[name] = float(np.max(np.abs(a - b)))
    return bad


def evaluate_on_one_device(feature, weights):
    """`evaluate` and `predict` of `weights` in the feature's model on one device: tells a
    strategy's wrong evaluate/predict apart from wrong training."""
    if isinstance(feature, str):
        feature = FEATURES[feature]
    data = feature.data()
    with _policy(feature.policy):
        keras.utils.set_random_seed(SEED)
        model = feature.build()
        model.compile(**(feature.recompile or feature.compile)())
        model.set_weights(weights)
        evaluate = model.evaluate(data.x, data.y, sample_weight=data.sample_weight,
                                  batch_size=feature.batch_size, verbose=0, return_dict=True)
        predict = model.predict(data.x, batch_size=feature.batch_size, verbose=0)
    return {k: np.asarray(v) for k, v in evaluate.items()}, _numpy(predict)
