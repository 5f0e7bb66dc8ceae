"""keras.distribution on the TensorFlow backend (tfpar.use_keras_distribution, MeshStrategy).

Each program here is written as a user of Keras' distribution API writes it (list_devices,
DeviceMesh, LayoutMap with regex keys, set_distribution, then build, compile, fit), with
only the tfpar line added; every result is compared with the same program on one device.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfpar

HERE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
ATOL = 1e-5
# The heads output logits. (Read as probabilities, outputs that sum to near 0 made the loss
# so ill-conditioned that a mesh's float rounding grew to 1e-3 in the weights in 3 epochs.)
LOGITS_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(autouse=True)
def no_distribution_left_set():
    tfpar.use_keras_distribution()
    yield
    keras.distribution.set_distribution(None)


def _data(n=48, features=8, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, features)).astype("float32"),
            rng.integers(0, classes, n).astype("int32"))


def _mlp():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(16, activation="relu", name="dense_up"),
                              keras.layers.Dense(8, activation="tanh", name="dense_down"),
                              keras.layers.Dense(4, name="head")])
    model.compile(keras.optimizers.Adam(0.01), LOGITS_LOSS,
                  metrics=["accuracy"])
    return model


def _train(build, x, y, epochs=2, batch_size=16):
    model = build()
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, shuffle=False)
    return (model, history.history, model.evaluate(x, y, batch_size=batch_size, verbose=0),
            model.predict(x, batch_size=batch_size, verbose=0))


def _assert_same_run(got, want):
    model, history, evaluate, predict = got
    for a, b in zip(model.get_weights(), want[0].get_weights()):
        np.testing.assert_allclose(a, b, atol=ATOL)
    for key in want[1]:
        np.testing.assert_allclose(history[key], want[1][key], atol=ATOL, err_msg=key)
    np.testing.assert_allclose(evaluate, want[2], atol=ATOL)
    np.testing.assert_allclose(predict, want[3], atol=ATOL)


@pytest.fixture(scope="session")
def one_device_mlp():
    return _train(_mlp, *_data())


@pytest.mark.parametrize("n", [2, 4])
def test_the_guides_data_parallel_and_model_parallel_run_on_tensorflow(one_device_mlp, n):
    """The keras-io guide's two parts, on n logical CPUs: DataParallel over the devices,
    then ModelParallel with a LayoutMap of regex keys on a (n/2, 2) mesh."""
    x, y = _data()
    devices = keras.distribution.list_devices()[:n]
    assert len(devices) == n and keras.distribution.get_device_count("cpu") >= n

    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    _assert_same_run(_train(_mlp, x, y), one_device_mlp)

    mesh = keras.distribution.DeviceMesh((n // 2, 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense_up/kernel"] = (None, "model")
    layout_map[".*dense_up/bias"] = ("model",)
    layout_map[".*dense_down/ker.*"] = ("model", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    got = _train(_mlp, x, y)
    _assert_same_run(got, one_device_mlp)
    # Each device holds its piece of the split kernels, and only that.
    model = got[0]
    up = model.get_layer("dense_up").kernel.value
    pieces = dtensor.unpack(up.read_value())
    assert [tuple(p.shape) for p in pieces] == [(8, 8)] * n
    assert [p.device for p in pieces] == [
        f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(n)]
    columns = [model.get_layer("dense_up").kernel.numpy()[:, k * 8:(k + 1) * 8]
               for k in (0, 1)]
    for index, piece in enumerate(pieces):
        np.testing.assert_array_equal(piece.numpy(), columns[index % 2])
    assert [tuple(p.shape) for p in dtensor.unpack(
        model.get_layer("dense_down").kernel.value.read_value())] == [(8, 8)] * n
    # Adam's moments take their variable's layout (Keras passes it).
    moments = [v for v in model.optimizer.variables if "dense_up_kernel" in v.path]
    assert moments and all(v._layout.axes == (None, "model") for v in moments)
    assert all(tuple(p.shape) == (8, 8)
               for v in moments for p in dtensor.unpack(v.value.read_value()))


def _block(heads=2, hidden=8, ff=16, classes=4, steps=6):
    """A transformer block (self-attention, then a Megatron MLP, each with a residual and
    LayerNorm), mean-pooled into a classifier head."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((steps, hidden))
    # (No attention biases: the key bias has no gradient, mathematically, and Adam blows
    # its rounding noise up to steps of the learning rate's size, on one device too.)
    attention = keras.layers.MultiHeadAttention(heads, hidden // heads, use_bias=False,
                                                name="attention")
    x = keras.layers.LayerNormalization(name="norm_1")(inputs + attention(inputs, inputs))
    h = keras.layers.Dense(ff, activation="gelu", name="mlp_up")(x)
    x = keras.layers.LayerNormalization(name="norm_2")(x + keras.layers.Dense(
        hidden, name="mlp_down")(h))
    outputs = keras.layers.Dense(classes, name="head")(keras.layers.GlobalAveragePooling1D()(x))
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(0.01), LOGITS_LOSS)
    return model


def _block_layouts(mesh):
    layout_map = keras.distribution.LayoutMap(mesh)
    # MultiHeadAttention's kernels: (hidden, heads, head size) in, (heads, head size,
    # hidden) out: split by heads, then rows.
    layout_map["attention/(query|key|value)/kernel"] = (None, "model", None)
    layout_map["attention/attention_output/kernel"] = ("model", None, None)
    layout_map["mlp_up/kernel"] = (None, "model")
    layout_map["mlp_up/bias"] = ("model",)
    layout_map["mlp_down/kernel"] = ("model", None)
    return layout_map


def _sequences(n=48, steps=6, hidden=8):
    rng = np.random.default_rng(1)
    return (rng.normal(size=(n, steps, hidden)).astype("float32"),
            rng.integers(0, 4, n).astype("int32"))


@pytest.fixture(scope="session")
def one_device_block():
    x, y = _sequences()
    model = _block()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)  # 3 steps of Adam.
    return model.get_weights()


@pytest.mark.parametrize("shape", [(1, 2), (2, 1), (2, 2)])
def test_a_transformer_block_trains_as_on_one_device(one_device_block, shape):
    """Heads and MLP split over "model", the batch over "batch": weights after 3 steps
    of fit with Adam equal one device's."""
    x, y = _sequences()
    devices = keras.distribution.list_devices()[:shape[0] * shape[1]]
    mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices)
    strategy = tfpar.MeshStrategy(mesh, _block_layouts(mesh))
    assert strategy.num_replicas_in_sync == shape[0]
    with strategy.scope():
        model = _block()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert int(model.optimizer.iterations.numpy()) == 3
    for got, want in zip(model.get_weights(), one_device_block):
        np.testing.assert_allclose(got, want, atol=ATOL)
    report = strategy.sharding_report(model)
    split = shape[1] == 2  # (A model axis of one device splits nothing.)
    assert f"layer mlp_up: {'column' if split else 'replicated'}" in report
    assert f"mlp_down: {'row' if split else 'replicated'}" in report
    assert "head: replicated" in report
    if split:
        assert "(8, 2, 4)" in report and "(8, 1, 4)" in report  # query kernel, its piece


def test_checkpoints_hold_whole_weights_and_load_on_one_device_and_on_a_mesh(tmp_path):
    x, y = _data()
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
                                         keras.distribution.list_devices()[:4])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense_up/kernel"] = (None, "model")
    strategy = tfpar.MeshStrategy(mesh, layout_map)
    with strategy.scope():
        model = _mlp()
    model.fit(x, y, batch_size=16, verbose=0)
    path = str(tmp_path / "mesh.weights.h5")
    model.save_weights(path)
    one_device = _mlp()
    one_device.load_weights(path)
    for a, b in zip(one_device.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(one_device.predict(x, verbose=0), model.predict(x, verbose=0),
                               atol=ATOL)
    with strategy.scope():
        again = _mlp()
    again.load_weights(path)
    for a, b in zip(again.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert len(dtensor.unpack(again.get_layer("dense_up").kernel.value.read_value())) == 4


def test_layouts_that_do_not_fit_are_refused_before_anything_is_made():
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"],
                                         keras.distribution.list_devices()[:2])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*head/kernel"] = (None, "model")  # 4 outputs split in 2: fine.
    with pytest.raises(ValueError, match="Invalid axis names for Layout"):  # (Keras' check.)
        layout_map[".*dense_down/kernel"] = (None, "seq")
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense_up/kernel"] = ("model", None)
    with tfpar.MeshStrategy(mesh, layout_map).scope():
        keras.utils.set_random_seed(0)
        with pytest.raises(ValueError, match="size 3\\) does not split into 2 equal parts"):
            keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="dense_up")])
    with pytest.raises(ValueError, match="keras.distribution.DeviceMesh"):
        tfpar.MeshStrategy((1, 2))
    with pytest.raises(ValueError, match="runs in one process"):
        keras.distribution.initialize("127.0.0.1:1234,127.0.0.1:1235", 2, 0)


def test_jit_compile_is_refused_clearly():
    x, y = _data()
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"],
                                         keras.distribution.list_devices()[:2])
    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(mesh)))
    model = _mlp()
    model.compile("sgd", "sparse_categorical_crossentropy", jit_compile=True)
    with pytest.raises(ValueError, match="jit_compile=True is not supported"):
        model.fit(x, y, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_a_partial_last_batch_and_steps_per_execution_match_one_device():
    """38 examples in batches of 16 (the last one of 6, which does not split over 4
    replicas), 2 steps per execution (the last execution runs one): under DataParallel
    (tfpar.DataParallelStrategy) and on a tensor-parallel mesh (tfpar's own step loop)."""
    x, y = _data(n=38)

    def build():
        model = _mlp()
        model.compile(keras.optimizers.SGD(0.1), LOGITS_LOSS,
                      metrics=["accuracy"], steps_per_execution=2)
        return model

    want = _train(build, x, y)
    mesh = keras.distribution.DeviceMesh((4,), ["batch"], keras.distribution.list_devices()[:4])
    keras.distribution.set_distribution(keras.distribution.DataParallel(device_mesh=mesh))
    _assert_same_run(_train(build, x, y), want)
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"],
                                         keras.distribution.list_devices()[:2])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense_up/kernel"] = (None, "model")
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    _assert_same_run(_train(build, x, y), want)


class _LayoutProbe(keras.layers.Layer):
    """Records the DTensor layout of what it is given, when that is a DTensor."""

    seen = []

    def call(self, x):
        if tf.executing_eagerly() and dtensor.is_dtensor(x):
            _LayoutProbe.seen.append(tuple(dtensor.fetch_layout(x).sharding_specs))
        return x


def test_keras_distribute_tensor_and_output_layouts():
    """`keras.distribution.distribute_tensor` places a tensor on the mesh as its layout
    says (each device its piece); a layer output named in the LayoutMap (a "<layer>/output"
    key) is laid out so in a call, and the model trains as on one device."""
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"],
                                         keras.distribution.list_devices()[:2])
    layout = keras.distribution.TensorLayout([None, "model"], mesh)
    value = tf.reshape(tf.range(8.0), (2, 4))
    placed = keras.distribution.distribute_tensor(value, layout)
    pieces = dtensor.unpack(placed)
    assert [p.device for p in pieces] == tfpar.distribute.mesh.mesh_runtime.mesh_devices(mesh)
    np.testing.assert_array_equal(np.concatenate([p.numpy() for p in pieces], axis=1), value)

    def probed(output_axes):
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*dense_up/kernel"] = (None, "model")
        if output_axes:
            layout_map[".*dense_up/output"] = output_axes
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map))
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="dense_up"),
                                  _LayoutProbe(), keras.layers.Dense(4, name="head")])
        _LayoutProbe.seen.clear()
        out = model(_data()[0][:4])
        keras.distribution.set_distribution(None)
        return out, list(_LayoutProbe.seen)

    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(4)])
    want = plain(_data()[0][:4])
    for axes in [None, ("model", None)]:
        out, seen = probed(axes)
        np.testing.assert_allclose(out, want, atol=ATOL)
        assert seen == [tuple(a or dtensor.UNSHARDED for a in axes or (None, "model"))], seen

    x, y = _data()
    want = _train(_mlp, x, y, epochs=1)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense_up/kernel"] = (None, "model")
    layout_map[".*dense_up/output"] = ("batch", None)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    _assert_same_run(_train(_mlp, x, y, epochs=1), want)


def test_a_model_on_a_2d_mesh_called_eagerly_computes_on_the_mesh():
    """`model(x)` outside fit, as on JAX: on a (2, 2) mesh the batch is split over the data
    axis (the first layer sees it so), and the whole output equals one device's."""
    x = _data()[0][:8]
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(4)])
    want = plain(x)
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
                                         keras.distribution.list_devices()[:4])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*up/kernel"] = (None, "model")
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), _LayoutProbe(),
                              keras.layers.Dense(16, name="up"), keras.layers.Dense(4)])
    _LayoutProbe.seen.clear()
    got = model(x)
    assert _LayoutProbe.seen == [("batch", dtensor.UNSHARDED)], _LayoutProbe.seen
    assert not dtensor.is_dtensor(got)
    np.testing.assert_allclose(got, want, atol=ATOL)


_COLLECTIVE = re.compile(r"CollectiveReduceV2 group_size (\d+) group_key (\d+) .*"
                         r"shape \[([\d,]*)\] device .*device:CPU:(\d+)")


_LAUNCH = re.compile(r"Collective ExecuteAsync start for (?:tf.StatefulPartitionedCall/)?"
                     r"(\S+?)/(?:MatMul|GatherV2)/\S*?(AllReduce|AllGather)\S*: .*device:CPU:(\d+)")


def _collectives_by_phase(*meshes):
    """{(mesh, phase): [(group key, shape, device)]} of the all-reduces TensorFlow logs
    launching while `tests/workers/mesh_collectives.py` trains an MLP block on `meshes`."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="collective_ops=1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get(
                   "PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, os.path.join(HERE, "workers", "mesh_collectives.py"),
                           *meshes], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    found, phase = {}, None
    for line in (done.stdout + done.stderr).splitlines():
        if line.startswith("PHASE "):
            phase = tuple(line.split()[1:])
            found[phase] = []
        elif phase and phase[0] == "gemma":
            if match := _LAUNCH.search(line):
                found[phase].append(match.groups())  # (layer path, kind, device)
        elif phase and (match := _COLLECTIVE.search(line)):
            _, key, shape, device = match.groups()
            found[phase].append((int(key), tuple(int(n) for n in shape.split(",") if n),
                                 int(device)))
    return found


def _groups(collectives):
    """The sets of devices that reduced together."""
    groups = {}
    for key, _, device in collectives:
        groups.setdefault(key, set()).add(device)
    return sorted(sorted(g) for g in groups.values())


@pytest.mark.slow
@pytest.mark.one_process
def test_collectives_of_an_mlp_block_on_tensor_data_and_2d_meshes():
    """Read from the collectives TensorFlow runs (its log of each launch: group, shape,
    device), in a process of its own, for a column- then row-parallel block and a batch of
    16 rows:
    - (1, 2) tensor parallel: a forward pass launches one all-reduce per device, a
      training step one more (the input gradient);
    - (2, 1) data parallel: the forward pass none; a training step reduces every gradient
      (624 parameters) across the two devices;
    - (2, 2): forward all-reduces over the model axis only ({0, 1}, {2, 3}) of 8-row
      activations, i.e. each data replica computes half the batch; a training step adds
      the gradient reduction over the data axis only ({0, 2}, {1, 3})."""
    found = _collectives_by_phase("2,2", "1,2", "2,1", "gemma")
    # keras-hub's Gemma under its own layout map, one forward pass: per decoder block and
    # device one all-reduce after its MLP (ffw_linear, row parallel) and one after its
    # attention (attention_output); the vocabulary-split embedding is all-gathered.
    gemma = sorted(found.pop(("gemma", "forward")))
    found = {k: v for k, v in found.items() if k[0] != "gemma"}
    expected = [(f"gemma_backbone_1/decoder_block_{b}_1/{path}", "AllReduce", str(d))
                for b in range(2) for path in ("attention_1/attention_output_1", "ffw_linear_1")
                for d in range(2)]
    expected += [("gemma_backbone_1/token_embedding_1", "AllGather", str(d)) for d in range(2)]
    assert gemma == sorted(expected), gemma
    # DTensor's group keys stay clear of 1..2047, where stock strategies number their
    # groups (a clash aborts both): the (2, 2) mesh comes first in its process, whose
    # first partition into groups would otherwise take keys 0 and 1.
    keys = {key for collectives in found.values() for key, _, _ in collectives}
    assert keys and not keys & set(range(1, 2048)), sorted(keys)
    assert len(found[("1,2", "forward")]) == 2 and len(found[("1,2", "train")]) == 4, found
    assert found[("1,2", "end")] == [] and found[("2,1", "forward")] == [], found
    data = found[("2,1", "train")]
    assert _groups(data) == [[0, 1]], data
    for device in (0, 1):
        assert sum(int(np.prod(s)) for _, s, d in data if d == device) >= 8 * 8 + 8 + 8 * 32 \
            + 32 + 32 * 8 + 8, data
    forward = found[("2,2", "forward")]
    assert _groups(forward) == [[0, 1], [2, 3]], forward
    assert {s for _, s, _ in forward} == {(8, 8)}, forward
    train = found[("2,2", "train")]
    model_axis = [c for c in train if c[1] == (8, 8)]
    assert len(model_axis) == 8 and _groups(model_axis) == [[0, 1], [2, 3]], train
    assert _groups([c for c in train if c[1] != (8, 8)]) == [[0, 2], [1, 3]], train


def _gemma(vocab=32, hidden=16, heads=2):
    import keras_hub

    keras.utils.set_random_seed(0)
    return keras_hub.models.GemmaBackbone(
        vocabulary_size=vocab, num_layers=2, num_query_heads=heads, num_key_value_heads=heads,
        hidden_dim=hidden, intermediate_dim=32, head_dim=8)


def test_a_keras_hub_gemma_trains_under_its_own_layout_map():
    """keras-hub's GemmaBackbone from a small config (nothing downloaded), laid out by its
    own `get_layout_map` on a (1, 2) mesh: logits and gradients equal the unsharded
    model's (1e-4), each device holds half of every split kernel, and fit trains it."""
    pytest.importorskip("keras_hub", reason="a test dependency: pip install -e '.[test]'")
    import keras_hub

    rng = np.random.default_rng(0)
    inputs = {"token_ids": rng.integers(1, 32, (4, 6)).astype("int32"),
              "padding_mask": np.ones((4, 6), "int32")}

    def logits_and_gradients(model):
        with tf.GradientTape() as tape:
            hidden = model(inputs)
            logits = model.token_embedding(hidden, reverse=True)
            loss = tf.reduce_mean(tf.square(logits))
        grads = tape.gradient(loss, [v.value for v in model.trainable_variables])
        return logits, grads

    one_device = _gemma()
    want_logits, want_grads = logits_and_gradients(one_device)
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"],
                                         keras.distribution.list_devices()[:2])
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    model = _gemma()
    strategy = tfpar.MeshStrategy(mesh, layout_map)
    runtime = strategy.runtime
    # The report says what the collective log shows (test_collectives_...): the
    # vocabulary-split table is gathered, the MLP's down projection is row parallel.
    report = strategy.sharding_report(model)
    assert "layer token_embedding: gathered" in report, report
    for layer, mode in [("ffw_gating", "column"), ("ffw_linear", "row"),
                        ("attention/query", "column"), ("attention/attention_output", "row")]:
        assert f"layer decoder_block_1/{layer}: {mode}\n" in report, report
    logits, grads = tf.function(logits_and_gradients)(model)
    np.testing.assert_allclose(runtime.whole(logits), want_logits, atol=1e-4)
    for got, want, v in zip(grads, want_grads, model.trainable_variables):
        np.testing.assert_allclose(runtime.whole(got), want, atol=1e-4, err_msg=v.path)
    split = [v for v in model.weights if "model" in v.value._tfpar_axes]
    assert {v.path.split("/")[-2] for v in split} >= {
        "token_embedding", "query", "key", "value",
        "attention_output", "ffw_gating", "ffw_gating_2", "ffw_linear"}
    for v in split:
        pieces = dtensor.unpack(v.value.read_value())
        assert all(p.shape.num_elements() * 2 == v.shape.num_elements() for p in pieces), v.path
    causal = keras_hub.models.GemmaCausalLM(backbone=model, preprocessor=None)
    causal.compile(keras.optimizers.Adam(1e-3), LOGITS_LOSS)
    history = causal.fit(inputs, rng.integers(0, 32, (4, 6)), batch_size=4, epochs=3,
                         verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_docstring_examples_run():
    import doctest

    from tfpar.distribute.mesh import mesh_runtime as mesh, mesh_strategy
    from tfpar.keras import keras_distribution as keras_mesh

    for module in (mesh, mesh_strategy, keras_mesh):
        result = doctest.testmod(module)
        assert result.attempted and not result.failed, module.__name__


def test_a_layout_without_a_mesh_keeps_keras_error_text():
    """Keras' own distribution_lib test checks this text (its backends raise it)."""
    from keras.src.backend.tensorflow import distribution_lib as backend

    layout = keras.distribution.TensorLayout(["data", None], device_mesh=None)
    with pytest.raises(ValueError, match="Cannot create sharding when device mesh is not set"):
        backend._to_backend_layout(layout)
    with pytest.raises(ValueError, match="Cannot create sharding when device mesh is not set"):
        keras.distribution.distribute_tensor(tf.ones((2, 2)), layout)


def test_a_layer_made_on_a_mesh_in_a_model_made_off_it_is_refused_clearly():
    """A Dropout made under a ModelParallel distribution (its seed state on the mesh), in
    a model made after set_distribution(None): refused before any step, naming the layer;
    made after the distribution is unset, the same model trains as on one device."""
    x, y = _data()
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"],
                                         keras.distribution.list_devices()[:2])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense_up/kernel"] = (None, "model")

    def build(dropout):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="dense_up"),
                                  dropout, keras.layers.Dense(4, name="head")])
        model.compile(keras.optimizers.SGD(0.1), LOGITS_LOSS)
        return model

    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    stray = keras.layers.Dropout(0.5, seed=1, name="stray_dropout")
    keras.distribution.set_distribution(None)
    model = build(stray)
    for run in (lambda: model.fit(x, y, batch_size=16, verbose=0),
                lambda: model.evaluate(x, y, batch_size=16, verbose=0),
                lambda: model.predict(x, batch_size=16, verbose=0)):
        with pytest.raises(ValueError, match="Layer 'stray_dropout' holds .*seed_generator_"
                                             ".*on a device mesh.*set_distribution\\(None\\)"):
            run()
    assert int(model.optimizer.iterations.numpy()) == 0
    loss = build(keras.layers.Dropout(0.5, seed=1)).fit(x, y, batch_size=16, verbose=0)
    assert np.isfinite(loss.history["loss"][0])


def test_keras_distribute_tensor_inside_a_users_tf_function():
    """In a tf.function run on the mesh (its input placed there), distribute_tensor
    relayouts, as in a jitted function on JAX, also to a mesh first met inside it."""
    devices = keras.distribution.list_devices()[:2]
    placed_on = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)  # Not yet seen.
    value = tf.reshape(tf.range(8.0), (2, 4))
    x = keras.distribution.distribute_tensor(
        value, keras.distribution.TensorLayout([None, None], placed_on))

    @tf.function
    def double_split_by_columns(x):
        return keras.distribution.distribute_tensor(
            x * 2, keras.distribution.TensorLayout([None, "model"], mesh))

    out = double_split_by_columns(x)
    assert tuple(dtensor.fetch_layout(out).sharding_specs) == (dtensor.UNSHARDED, "model")
    pieces = dtensor.unpack(out)
    assert [p.device for p in pieces] == tfpar.distribute.mesh.mesh_runtime.mesh_devices(mesh)
    np.testing.assert_array_equal(pieces[0], value[:, :2] * 2)
    np.testing.assert_array_equal(pieces[1], value[:, 2:] * 2)
    # A function given only ordinary tensors runs off the mesh: TensorFlow's own error,
    # as its guide says, also when it is the first place a mesh is met (in a fresh
    # process; it was "`pack` must be called eagerly", from laying the mesh out there).
    program = (
        "import tfpar; tfpar.virtual_cpus(2)\n"
        "import keras, tensorflow as tf\n"
        "tfpar.use_keras_distribution()\n"
        "mesh = keras.distribution.DeviceMesh((2,), ['model'],\n"
        "                                     keras.distribution.list_devices()[:2])\n"
        "layout = keras.distribution.TensorLayout([None, 'model'], mesh)\n"
        "tf.function(lambda x: keras.distribution.distribute_tensor(x, layout))(\n"
        "    tf.ones((2, 4)))\n")
    done = _in_a_fresh_process(program)
    assert done.returncode != 0
    assert "No OpKernel was registered to support Op 'Relayout'" in done.stderr, \
        done.stderr[-3000:]


def _in_a_fresh_process(program):
    """`program` (Python source) run in a process of its own, tfpar on its path."""
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=os.path.dirname(HERE)))


def _one_layer_model(layer, shape):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input(shape), layer, keras.layers.Flatten(),
                              keras.layers.Dense(3, name="head")])
    model.compile(keras.optimizers.SGD(0.1), LOGITS_LOSS)
    return model


@pytest.mark.parametrize("kind, axes, match", [
    ("conv", (None, None, None, "model"),
     "Layer 'layer' \\(Conv2D\\) cannot train with 'sequential(_\\d+)?/layer/kernel' laid out "
     "\\(None, None, None, 'model'\\).*Filter for convolution.*Keep this layer's weights "
     "replicated"),
    ("depthwise", (None, None, "model", None),
     "Layer 'layer' \\(DepthwiseConv2D\\) cannot run on a device mesh with any layout.*"
     "DepthwiseConv2dNativeBackpropFilter.*keras.distribution.DataParallel"),
    ("lstm", (None, "model"),
     "Layer 'layer' \\(LSTM\\) cannot run on a device mesh with any layout.*TensorList.*"
     "keras.distribution.DataParallel"),
])
def test_layers_dtensor_cannot_lay_out_are_refused_before_the_first_step(kind, axes, match):
    """A LayoutMap splitting a Conv2D's, a DepthwiseConv2D's or an LSTM's kernel failed
    inside DTensor with an MLIR error; refused before any step, naming the layer, the op
    and what works. A Conv2D with its weights replicated trains as on one device."""
    layer, shape = {"conv": (lambda: keras.layers.Conv2D(4, 3, name="layer"), (6, 6, 2)),
                    "depthwise": (lambda: keras.layers.DepthwiseConv2D(3, name="layer"),
                                  (6, 6, 2)),
                    "lstm": (lambda: keras.layers.LSTM(4, name="layer"), (5, 3))}[kind]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, *shape)).astype("float32")
    y = rng.integers(0, 3, 8).astype("int32")
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"],
                                         keras.distribution.list_devices()[:2])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*layer/.*kernel"] = axes
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    model = _one_layer_model(layer(), shape)
    for run in (lambda: model.fit(x, y, batch_size=4, verbose=0),
                lambda: model.evaluate(x, y, batch_size=4, verbose=0)):
        with pytest.raises(ValueError, match=match):
            run()
    assert int(model.optimizer.iterations.numpy()) == 0
    if kind == "conv":
        keras.distribution.set_distribution(keras.distribution.ModelParallel(
            layout_map=keras.distribution.LayoutMap(mesh)))
        model = _one_layer_model(layer(), shape)
        model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
        keras.distribution.set_distribution(None)
        want = _one_layer_model(layer(), shape)
        want.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
        for a, b in zip(model.get_weights(), want.get_weights()):
            np.testing.assert_allclose(a, b, atol=ATOL)


def test_an_optimizer_built_before_fit_in_a_fresh_process_trains_as_on_one_device():
    """The first optimizer state a process lays out on a mesh (here built by the user before
    fit; tfpar builds it so too) is made on the default mesh of the moment: it failed in
    DTensor's SPMD expansion ("Expected shape: <16,...> got shape: <8,...>") until it was cut
    again for its variable's mesh. (A fresh process: the first such state is the case.)"""
    program = (
        "import tfpar; tfpar.virtual_cpus(4)\n"
        "import numpy as np, keras\n"
        "tfpar.use_keras_distribution()\n"
        "x = np.random.default_rng(0).normal(size=(32, 8)).astype('float32')\n"
        "y = (np.arange(32) % 4).astype('int32')\n"
        "def build():\n"
        "    keras.utils.set_random_seed(0)\n"
        "    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name='d1'),\n"
        "                          keras.layers.Dense(4, name='d2')])\n"
        "    m.compile(keras.optimizers.Adam(0.01),\n"
        "              keras.losses.SparseCategoricalCrossentropy(from_logits=True))\n"
        "    m.optimizer.build(m.trainable_variables)\n"
        "    m.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)\n"
        "    return m.get_weights()\n"
        "mesh = keras.distribution.DeviceMesh((2, 2), ['batch', 'model'],\n"
        "                                     keras.distribution.list_devices()[:4])\n"
        "layout_map = keras.distribution.LayoutMap(mesh)\n"
        "layout_map['.*d1/kernel'] = (None, 'model')\n"
        "keras.distribution.set_distribution(keras.distribution.ModelParallel(\n"
        "    layout_map=layout_map, batch_dim_name='batch'))\n"
        "got = build()\n"
        "keras.distribution.set_distribution(None)\n"
        "want = build()\n"
        "print('DIFFERENCE', max(float(np.max(abs(a - b))) for a, b in zip(got, want)))\n")
    done = _in_a_fresh_process(program)
    assert done.returncode == 0, done.stderr[-3000:]
    difference = float(done.stdout.split("DIFFERENCE")[-1])
    assert difference < ATOL, difference
