"""Born on their device (issue 14): under ModelParallelStrategy and PipelineStrategy no variable
(weight, optimizer slot, metric, random state) is ever created on a device of the strategy
other than the one it ends on; memory_limit is checked before anything is allocated."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar.distribute.common.placed_call import canonical_device
from tfpar.errors import PlacementError

from conftest import cpus

X = np.random.default_rng(0).normal(size=(32, 6)).astype("float32")
Y = np.random.default_rng(1).integers(0, 3, 32).astype("int32")
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class CreationLog:
    """A variable creator that records the storage of every variable created under it.

    Entered inside the strategy's scope, it runs before the strategy's creator and records
    what that returns: the final `tf.Variable`s, on the devices the strategy chose (a mirrored
    variable counts once per copy). Keeping them keeps their ids unique. (Copies that
    `mirrored_placement.move_copies` makes bypass creators; the copies they replace are seen.)
    """

    def __init__(self):
        self.created = []

    def __call__(self, next_creator, **kwargs):
        variable = next_creator(**kwargs)
        self.created.extend(storages(variable))
        return variable

    def on(self, devices):
        """The recorded storages created on any of `devices`."""
        devices = {canonical_device(d) for d in devices}
        return [s for s in self.created if canonical_device(s.device) in devices]


def storages(variable):
    """The `tf.Variable`s holding a Keras, TensorFlow or mirrored variable's values."""
    if isinstance(variable, keras.Variable):
        variable = variable.value
    if isinstance(variable, tf.distribute.DistributedValues):
        return list(variable.values)
    return [variable]


def final_storages(model):
    """Every storage the trained model, its optimizer and its metrics hold in the end."""
    variables = list(model.variables) + list(model.optimizer.variables)
    variables += [v for metric in model.metrics for v in metric.variables]
    return [s for v in variables for s in storages(v)]


def assert_born_where_they_live(log, devices, model):
    final = {id(s) for s in final_storages(model)}
    assert log.created, "the log recorded nothing"
    stray = [f"{s.name} on {s.device}" for s in log.on(devices) if id(s) not in final]
    assert not stray, (
        f"{len(stray)} variables were created on a strategy device they do not live on: "
        + ", ".join(stray[:6]))


def assert_slots_beside_their_variables(model):
    """Each optimizer slot lives where its variable does (Keras names a slot after the
    variable's path), and the optimizer has slots for every trainable variable."""
    owners = {v.path.replace("/", "_"): v for v in model.trainable_variables}
    slotted = set()
    for slot in model.optimizer.variables:
        owner = next((v for prefix, v in owners.items() if slot.name.startswith(prefix + "_")),
                     None)
        if owner is not None:
            slotted.add(id(owner))
            assert [s.device for s in storages(slot)] == [s.device for s in storages(owner)], (
                slot.name)
    assert slotted == {id(v) for v in model.trainable_variables}


def mlp(boundary=False, dropout=False, seed=0):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((6,)), keras.layers.Dense(16, activation="tanh", name="alpha"),
              keras.layers.BatchNormalization(name="norm")]
    if boundary:
        layers.append(tfpar.layers.StageBoundary(name="cut"))
    if dropout:
        layers.append(keras.layers.Dropout(0.2, name="drop"))
    layers += [keras.layers.Dense(8, activation="relu", name="beta"),
               keras.layers.Dense(3, name="gamma")]
    return keras.Sequential(layers, name="mlp")


@keras.saving.register_keras_serializable("tfpar_tests")
class Block(keras.layers.Layer):
    """A layer of layers without a build method: Keras builds it by tracing its call (its
    sub-layers' variables made without storage inside that trace)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(16, activation="relu")
        self.outer = keras.layers.Dense(16)

    def call(self, x):
        return self.outer(self.inner(x))


def functional():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="tanh", name="alpha")(inputs)
    hidden = Block(name="block")(hidden)
    hidden = tfpar.layers.OnDevice(keras.layers.Dense(16, name="delta"), "/cpu:1",
                                   name="pinned")(hidden)
    hidden = keras.layers.Dropout(0.2, name="drop")(hidden)
    hidden = keras.layers.Dense(8, activation="relu", name="beta")(hidden)
    return keras.Model(inputs, keras.layers.Dense(3, name="gamma")(hidden))


def train(strategy, make, before_fit=None):
    """Builds, compiles and fits `make()` under `strategy`, logging every variable created."""
    log = CreationLog()
    with strategy.scope(), tf.variable_creator_scope(log):
        model = make()
        model.compile(keras.optimizers.Adam(0.01), LOSS, metrics=["accuracy"])
        if before_fit is not None:
            before_fit(model)
        model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    return model, log


DICT = {"alpha": "/cpu:2", "norm": "/cpu:2", "drop": "/cpu:1", "beta": "/cpu:1",
        "gamma": "/cpu:0"}


@pytest.mark.parametrize("placement,devices,make", [
    (DICT, 3, lambda: mlp(dropout=True)),
    (lambda layer: {**DICT, "block": "/cpu:2"}[layer.name], 3, functional),
    ("balanced", 3, lambda: mlp(dropout=True)),   # a spare device (/cpu:3) exists
    ("balanced", 4, functional),                   # every device is the strategy's
], ids=["dict", "callable", "balanced", "balanced-all-devices"])
def test_model_parallel_variables_are_born_on_their_device(placement, devices, make):
    strategy = tfpar.ModelParallelStrategy(cpus(devices), placement=placement)
    model, log = train(strategy, make)
    assert_born_where_they_live(log, cpus(devices), model)
    placed = strategy.placement_report(model).placement
    first = canonical_device("/cpu:0")
    for layer in model.layers:
        for variable in layer.variables:
            assert storages(variable)[0].device == canonical_device(placed[layer.name])
    for metric in model.metrics:
        assert all(storages(v)[0].device == first for v in metric.variables), metric.name
    assert_slots_beside_their_variables(model)


def test_a_layer_used_outside_any_model_gets_its_variables_on_the_first_device():
    strategy = tfpar.ModelParallelStrategy(cpus(2))  # Balanced: its model would place it.
    with strategy.scope():
        layer = keras.layers.Dense(3)
        outputs = layer(X)
    assert layer.kernel.value.device == canonical_device("/cpu:0")
    np.testing.assert_allclose(outputs, X @ layer.kernel.numpy() + layer.bias.numpy(),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("replicas,boundary", [(1, True), (1, False), (2, False)],
                         ids=["markers", "balanced", "balanced-2-replicas"])
def test_pipeline_variables_are_born_on_their_stage_device(replicas, boundary):
    strategy = tfpar.PipelineStrategy(cpus(2 * replicas), num_micro_batches=2,
                                      num_replicas=replicas)
    model, log = train(strategy, lambda: mlp(boundary=boundary, dropout=True))
    assert_born_where_they_live(log, cpus(2 * replicas), model)
    stages = strategy.stages(model)
    for s, names in enumerate(stages):
        for name in names:
            for variable in model.get_layer(name).variables:
                assert [v.device for v in storages(variable)] == [
                    row[s] for row in strategy.stage_devices], (name, s)
    firsts = [row[0] for row in strategy.stage_devices]
    for metric in model.metrics:
        assert all([s.device for s in storages(v)] == firsts for v in metric.variables)
    assert_slots_beside_their_variables(model)


@pytest.mark.parametrize("how", ["load_weights", "checkpoint"])
def test_weights_loaded_before_the_first_step_go_straight_to_their_device(how, tmp_path):
    """Loading weights into a model not placed yet places it first: the weights are written
    where they live, not to copies that move later."""
    saved = mlp(seed=7)
    path = str(tmp_path / "w.weights.h5")
    saved.save_weights(path)
    checkpoint = tf.train.Checkpoint(model=saved).write(str(tmp_path / "ckpt"))
    loaded = []

    def load(model):
        if how == "load_weights":
            model.load_weights(path)
        else:
            tf.train.Checkpoint(model=model).read(checkpoint).expect_partial()
        loaded.append(model.get_layer("alpha").kernel.numpy())

    strategy = tfpar.ModelParallelStrategy(cpus(4), placement="balanced")
    model, log = train(strategy, mlp, before_fit=load)
    # Each load_weights makes a throwaway keras Optimizer(1.0) to list which attributes to
    # skip (Keras 3.15 never finds its cached list): Keras' own two scalars, not the model's.
    log.created = [s for s in log.created if not re.match(r"optimizer(_\d+)?/", s.name)]
    assert_born_where_they_live(log, cpus(4), model)
    np.testing.assert_array_equal(loaded[0], saved.get_layer("alpha").kernel.numpy())


def test_a_lazily_built_subclassed_model_is_born_on_its_devices():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.first = keras.layers.Dense(16, activation="tanh", name="alpha")
            self.second = keras.layers.Dense(3, name="gamma")

        def call(self, x):
            return self.second(self.first(x))

    strategy = tfpar.ModelParallelStrategy(
        cpus(2), placement=lambda layer: "/cpu:1" if layer.name == "alpha" else "/cpu:0")
    model, log = train(strategy, Net)
    assert_born_where_they_live(log, cpus(2), model)
    assert model.first.kernel.value.device == canonical_device("/cpu:1")


def test_timing_layers_runs_them_off_the_strategy_devices():
    """balance_by='time' runs each layer: its variables are made on a CPU the strategy does
    not use, timed there, and moved once to their device."""
    strategy = tfpar.ModelParallelStrategy(cpus(2), balance_by="time")
    model, log = train(strategy, mlp)
    assert_born_where_they_live(log, cpus(2), model)
    assert all(layer.time > 0 for layer in strategy.placement_report(model).layers)
    spare = canonical_device("/cpu:2")
    assert "mlp/alpha/kernel:0" in {s.name for s in log.created if s.device == spare}
    with pytest.raises(PlacementError, match="every CPU of this host.*balance_by='bytes'"):
        tfpar.ModelParallelStrategy(cpus(4), balance_by="time")


WIDE_X = np.random.default_rng(2).normal(size=(64, 256)).astype("float32")
WIDE_Y = np.random.default_rng(3).integers(0, 3, 64).astype("int32")


def dense_stack():
    """With Adam at batch 32: 803 KiB per 256-wide block, 2.4 MiB in all."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((256,))]
        + [keras.layers.Dense(256, activation="relu", name=f"block_{i}") for i in range(3)]
        + [keras.layers.Dense(3, name="head")], name="stack")


def test_a_model_too_big_for_one_device_is_placed_within_memory_limit_and_trains():
    limit = 1 << 20
    strategy = tfpar.ModelParallelStrategy(cpus(3), batch_size=32, memory_limit=limit)
    log = CreationLog()
    with strategy.scope(), tf.variable_creator_scope(log):
        model = dense_stack()
        model.compile(keras.optimizers.Adam(0.01), LOSS)
        model.fit(WIDE_X, WIDE_Y, batch_size=32, epochs=1, verbose=0)
    totals = strategy.placement_report(model).totals
    assert sum(t.bytes for t in totals.values()) > 2 * limit
    assert all(t.bytes <= limit for t in totals.values()), totals
    assert_born_where_they_live(log, cpus(3), model)
    moved = np.abs(model.get_layer("block_0").kernel.numpy()
                   - dense_stack().get_layer("block_0").kernel.numpy()).max()
    assert moved > 1e-4, "the model did not train"
    # On two devices it does not fit: the error says how many devices it needs.
    strategy = tfpar.ModelParallelStrategy(cpus(2), batch_size=32, memory_limit=limit)
    with strategy.scope():
        model = dense_stack()
    with pytest.raises(PlacementError, match=r"more than memory_limit=1\.0 MiB on /cpu:0 "
                       r"\(1\.6 MiB\)\. The model needs 2\.4 MiB in all, at least 3 devices"):
        strategy.placement_report(model)


def test_a_model_that_fits_nowhere_fails_before_anything_is_allocated():
    strategy = tfpar.ModelParallelStrategy(cpus(3), batch_size=32, memory_limit=512 << 10)
    message = (r"No placement fits memory_limit=512\.0 KiB: layer 'block_0' alone needs "
               r"803\.0 KiB \(weights 257\.0 KiB, optimizer state 514\.0 KiB, activations "
               r"32\.0 KiB\).*batch_size \(now 32\)")
    log = CreationLog()
    with strategy.scope(), tf.variable_creator_scope(log):
        model = dense_stack()
        with pytest.raises(PlacementError, match=message):
            model.predict(WIDE_X, verbose=0)
    assert log.on(cpus(3)) == []
    # Compiled first: compile made the optimizer's and the loss tracker's own scalars, on
    # the first device where they live; nothing of the model exists on any device.
    with strategy.scope(), tf.variable_creator_scope(log):
        model = dense_stack()
        model.compile(keras.optimizers.Adam(0.01), LOSS)
        with pytest.raises(PlacementError, match=message):
            model.fit(WIDE_X, WIDE_Y, batch_size=32, verbose=0)
    created = log.on(cpus(3))
    assert sorted(s.name.split("/")[-1] for s in created) == [
        "count:0", "iteration:0", "learning_rate:0", "total:0"]
    assert {s.device for s in created} == {canonical_device("/cpu:0")}
    assert all(s.shape == () for s in created)
