"""PipelineStrategy and the Keras a user writes: frozen layers, OnDevice, train_step overrides."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar.distribute.common.placed_call import canonical_device
from tfpar.distribute.pipeline import mirrored_placement

from conftest import call_loss_model, cpus


def test_frozen_layers_count_when_cutting_stages():
    """Balancing by trainable weights only put a frozen backbone entirely in stage 0."""
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)),
                                  keras.layers.Dense(64, trainable=False, name="frozen_a"),
                                  keras.layers.Dense(64, trainable=False, name="frozen_b"),
                                  keras.layers.Dense(64, trainable=False, name="frozen_c"),
                                  keras.layers.Dense(3, name="head")])
    assert strategy.stages(model) == [["frozen_a", "frozen_b"], ["frozen_c", "head"]]


def test_on_device_layer_keeps_its_variables_where_it_runs():
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=2)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(8, name="first")(inputs)
        hidden = keras.layers.Dense(8, name="second")(hidden)
        outputs = tfpar.layers.OnDevice(keras.layers.Dense(3, name="pinned"), "/cpu:0")(hidden)
        model = keras.Model(inputs, outputs)
        model.compile(keras.optimizers.SGD(0.1), "mse")
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    y = np.random.default_rng(1).normal(size=(16, 3)).astype("float32")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert strategy.stages(model)[1][-1] == model.layers[-1].name  # In stage 1 (on CPU:1),
    pinned = model.layers[-1].layer
    for variable in pinned.variables:  # but its variables stay on CPU:0, where it runs.
        assert mirrored_placement.devices_of(variable) == (canonical_device("/cpu:0"),)
    second = model.get_layer("second")
    assert mirrored_placement.devices_of(second.kernel) == (canonical_device("/cpu:1"),)


class OwnStep(keras.Model):
    def train_step(self, data):
        return super().train_step(data)


def test_a_model_overriding_train_step_is_refused_with_the_fix():
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=2)
    with strategy.scope():
        inputs = keras.Input((4,))
        model = OwnStep(inputs, keras.layers.Dense(3)(keras.layers.Dense(5)(inputs)))
        model.compile("sgd", "mse")
    x = np.zeros((8, 4), "float32")
    with pytest.raises(ValueError, match="overrides train_step.*compute_loss"):
        model.fit(x, np.zeros((8, 3), "float32"), batch_size=8, verbose=0)
    assert model.predict(x, verbose=0).shape == (8, 3)  # Inference is not affected.


def _aux_loss_model():
    return call_loss_model(width=6)


def test_losses_added_in_call_count_once_in_evaluate_and_custom_loops():
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    y = np.random.default_rng(1).normal(size=(16, 3)).astype("float32")
    reference = _aux_loss_model()
    reference.compile("sgd", "mse")
    want = reference.evaluate(x, y, batch_size=16, verbose=0)
    reference(x)
    want_losses = float(tf.add_n(reference.losses))
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=4)
    with strategy.scope():
        model = _aux_loss_model()
        model.compile("sgd", "mse")
    got = model.evaluate(x, y, batch_size=16, verbose=0)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    model(x)
    assert len(model.losses) == len(reference.losses)
    np.testing.assert_allclose(float(tf.add_n(model.losses)), want_losses, rtol=1e-5)


def _dense_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(3)])


def test_mean_with_sample_weight_is_weighted_by_sample_weights():
    """Micro-batches weighted by example counts are wrong for this reduction: each
    divides by its own sum of sample weights."""
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = np.random.default_rng(1).integers(0, 3, 32)
    weights = np.random.default_rng(2).uniform(0.1, 2.0, 32).astype("float32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                      reduction="mean_with_sample_weight")
    reference = _dense_model()
    reference.compile(keras.optimizers.SGD(0.5), loss)
    reference.fit(x, y, sample_weight=weights, batch_size=16, epochs=2, shuffle=False, verbose=0)
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=4)
    with strategy.scope():
        model = _dense_model()
        model.compile(keras.optimizers.SGD(0.5), loss)
    model.fit(x, y, sample_weight=weights, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_masked_mean_losses_are_refused_with_the_fix():
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Embedding(4, 3, mask_zero=True),
                                  keras.layers.SimpleRNN(4, return_sequences=True),
                                  keras.layers.Dense(2)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).integers(0, 4, (8, 5))
    with pytest.raises(ValueError, match="outputs are masked.*reduction='sum'"):
        model.fit(x, np.zeros((8, 5), "int32"), batch_size=8, verbose=0)


@keras.saving.register_keras_serializable("tfpar_tests")
class WeightedAuxLoss(keras.Model):
    """A custom compute_loss that weighs the losses layers add (model.losses) by 3."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = keras.ops.mean(keras.ops.square(y_pred - y))
        extra = [self._aggregate_additional_loss(l) for l in self.losses]
        return loss + 3.0 * keras.ops.sum(keras.ops.stack(extra)) if extra else loss


def _custom_loss_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="tanh",
                                activity_regularizer=keras.regularizers.L2(0.5))(inputs)
    hidden = keras.layers.Dense(8, activation="tanh")(hidden)
    hidden = keras.layers.Dense(8, activity_regularizer=keras.regularizers.L2(0.5))(hidden)
    return WeightedAuxLoss(inputs, keras.layers.Dense(3)(hidden))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_custom_compute_loss_trains_every_stage_on_the_losses_it_reads(schedule):
    """The earlier stages' activity-regularizer gradients were dropped (their losses were
    computed outside the last stage's tape)."""
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = np.random.default_rng(1).normal(size=(32, 3)).astype("float32")
    # SGD(0.02): before Keras 3.14 an activity regularizer is a sum over the batch, 16 times
    # stronger here, and at 0.2 the reference itself diverges (weights near 1e13).
    reference = _custom_loss_model()
    reference.compile(keras.optimizers.SGD(0.02))
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=4, schedule=schedule)
    with strategy.scope():
        model = _custom_loss_model()
        model.compile(keras.optimizers.SGD(0.02))
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert strategy.stages(model)[0][0] == model.layers[1].name
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make_strategy", [
    lambda: tfpar.PipelineStrategy(cpus(2), num_micro_batches=2),
    lambda: tfpar.ModelParallelStrategy(cpus(2)),
    lambda: tfpar.PipelineStrategy(cpus(4), num_micro_batches=2, num_replicas=2),
], ids=["pipeline", "model_parallel", "pipeline_2_replicas"])
def test_weight_gradients_are_never_copied_to_another_device(make_strategy):
    """Keras sums gradients over replicas through ReplicaContext.all_reduce, whose
    tf.custom_gradient put an IdentityN of every gradient on the replica's first device:
    across 2 processes, stage 0 held stage 1's gradients too (+192 MiB, measured). With 2
    replicas, each gradient's copy for the sum over replicas was made there too (across
    worker processes: every gradient to the chief and back). Only a stage's own devices
    (its copies in the replicas) may exchange its gradients."""
    width = 48
    strategy = make_strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((width,))]
                                 + [keras.layers.Dense(width, activation="tanh")
                                    for _ in range(4)])
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    x = np.random.default_rng(0).normal(size=(8, width)).astype("float32")
    model.fit(x, x, batch_size=8, epochs=1, verbose=0)  # Places and builds everything.

    @tf.function
    def step(x, y):
        return strategy.run(model.train_step, args=((x, y),))

    graph = step.get_concrete_function(tf.constant(x), tf.constant(x)).graph
    kernel_devices = {canonical_device(copy.device) for layer in model.layers
                      for copy in getattr(layer.kernel.value, "values", [layer.kernel.value])}
    assert len(kernel_devices) == 2 * strategy.num_replicas_in_sync  # Gradients on each.
    # A device's stage (model parallelism: each device its own).
    rows = getattr(strategy, "stage_devices", None) or [sorted(kernel_devices)]
    stage_of = {canonical_device(d): s for row in rows for s, d in enumerate(row)}
    crossings = [(t.op.name, op.name) for op in graph.get_operations() for t in op.inputs
                 if t.shape == (width, width) and t.dtype == tf.float32
                 and t.op.device and op.device
                 and canonical_device(t.op.device) != canonical_device(op.device)
                 and stage_of.get(canonical_device(t.op.device))
                 != stage_of.get(canonical_device(op.device))]
    assert crossings == []
