"""ModelParallelStrategy and OnDevice: equal numbers, ops on their layer's device,
balanced plans, save/load on one device, clear errors."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar.distribute.common.placed_call import placed_call
from tfpar.errors import DeviceError, PlacementError
from tfpar.keras.models import placement_units

from conftest import cpus, device_index, tf_functions_in, toy_data

BATCH = 16
NAMES = ("alpha", "beta", "gamma")
# Ops that do a layer's math, forward and backward (the backward of MatMul is MatMul).
COMPUTE_OPS = {"MatMul", "BiasAdd", "BiasAddGrad", "Tanh", "TanhGrad", "Relu", "ReluGrad",
               "Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter"}
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(16, activation="tanh", name="alpha"),
        keras.layers.Dense(8, activation="relu", name="beta"),
        keras.layers.Dense(3, name="gamma"),
    ])


class Subclassed(keras.Model):
    """Built lazily, on its first batch."""

    def __init__(self):
        super().__init__()
        self.first = keras.layers.Dense(16, activation="tanh", name="alpha")
        self.second = keras.layers.Dense(8, activation="relu", name="beta")
        self.third = keras.layers.Dense(3, name="gamma")

    def call(self, x):
        return self.third(self.second(self.first(x)))


def subclassed(seed=0):
    keras.utils.set_random_seed(seed)
    return Subclassed()


def convnet(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(4, 3, activation="relu", name="alpha"),
        keras.layers.Conv2D(4, 3, name="beta"),
        keras.layers.Flatten(name="flat"),
        keras.layers.Dense(3, name="gamma"),
    ])


def compiled(model):
    model.compile(keras.optimizers.Adam(0.01), LOSS)
    return model


def fit(model, x, y, epochs=2):
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model


def assert_weights_equal(got, want, atol=1e-5):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=atol, rtol=1e-5)


def graph_nodes(concrete_functions):
    """Every node of the functions' graphs, including nested (loop body) functions."""
    nodes = []
    for function in concrete_functions:
        graph_def = function.graph.as_graph_def()
        nodes += list(graph_def.node)
        nodes += [n for f in graph_def.library.function for n in f.node_def]
    return nodes


def layer_of(node_name, names):
    found = [n for n in names if re.search(rf"(^|/){n}(_\d+)?/", node_name)]
    return found[0] if len(found) == 1 else None


def assert_compute_on_layer_devices(nodes, expected):
    """Every compute op sits on its layer's device; each layer has forward and backward ops.

    Returns {layer: {op types seen}}.
    """
    seen = {name: {"forward": 0, "backward": 0, "types": set()} for name in expected}
    for node in nodes:
        if node.op not in COMPUTE_OPS:
            continue
        layer = layer_of(node.name, expected)
        assert layer is not None, f"op {node.name} ({node.op}) belongs to no layer"
        assert device_index(node.device) == expected[layer], (
            f"{node.op} {node.name} of layer {layer} is on {node.device!r}, "
            f"expected CPU:{expected[layer]}")
        seen[layer]["backward" if node.name.startswith("gradient_tape") else "forward"] += 1
        seen[layer]["types"].add(node.op)
    for layer, counts in seen.items():
        assert counts["forward"] >= 2 and counts["backward"] >= 3, (layer, counts)
    return {layer: counts["types"] for layer, counts in seen.items()}


def tape_step(model, optimizer):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


@pytest.fixture(scope="session")
def data():
    return toy_data(n=4 * BATCH)


@pytest.fixture(scope="session")
def fitted(data):
    """The MLP trained plainly and split over 3 devices (balanced), same start."""
    x, y = data
    reference = fit(compiled(mlp()), x, y)
    strategy = tfpar.ModelParallelStrategy(cpus(3))
    with strategy.scope():
        model = compiled(mlp())
    fit(model, x, y)
    return reference, strategy, model


# --- Numbers equal to the unplaced model ----------------------------------------------

def test_fit_weights_evaluate_predict_equal_unplaced(fitted, data):
    x, y = data
    reference, strategy, model = fitted
    moved = max(np.abs(a - b).max() for a, b in zip(reference.get_weights(), mlp().get_weights()))
    assert moved > 1e-3, "training did not change the weights"
    assert_weights_equal(model.get_weights(), reference.get_weights())
    np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0),
                               atol=1e-5)
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0),
                               reference.evaluate(x, y, verbose=0), atol=1e-5)
    # Balanced over 3 devices: one layer each. Variables and Adam's state are there too.
    expected = {"alpha": 0, "beta": 1, "gamma": 2}
    for layer in model.layers:
        for variable in layer.variables:
            assert device_index(variable.value.device) == expected[layer.name]
    slots = [v for v in model.optimizer.variables if "kernel" in v.path or "bias" in v.path]
    assert len(slots) == 12
    for slot in slots:
        layer = next(n for n in NAMES if f"_{n}_" in slot.path)
        assert device_index(slot.value.device) == expected[layer], slot.path


def test_outputs_loss_and_gradients_equal_unplaced_eager_and_traced(data):
    x, y = data
    reference = mlp()
    strategy = tfpar.ModelParallelStrategy(
        cpus(4), placement={"alpha": "/cpu:3", "beta": "/cpu:1", "gamma": "/cpu:2"})
    with strategy.scope():
        model = mlp()

    def loss_and_grads(m):
        with tf.GradientTape() as tape:
            logits = m(x)
            loss = LOSS(y, logits)
        return logits, loss, tape.gradient(loss, m.trainable_variables)

    want = loss_and_grads(reference)
    for got in (loss_and_grads(model), tf.function(loss_and_grads)(model)):
        np.testing.assert_allclose(got[0], want[0], atol=1e-5)
        np.testing.assert_allclose(got[1], want[1], atol=1e-6)
        assert_weights_equal([g.numpy() for g in got[2]], [g.numpy() for g in want[2]])
    assert [device_index(layer.kernel.value.device) for layer in model.layers] == [3, 1, 2]


# --- Every op of a layer on the layer's device ------------------------------------------

def test_fit_step_graph_has_forward_and_backward_on_layer_devices(fitted):
    _, _, model = fitted
    functions = tf_functions_in(model.train_function)
    assert functions, "no tf.function found in model.train_function"
    concrete = [c for f in functions for c in f._list_all_concrete_functions()]
    assert_compute_on_layer_devices(graph_nodes(concrete), {"alpha": 0, "beta": 1, "gamma": 2})


@pytest.mark.parametrize("make,op_types", [
    (mlp, {"MatMul", "BiasAddGrad"}),
    (convnet, {"Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "BiasAddGrad"})])
def test_user_tape_step_graph_on_layer_devices_and_equal(data, make, op_types):
    if make is convnet:
        x = np.random.default_rng(1).normal(size=(BATCH, 6, 6, 2)).astype("float32")
    else:
        x = data[0][:BATCH]
    y = data[1][:BATCH]
    names = [layer.name for layer in make().layers]
    # 'flat' (Flatten) has no weights and is placed like any other layer.
    placement = dict(zip(names, ["/cpu:2", "/cpu:0", "/cpu:1", "/cpu:3"]))
    strategy = tfpar.ModelParallelStrategy(cpus(4), placement=placement)
    with strategy.scope():
        model = make()
        optimizer = keras.optimizers.SGD(0.1)
    reference, reference_optimizer = make(), keras.optimizers.SGD(0.1)
    step, reference_step = tape_step(model, optimizer), tape_step(reference, reference_optimizer)
    for _ in range(3):
        np.testing.assert_allclose(step(x, y), reference_step(x, y), atol=1e-6)
    assert_weights_equal(model.get_weights(), reference.get_weights())

    expected = {name: device_index(placement[name]) for name in names}
    nodes = graph_nodes([step.get_concrete_function(x, y)])
    types = assert_compute_on_layer_devices(nodes, {n: expected[n] for n in NAMES})
    assert op_types <= types["beta"], types
    # Without placement, the backward of a tf.function carries no device at all.
    plain = [n for n in graph_nodes([reference_step.get_concrete_function(x, y)])
             if n.op in op_types and n.name.startswith("gradient_tape")]
    assert plain and all(n.device == "" for n in plain)


def test_lazily_built_subclassed_model_fit_moves_optimizer_state(data):
    x, y = data
    reference = fit(compiled(subclassed()), x, y)
    strategy = tfpar.ModelParallelStrategy(
        cpus(3), placement=lambda layer: {"alpha": "/cpu:2", "beta": "/cpu:0"}.get(
            layer.name, "/cpu:1"))
    with strategy.scope():
        model = compiled(subclassed())
    assert not model.built
    fit(model, x, y)
    assert_weights_equal(model.get_weights(), reference.get_weights())
    expected = {"alpha": 2, "beta": 0, "gamma": 1}
    # fit built the optimizer before the first step placed the model: its state moved.
    for variable in model.optimizer.variables:
        layer = next((n for n in NAMES if f"_{n}_" in variable.path), None)
        if layer:
            assert device_index(variable.value.device) == expected[layer], variable.path
    assert str(strategy.placement_report()).count("/cpu:") >= 6


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_embedding_batchnorm_dropout_model_fits_equal(run_eagerly):
    # Sparse (IndexedSlices) gradients, non-trainable state updated in the forward,
    # and a dropout seed generator, all moved to their layer's device.
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 50, size=(4 * BATCH, 6)).astype("int32"), rng.integers(0, 3, 4 * BATCH)

    def make():
        keras.utils.set_random_seed(0)
        return compiled(keras.Sequential([
            keras.Input((6,), dtype="int32"), keras.layers.Embedding(50, 8, name="emb"),
            keras.layers.Flatten(), keras.layers.Dense(16, name="alpha"),
            keras.layers.BatchNormalization(name="bn"), keras.layers.Dropout(0.3, name="drop"),
            keras.layers.Dense(3, name="gamma")]))

    reference = make()
    reference.run_eagerly = run_eagerly
    strategy = tfpar.ModelParallelStrategy(cpus(3))
    with strategy.scope():
        model = make()
    model.run_eagerly = run_eagerly
    fit(model, x, y, epochs=1)
    assert_weights_equal(model.get_weights(), fit(reference, x, y, epochs=1).get_weights())
    placement = strategy.placement_report().placement
    assert sorted(set(placement.values())) == cpus(3)
    for layer in model.layers:
        for variable in layer.variables:  # BatchNorm's moving stats, Dropout's seed too.
            assert device_index(variable.value.device) == device_index(placement[layer.name])


def test_nested_model_is_placed_by_its_layers(data):
    x = data[0][:BATCH]
    keras.utils.set_random_seed(3)
    inner = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, name="beta"),
                              keras.layers.Dense(8, name="gamma")], name="inner")
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2, name="delta")(inner(keras.layers.Dense(16, name="alpha")(
        inputs)))
    reference = keras.Model(inputs, outputs)
    weights = reference.get_weights()
    strategy = tfpar.ModelParallelStrategy(cpus(4), placement="balanced", balance_by="params")
    with strategy.scope():
        model = keras.models.clone_model(reference)
        model.set_weights(weights)
    assert [u.name for u in placement_units(model)] == ["alpha", "beta", "gamma", "delta"]
    np.testing.assert_allclose(model(x), reference(x), atol=1e-6)
    report = strategy.placement_report()
    assert list(report.placement.values()) == cpus(4)
    assert device_index(model.get_layer("inner").get_layer("gamma").kernel.value.device) == 2


# --- Balanced plans and the report ------------------------------------------------------

def test_model_over_budget_is_split_within_10_percent_of_even():
    keras.utils.set_random_seed(0)
    model_layers = [keras.Input((512,))] + [
        keras.layers.Dense(512, name=f"block_{i}") for i in range(8)] + [keras.layers.Dense(10)]
    budget = 8 << 20  # bytes per device
    strategy = tfpar.ModelParallelStrategy(cpus(4), batch_size=64, optimizer="adam",
                                           memory_limit=budget)
    with strategy.scope():
        model = keras.Sequential(model_layers)
    report = strategy.placement_report(model)
    totals = report.totals
    total = sum(t.bytes for t in totals.values())
    assert total > 3 * budget, "the model must not fit on one device"
    for device, t in totals.items():
        assert abs(t.bytes - total / 4) <= 0.10 * total / 4, (device, t)
        assert t.bytes <= budget
    assert report.imbalance <= 0.10
    text = str(report)
    assert "block_0" in text and "Per device" in text and "/cpu:3" in text
    # Params, weights, Adam's 2 slots and activations of a 512x512 layer at batch 64.
    first = report.layers[0]
    assert (first.params, first.weight_bytes, first.optimizer_bytes, first.activation_bytes) == (
        512 * 513, 4 * 512 * 513, 8 * 512 * 513, 4 * 512 * 64)
    # Placement happened: variables followed the plan.
    for layer in model.layers:
        assert layer.kernel.value.device.endswith(report.placement[layer.name][-1])


def test_budget_too_small_and_time_balance():
    keras.utils.set_random_seed(0)
    with pytest.raises(PlacementError, match="memory_limit"):
        strategy = tfpar.ModelParallelStrategy(cpus(2), memory_limit=1024)
        with strategy.scope():
            model = mlp()
        strategy.placement_report(model)
    strategy = tfpar.ModelParallelStrategy(cpus(2), balance_by="time")
    with strategy.scope():
        model = mlp()
    report = strategy.placement_report(model)
    assert all(layer.time > 0 for layer in report.layers)
    assert sorted(set(report.placement.values())) == cpus(2)


# --- Save and load ------------------------------------------------------------------------

def test_split_model_saves_and_loads_on_one_device(fitted, data, tmp_path):
    x, y = data
    reference, _, model = fitted
    want = model.predict(x, verbose=0)
    model.save(tmp_path / "m.keras")
    model.save_weights(tmp_path / "m.weights.h5")
    checkpoint = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))

    loaded = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), want, atol=1e-6)
    plain = mlp(seed=5)
    plain.load_weights(tmp_path / "m.weights.h5")
    np.testing.assert_allclose(plain.predict(x, verbose=0), want, atol=1e-6)
    plain = mlp(seed=6)
    status = tf.train.Checkpoint(model=plain).read(checkpoint)
    status.assert_existing_objects_matched().expect_partial()  # plain has no optimizer
    np.testing.assert_allclose(plain.predict(x, verbose=0), want, atol=1e-6)

    # Loaded under a strategy, the restored Adam state moves with its variables, and
    # training continues exactly as on one device.
    strategy = tfpar.ModelParallelStrategy(cpus(2), placement="balanced", balance_by="params")
    with strategy.scope():
        resumed = keras.models.load_model(tmp_path / "m.keras")
    fit(resumed, x, y, epochs=1)
    fit(loaded, x, y, epochs=1)
    assert_weights_equal(resumed.get_weights(), loaded.get_weights())
    devices = {device_index(v.value.device) for v in resumed.optimizer.variables
               if "momentum" in v.path}
    assert devices == {0, 1}


# --- OnDevice -----------------------------------------------------------------------------

def on_device_model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    hidden = tfpar.layers.OnDevice(keras.layers.Dense(16, activation="tanh", name="alpha"),
                                   "/cpu:1")(inputs)
    hidden = tfpar.layers.OnDevice(keras.layers.Dense(8, activation="relu", name="beta"),
                                   "/cpu:2")(hidden)
    return keras.Model(inputs, keras.layers.Dense(3, name="gamma")(hidden))


def test_on_device_places_variables_forward_and_backward(data, tmp_path):
    x, y = data[0][:BATCH], data[1][:BATCH]
    model, reference = on_device_model(), mlp()
    reference.set_weights(model.get_weights())
    wrapped = [layer for layer in model.layers if isinstance(layer, tfpar.layers.OnDevice)]
    assert [device_index(w.layer.kernel.value.device) for w in wrapped] == [1, 2]
    optimizer, reference_optimizer = keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)
    step, reference_step = tape_step(model, optimizer), tape_step(reference, reference_optimizer)
    for _ in range(2):
        np.testing.assert_allclose(step(x, y), reference_step(x, y), atol=1e-6)
    assert_weights_equal(model.get_weights(), reference.get_weights())
    nodes = [n for n in graph_nodes([step.get_concrete_function(x, y)]) if n.op in COMPUTE_OPS]
    for node in nodes:
        layer = layer_of(node.name, NAMES)
        if layer in ("alpha", "beta"):
            assert device_index(node.device) == {"alpha": 1, "beta": 2}[layer], node.name
    assert sum(n.name.startswith("gradient_tape") and layer_of(n.name, NAMES) == "alpha"
               and n.op == "MatMul" for n in nodes) == 2

    config = wrapped[0].get_config()
    assert config["device"] == "/cpu:1" and config["layer"]["config"]["units"] == 16
    clone = tfpar.layers.OnDevice.from_config(config)
    assert clone.device == "/cpu:1" and clone.layer.units == 16 and clone.layer is not wrapped[0]

    model.save(tmp_path / "on_device.keras")
    loaded = keras.models.load_model(tmp_path / "on_device.keras")
    np.testing.assert_allclose(loaded(x), model(x), atol=1e-6)
    assert device_index(loaded.layers[1].layer.kernel.value.device) == 1


def test_on_device_missing_device_on_load_warns_and_runs(data):
    config = on_device_model().layers[1].get_config()
    config["device"] = "/cpu:9"
    with pytest.warns(UserWarning, match="default device"):
        layer = tfpar.layers.OnDevice.from_config(config)
    assert layer(data[0][:2]).shape == (2, 16)
    with pytest.raises(DeviceError, match="does not exist"):
        tfpar.layers.OnDevice(keras.layers.Dense(2), "/cpu:9")


def test_on_device_under_data_parallel_equals_one_device(data):
    x, y = data
    reference = fit(compiled(on_device_model()), x, y, epochs=1)
    with tfpar.DataParallelStrategy(cpus(2)).scope():
        model = compiled(on_device_model())
    fit(model, x, y, epochs=1)
    assert_weights_equal(model.get_weights(), reference.get_weights())


def test_on_device_layer_keeps_its_device_under_the_strategy(data):
    strategy = tfpar.ModelParallelStrategy(cpus(3), placement={"gamma": "/cpu:0"})
    with strategy.scope():
        model = on_device_model()
    np.testing.assert_allclose(model(data[0][:4]), on_device_model()(data[0][:4]), atol=1e-6)
    placement = strategy.placement_report().placement
    assert placement["gamma"] == "/cpu:0"
    assert sorted(placement.values()) == ["/cpu:0", "/cpu:1", "/cpu:2"]


# --- Bad input ------------------------------------------------------------------------------

def test_bad_input_is_rejected_clearly():
    with pytest.raises(DeviceError, match="does not exist"):
        tfpar.ModelParallelStrategy(["/cpu:0", "/cpu:7"])
    with pytest.raises(PlacementError, match="placement must be"):
        tfpar.ModelParallelStrategy(cpus(2), placement="round_robin")
    with pytest.raises(PlacementError, match="balance_by"):
        tfpar.ModelParallelStrategy(cpus(2), balance_by="flops")

    def place(strategy):
        with strategy.scope():
            model = mlp()
        return strategy.placement_report(model)

    # A dict naming a layer that is not in the model.
    with pytest.raises(PlacementError, match="'alpa', which is not in the model.*'alpha'"):
        place(tfpar.ModelParallelStrategy(cpus(2), placement={
            "alpa": "/cpu:0", "beta": "/cpu:1", "gamma": "/cpu:1"}))
    # A dict that forgets a layer, or uses a device the strategy does not have.
    with pytest.raises(PlacementError, match="not placed: gamma"):
        place(tfpar.ModelParallelStrategy(cpus(2), placement={"alpha": "/cpu:0",
                                                              "beta": "/cpu:1"}))
    with pytest.raises(PlacementError, match="not one of the strategy's devices"):
        place(tfpar.ModelParallelStrategy(cpus(2), placement={
            "alpha": "/cpu:0", "beta": "/cpu:1", "gamma": "/cpu:3"}))
    # More devices than layers.
    with pytest.raises(PlacementError, match="Cannot place 3 layers on 4 devices"):
        place(tfpar.ModelParallelStrategy(cpus(4)))
    # A layer that cannot be placed: the placement function gives no device for it.
    with pytest.raises(PlacementError, match="'gamma' cannot be placed.*Received: None"):
        place(tfpar.ModelParallelStrategy(
            cpus(2), placement=lambda layer: None if layer.name == "gamma" else "/cpu:0"))
    # The same errors reach model.fit, before any step runs.
    strategy = tfpar.ModelParallelStrategy(cpus(2), placement={"alpha": "/cpu:0"})
    with strategy.scope():
        model = compiled(mlp())
    with pytest.raises(PlacementError, match="not placed: beta, gamma"):
        model.fit(*toy_data(n=BATCH), verbose=0)
    # Not built: layer sizes are unknown.
    strategy = tfpar.ModelParallelStrategy(cpus(2))
    with strategy.scope():
        model = subclassed()
    with pytest.raises(PlacementError, match="not built"):
        strategy.placement_report(model)
    with pytest.raises(PlacementError, match="No model has been placed"):
        strategy.placement_report()


def test_placed_call_on_plain_function_and_structures():
    w = tf.Variable(2.0)
    x, n = tf.constant([1.0, 3.0]), tf.constant(4)

    def fn(pair, scale=1.0):
        a, count = pair
        return {"y": a * w * scale, "count": count + 1, "none": None}

    with tf.GradientTape() as tape:
        tape.watch(x)
        out = placed_call(fn, "/cpu:1", (x, n), scale=3.0)
        loss = tf.reduce_sum(out["y"])
    assert out["none"] is None and int(out["count"]) == 5
    gx, gw = tape.gradient(loss, [x, w])
    np.testing.assert_allclose(gx, [6.0, 6.0])
    np.testing.assert_allclose(gw, 12.0)


@pytest.mark.parametrize("traced", [False, True])
def test_placed_call_of_one_tensor_passed_twice_gives_its_gradient_once(traced):
    """A self-attention's query and value are one tensor: its gradient is the sum of both
    uses, not twice that sum (the tape sees one source). A tensor-parallel attention run
    by heads passes its copy so (`head_split_call`)."""
    x = tf.constant([1.0, 3.0])

    def gradient():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = placed_call(lambda query, value: query * value * 2.0 + query, "/cpu:1",
                            x, value=x)
            loss = tf.reduce_sum(y)
        return tape.gradient(loss, x)

    got = tf.function(gradient)() if traced else gradient()
    np.testing.assert_allclose(got, 4.0 * x.numpy() + 1.0)


def test_model_call_hook_installs_once_and_ignores_other_models():
    from tfpar.keras import hooks as keras_seam

    keras_seam.install_model_call_hook()
    hook = keras.Model.__call__
    keras_seam.install_model_call_hook()
    assert keras.Model.__call__ is hook and hook._tfpar_model_call_hook
    model = mlp()  # no strategy: called as usual, never placed
    assert model(np.zeros((1, 4), "float32")).shape == (1, 3)
    assert getattr(model, "_tfpar_placed_by", None) is None
    assert model.layers[0].kernel.value.device.endswith("CPU:0")
