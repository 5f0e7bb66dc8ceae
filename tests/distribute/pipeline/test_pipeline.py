"""PipelineStrategy: equal to the unsplit model, ops on their stage's device in schedule
order, replicas with per-stage all-reduce, Keras fit/evaluate/predict/save, clear errors."""

import json
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar.distribute.pipeline import pipeline_extended
from tfpar.errors import BatchSizeError, DeviceError, PlacementError, ScheduleError
from tfpar.keras import internals
from tfpar.plan.schedule import BACKWARD, bubble_fraction, make_schedule
from tfpar.viz import pipeline_profiler as profiling
from tfpar.viz.pipeline_trace import action_of_op

from conftest import cpus, device_index, tf_functions_in, toy_data

BATCH = 16
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
COMPUTE_OPS = {"MatMul", "BiasAdd", "BiasAddGrad", "Tanh", "TanhGrad", "Relu", "ReluGrad"}


def mlp(seed=0, boundaries=()):
    """Four Dense layers (enough for 4 stages); StageBoundary markers before the given layers."""
    keras.utils.set_random_seed(seed)
    layers = [keras.layers.Dense(16, activation="tanh", name="alpha"),
              keras.layers.Dense(16, activation="relu", name="beta"),
              keras.layers.Dense(8, activation="tanh", name="gamma"),
              keras.layers.Dense(3, name="delta")]
    for i in sorted(boundaries, reverse=True):
        layers.insert(i, tfpar.layers.StageBoundary(name=f"boundary_{i}"))
    return keras.Sequential([keras.Input((4,))] + layers)


def compiled(model, optimizer=None, **kwargs):
    model.compile(optimizer or keras.optimizers.SGD(0.1), LOSS, **kwargs)
    return model


def adam():
    return keras.optimizers.Adam(0.01)


def pipelined(strategy, make=mlp, optimizer=None, **compile_kwargs):
    """`make()` compiled under the strategy's scope; `optimizer`: a function making it."""
    with strategy.scope():
        return compiled(make(), optimizer() if optimizer else None, **compile_kwargs)


def assert_weights_equal(got, want, atol=1e-5):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=atol, rtol=1e-5)


@pytest.fixture(scope="session")
def data():
    return toy_data(n=4 * BATCH)


@pytest.fixture(scope="session")
def reference_steps(data):
    """Weights of the unsplit model after each of 3 SGD steps on the first 3 batches."""
    x, y = data
    model = compiled(mlp())
    weights = []
    for step in range(3):
        model.train_on_batch(x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH])
        weights.append(model.get_weights())
    return weights


# --- Numbers equal to the unsplit model ---------------------------------------------------

@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("k", [2, 4])
def test_train_steps_equal_unsplit_model(k, m, schedule, remat, data, reference_steps):
    x, y = data
    strategy = tfpar.PipelineStrategy(cpus(k), num_micro_batches=m, schedule=schedule,
                                      remat=remat)
    model = pipelined(strategy)
    for step in range(3):
        model.train_on_batch(x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH])
    assert_weights_equal(model.get_weights(), reference_steps[-1])
    assert [device_index(l.kernel.value.device) for l in model.layers] == (
        [0, 0, 1, 1] if k == 2 else [0, 1, 2, 3])


def test_fit_evaluate_predict_and_checkpoints_equal_unsplit_model(data, tmp_path):
    x, y = data
    weights = np.random.default_rng(1).uniform(0.5, 1.5, len(x)).astype("float32")
    kwargs = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0, sample_weight=weights)
    reference = compiled(mlp(), keras.optimizers.Adam(0.01), metrics=["accuracy"])
    history = reference.fit(x, y, **kwargs)
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=4, schedule="1f1b")
    model = pipelined(strategy, optimizer=adam, metrics=["accuracy"])
    checkpoints = keras.callbacks.ModelCheckpoint(str(tmp_path / "e{epoch}.weights.h5"),
                                                  save_weights_only=True)
    got = model.fit(x, y, callbacks=[checkpoints], **kwargs)
    np.testing.assert_allclose(got.history["loss"], history.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(got.history["accuracy"], history.history["accuracy"])
    assert_weights_equal(model.get_weights(), reference.get_weights())
    np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0),
                               atol=1e-5)
    # Any batch size for the forward pass: 10 examples in 4 micro-batches of 3, 3, 2, 2.
    np.testing.assert_allclose(model.predict(x[:10], batch_size=10, verbose=0),
                               reference.predict(x[:10], verbose=0), atol=1e-5)
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=BATCH, verbose=0),
                               reference.evaluate(x, y, batch_size=BATCH, verbose=0), atol=1e-5)
    # Adam's state lives with its variable; the checkpoint loads into a plain model.
    for variable in model.optimizer.variables:
        layer = next((l for l in model.layers if f"_{l.name}_" in variable.path), None)
        if layer is not None:
            assert variable.value.device == layer.kernel.value.device, variable.path
    plain = mlp(seed=7)
    plain.load_weights(tmp_path / "e2.weights.h5")
    assert_weights_equal(plain.get_weights(), reference.get_weights())


def test_losses_regularizers_and_custom_loop_equal_unsplit_model(data):
    x, y = data[0][:BATCH], data[1][:BATCH]

    def regularized():
        keras.utils.set_random_seed(2)
        inputs = keras.Input((4,))
        h = keras.layers.Dense(16, activation="tanh", kernel_regularizer="l2", name="alpha")(inputs)
        h = keras.layers.Dense(8, activation="relu", activity_regularizer="l2", name="beta")(h)
        return keras.Model(inputs, keras.layers.Dense(3, name="gamma")(h))

    sum_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    for loss in (LOSS, sum_loss):
        reference = regularized()
        reference.compile(keras.optimizers.SGD(0.05), loss)
        strategy = tfpar.PipelineStrategy(cpus(3), num_micro_batches=4, remat=True)
        with strategy.scope():
            model = regularized()
            model.compile(keras.optimizers.SGD(0.05), loss)
        for _ in range(2):
            np.testing.assert_allclose(model.train_on_batch(x, y), reference.train_on_batch(x, y),
                                       rtol=1e-5)
        assert_weights_equal(model.get_weights(), reference.get_weights())

    # A custom loop: the forward runs by micro-batches, each stage's backward on its device.
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=4)
    with strategy.scope():
        model, optimizer = mlp(), keras.optimizers.SGD(0.1)
    reference, reference_optimizer = mlp(), keras.optimizers.SGD(0.1)

    def step(m, opt):
        with tf.GradientTape() as tape:
            loss = LOSS(y, m(x, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, m.trainable_variables), m.trainable_variables))
        return loss

    run = tf.function(lambda: strategy.run(step, args=(model, optimizer)))
    for _ in range(2):
        np.testing.assert_allclose(run(), step(reference, reference_optimizer), rtol=1e-5)
    assert_weights_equal(model.get_weights(), reference.get_weights())


def test_functional_multi_input_output_model_with_embedding_equals_unsplit_model():
    rng = np.random.default_rng(2)
    x = {"ids": rng.integers(0, 50, size=(32, 6)).astype("int32"),
         "extra": rng.normal(size=(32, 3)).astype("float32")}
    y = {"cls": rng.integers(0, 3, 32).astype("int32"),
         "reg": rng.normal(size=(32, 1)).astype("float32")}

    def make():
        keras.utils.set_random_seed(1)
        ids, extra = keras.Input((6,), dtype="int32", name="ids"), keras.Input((3,), name="extra")
        h = keras.layers.Flatten(name="flat")(keras.layers.Embedding(50, 4, name="emb")(ids))
        h = keras.layers.Concatenate(name="join")([h, extra])
        h = keras.layers.Dense(16, activation="relu", name="d1")(h)
        h = keras.layers.Dense(16, activation="relu", name="d2")(h)
        model = keras.Model({"ids": ids, "extra": extra},
                            {"cls": keras.layers.Dense(3, name="cls")(h),
                             "reg": keras.layers.Dense(1, name="reg")(h)})
        model.compile(adam(), loss={"cls": LOSS, "reg": "mse"}, loss_weights={"cls": 1, "reg": 0.5},
                      metrics={"cls": ["accuracy"]})
        return model

    reference = make()
    want = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    strategy = tfpar.PipelineStrategy(cpus(3), num_micro_batches=4)
    with strategy.scope():
        model = make()
    got = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    assert strategy.stages(model) == [["emb", "flat", "join"], ["d1"], ["d2", "reg", "cls"]]
    for key in want:  # loss, cls_loss, reg_loss, cls_accuracy
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5)
    assert_weights_equal(model.get_weights(), reference.get_weights())
    predicted, expected = model.predict(x, verbose=0), reference.predict(x, verbose=0)
    for key in expected:
        np.testing.assert_allclose(predicted[key], expected[key], atol=1e-5)


def test_replicas_all_reduce_per_stage_and_equal_unsplit_model(data, tmp_path):
    x, y = data
    reference = compiled(mlp(), keras.optimizers.Adam(0.01))
    reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    strategy = tfpar.PipelineStrategy(cpus(4), num_micro_batches=2, num_replicas=2,
                                      schedule="1f1b")
    assert strategy.num_replicas_in_sync == 2 and strategy.num_stages == 2
    assert strategy.communication == {0: "reduce_to_one", 1: "reduce_to_one"}
    model = pipelined(strategy, optimizer=adam)
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert_weights_equal(model.get_weights(), reference.get_weights())
    # Replica r's copy of a stage's variable lives on device r*K + stage; all copies equal.
    for layer, stage in zip(model.layers, [0, 0, 1, 1]):
        copies = layer.kernel.value.values
        assert [device_index(c.device) for c in copies] == [stage, 2 + stage]
        np.testing.assert_array_equal(copies[0].numpy(), copies[1].numpy())
    np.testing.assert_allclose(model.predict(x, batch_size=BATCH, verbose=0),
                               reference.predict(x, verbose=0), atol=1e-5)
    # Weights load into every copy.
    model.save_weights(tmp_path / "r.weights.h5")
    other = pipelined(tfpar.PipelineStrategy(cpus(4), num_micro_batches=2, num_replicas=2))
    other.predict(x[:BATCH], verbose=0)  # places it
    other.load_weights(tmp_path / "r.weights.h5")
    for copies in (l.kernel.value.values for l in other.layers):
        np.testing.assert_array_equal(copies[1].numpy(), copies[0].numpy())
    assert_weights_equal(other.get_weights(), model.get_weights(), atol=0)


def test_nccl_is_chosen_for_gpu_stages():
    """Without GPUs here: the per-stage choice and its ops are built, not run."""
    from tensorflow.python.distribute import cross_device_utils

    grid = [["/job:localhost/replica:0/task:0/device:GPU:0",
             "/job:localhost/replica:0/task:0/device:GPU:1"],
            ["/job:localhost/replica:0/task:0/device:GPU:2",
             "/job:localhost/replica:0/task:0/device:GPU:3"]]
    reductions = pipeline_extended.stage_reductions(grid, cross_device_utils.CollectiveKeys())
    assert [(r.communication, r.devices) for r in reductions] == [
        ("nccl", (grid[0][0], grid[1][0])), ("nccl", (grid[0][1], grid[1][1]))]
    assert all(isinstance(r.ops, tf.distribute.NcclAllReduce) for r in reductions)
    cpu = pipeline_extended.stage_reductions([["/cpu:0"], ["/cpu:1"]],
                                             cross_device_utils.CollectiveKeys())
    assert cpu[0].communication == "reduce_to_one"


def test_a_stage_whose_copies_live_in_several_processes_reduces_by_peer_collectives(
        monkeypatch):
    """Issue 36: TensorFlow's in-process NCCL ops (NcclAllReduce) and a root device
    (ReductionToOneDevice) cannot reduce the copies of a stage on several worker
    processes: its GPUs get the collective's NCCL implementation, its CPUs the ring.
    (No cluster here: the collectives asked for are recorded, not built; the CPU ring runs
    for real in test_pipeline_cluster.py.)"""
    from tensorflow.python.distribute import cross_device_utils

    from tfpar.keras import tf_runtime

    built = []
    monkeypatch.setattr(tf_runtime, "ring_all_reduce",
                        lambda devices, packs, keys, implementation="ring": built.append(
                            (tuple(devices), implementation)) or implementation)
    gpu = "/job:worker/replica:0/task:{}/device:GPU:0"
    cpu = "/job:worker/replica:0/task:{}/device:CPU:0"
    for device, name in ((gpu, "nccl"), (cpu, "ring")):
        # Replica r's stage s on worker task 2r + s (R=2 x K=2, a stage per process).
        grid = [[device.format(0), device.format(1)], [device.format(2), device.format(3)]]
        built.clear()
        reductions = pipeline_extended.stage_reductions(grid, cross_device_utils.CollectiveKeys())
        assert [(r.communication, r.ops) for r in reductions] == [(name, name)] * 2
        assert built == [((device.format(0), device.format(2)), name),
                         ((device.format(1), device.format(3)), name)]


def test_a_root_device_reduction_over_several_processes_is_refused():
    from tensorflow.python.distribute import cross_device_utils

    from tfpar.distribute.common.cross_device import make_cross_device_ops

    devices = ("/job:worker/replica:0/task:0/device:CPU:0",
               "/job:worker/replica:0/task:1/device:CPU:0")
    for communication in ("reduce_to_one", "hierarchical"):
        with pytest.raises(ValueError, match="reduce by collectives only"):
            make_cross_device_ops(communication, devices, cross_device_utils.CollectiveKeys())


def test_batchnorm_and_dropout_train_and_remat_replays_the_same_masks(data):
    x, y = data

    def make():
        keras.utils.set_random_seed(4)
        return compiled(keras.Sequential([
            keras.Input((4,)), keras.layers.Dense(16, name="alpha"),
            keras.layers.BatchNormalization(name="bn"), keras.layers.Activation("relu"),
            keras.layers.Dropout(0.3, name="drop"), keras.layers.Dense(3, name="gamma")]),
            adam())

    results = []
    for remat in (False, True):
        model = pipelined(tfpar.PipelineStrategy(cpus(2), num_micro_batches=4, remat=remat),
                          make=make)
        history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
        assert history.history["loss"][-1] < history.history["loss"][0]
        results.append(model.get_weights())
    # Same dropout masks and one BatchNorm update per micro-batch, with or without remat.
    assert_weights_equal(results[1], results[0], atol=1e-6)


# --- Placement and order in the traced step -------------------------------------------------

def _action_of(name):
    """The action ("1B0") an op of the train step belongs to, from its name scope."""
    found = action_of_op(name)
    return found and found[1]


def _traced_step(model):
    """The nodes of the pipeline step that fit ran, by action ("1B0"), and a function
    giving a node's ancestors (through data and control inputs)."""
    functions = [c for f in tf_functions_in(model.train_function)
                 for c in f._list_all_concrete_functions()]
    graphs = [list(f.node_def) for c in functions for f in c.graph.as_graph_def().library.function]
    nodes = next(g for g in graphs if any(_action_of(n.name) for n in g))
    by_name = {n.name: n for n in nodes}
    actions = {}
    for node in nodes:
        action = _action_of(node.name)
        if action is not None:
            actions.setdefault(action, []).append(node)
    ancestors = {}

    def ancestors_of(name):
        if name not in ancestors:
            ancestors[name] = set()
            for inp in by_name[name].input:
                parent = inp.lstrip("^").split(":")[0]
                if parent in by_name:
                    ancestors[name] |= {parent} | ancestors_of(parent)
        return ancestors[name]

    return actions, ancestors_of


@pytest.mark.parametrize("remat", [False, True])
def test_every_action_runs_on_its_stage_device_after_the_previous(data, remat):
    x, y = data
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=3, schedule="1f1b",
                                      remat=remat)
    model = pipelined(strategy)
    model.fit(x[:24], y[:24], batch_size=24, verbose=0)
    actions, ancestors_of = _traced_step(model)
    # Forward and backward compute on the stage's device.
    for action, members in actions.items():
        compute = [n for n in members if n.op in COMPUTE_OPS]
        assert compute, action
        for node in compute:
            assert device_index(node.device) == int(action[0]), (action, node.name, node.device)
    assert any(n.op == "BiasAddGrad" for n in actions["0B0"])

    # Each action's compute waits for the stage's previous action (control dependencies).
    for order in strategy.schedule.stage_orders:
        for before, after in zip(order, order[1:]):
            previous = {n.name for n in actions[str(before)]}
            for node in actions[str(after)]:
                if node.op in COMPUTE_OPS:
                    assert ancestors_of(node.name) & previous, (str(before), str(after), node.name)


@pytest.mark.parametrize("v", [1, 2])
def test_stages_wait_for_each_other_only_through_the_data_they_send(v, data):
    """No control input crosses stages: a stage waits for another only for an activation or a
    gradient. (TF's automatic control dependencies chain, in program order, every stateful op
    without a resource input; a W that started with such an op held up the other stage's
    next I, on the critical path.)"""
    x, y = data
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=4, schedule="zero_bubble_h1",
                                      virtual_stages=v)
    model = pipelined(strategy)
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0)
    actions, _ = _traced_step(model)
    stage = {n.name: int(re.match(r"\d+", a)[0]) % 2 for a, members in actions.items()
             for n in members}
    nodes = [n for members in actions.values() for n in members]
    crossing = [(n.name, inp) for n in nodes for inp in n.input
                if inp.startswith("^") and stage.get(inp[1:], stage[n.name]) != stage[n.name]]
    markers = [n for a, members in actions.items() if "W" in a for n in members
               if n.name.endswith("/start")]
    assert len(markers) == 4 * v * 2
    assert not crossing, crossing[:3]


@pytest.mark.parametrize("schedule,v,actions", [("1f1b", 1, 2), ("zero_bubble_h1", 2, 3)])
def test_trace_writes_a_timeline_in_schedule_order(schedule, v, actions, data, tmp_path,
                                                   monkeypatch):
    """Every action timed on its stage's row, in schedule order; a split backward's I and
    W apart (chunk c on stage c % K)."""
    x, y = data
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=4, schedule=schedule,
                                      virtual_stages=v)
    model = pipelined(strategy)
    with pytest.raises(ValueError, match="profilers= is for stages on other tasks, but every "
                                         "stage of this pipeline is in this process"):
        strategy.trace(str(tmp_path / "step.json"), model, x, y, profilers={"worker:1": "h:1"})
    events = strategy.trace(str(tmp_path / "step.json"), model, x[:BATCH], y[:BATCH])
    with open(tmp_path / "step.json") as f:
        assert json.load(f)["traceEvents"] == events
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 2 * v * actions * 4
    for stage, order in enumerate(strategy.schedule.stage_orders):
        mine = sorted((e for e in spans if e["tid"] == stage), key=lambda e: e["ts"])
        assert [e["name"] for e in mine] == [str(a) for a in order]
        for first, second in zip(mine, mine[1:]):
            assert second["ts"] >= first["ts"] + first["dur"] - 1  # microseconds
    from PIL import Image

    with Image.open(tmp_path / "step.png") as image:
        assert image.size[0] > 600
    # A profile that holds no op of a stage (another task's profiler that started late) is
    # an error, not a picture with an empty row.
    record = profiling.record_ops
    monkeypatch.setattr(profiling, "record_ops", lambda *args: [
        op for op in record(*args) if (action_of_op(op[0]) or (0, "0"))[1][0] in "02"])
    with pytest.raises(RuntimeError, match="recorded no action of stage 1: /cpu:1: its profile"):
        strategy.trace(str(tmp_path / "step.json"), model, x[:BATCH], y[:BATCH])


# --- Stages, markers, tables ----------------------------------------------------------------

def test_stage_boundaries_cut_the_model_and_round_trip(data, tmp_path):
    x, y = data
    strategy = tfpar.PipelineStrategy(cpus(3), num_micro_batches=2)
    model = pipelined(strategy, make=lambda: mlp(boundaries=(1, 3)))
    model.fit(x, y, batch_size=BATCH, verbose=0)
    assert strategy.stages(model) == [["alpha"], ["boundary_1", "beta", "gamma"],
                                      ["boundary_3", "delta"]]
    assert [device_index(model.get_layer(n).kernel.value.device)
            for n in ("alpha", "beta", "gamma", "delta")] == [0, 1, 1, 2]
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")  # on one device, plain Keras
    assert isinstance(loaded.get_layer("boundary_1"), tfpar.layers.StageBoundary)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                               atol=1e-6)
    layer = tfpar.layers.StageBoundary(name="b")
    assert tfpar.layers.StageBoundary.from_config(layer.get_config()).name == "b"
    # Without markers: balanced by parameters.
    balanced = tfpar.PipelineStrategy(cpus(2))
    # alpha+beta: 80+272 parameters, gamma+delta: 136+27.
    assert balanced.stages(pipelined(balanced)) == [["alpha", "beta"], ["gamma", "delta"]]


def test_functional_model_is_cut_only_where_one_tensor_crosses(data):
    x = data[0][:BATCH]

    def residual(marker=None):
        keras.utils.set_random_seed(5)
        inputs = keras.Input((4,))
        a = keras.layers.Dense(8, name="a")(inputs)
        b = keras.layers.Dense(8, name="b")(a)
        if marker == "inside":
            b = tfpar.layers.StageBoundary(name="inside")(b)
        joined = keras.layers.Add(name="join")([a, b])
        if marker == "after":
            joined = tfpar.layers.StageBoundary(name="after")(joined)
        c = keras.layers.Dense(8, name="c")(joined)
        return keras.Model(inputs, keras.layers.Dense(3, name="d")(c))

    reference = residual()
    strategy = tfpar.PipelineStrategy(cpus(3), num_micro_batches=2)
    with strategy.scope():
        model = residual()
    np.testing.assert_allclose(model(x), reference(x), atol=1e-6)
    # Never between b and join, where a's and b's outputs both cross.
    assert strategy.stages(model) == [["a"], ["b", "join"], ["c", "d"]]
    strategy = tfpar.PipelineStrategy(cpus(2))
    with strategy.scope():
        model = residual("after")
    assert strategy.stages(model) == [["a", "b", "join"], ["after", "c", "d"]]
    with strategy.scope():
        model = residual("inside")
    with pytest.raises(PlacementError, match=r"'inside' cannot start a stage: 2 tensors cross "
                                             r"there \(outputs of a, b\)"):
        strategy.stages(model)


def test_model_inputs_read_by_later_layers_cross_stage_boundaries_with_the_activation():
    """A keras-hub backbone's shape without keras-hub: every block reads the hidden states
    and a model input (a mask, a float scale too), so a cut between blocks passes the
    activation with the inputs; 4 stages of 1F1B train equal to one device, and the float
    input's gradient path (it scales each block) counts."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    mask = (rng.random((32, 6)) > 0.3).astype("int32")
    scale = rng.uniform(0.5, 1.5, (32, 1)).astype("float32")
    y = rng.normal(size=(32, 3)).astype("float32")

    class Block(keras.layers.Layer):
        def build(self, h_shape):
            self.dense = keras.layers.Dense(6, activation="tanh")
            self.dense.build(h_shape)

        def call(self, h, mask, scale):
            return self.dense(h * keras.ops.cast(mask, "float32") * scale) + h

    def blocks():
        keras.utils.set_random_seed(3)
        inputs = {"x": keras.Input((6,), name="x"), "mask": keras.Input((6,), dtype="int32",
                                                                          name="mask"),
                  "scale": keras.Input((1,), name="scale")}
        h = keras.layers.Dense(6, name="embed")(inputs["x"])
        for i in range(3):
            h = Block(name=f"block_{i}")(h, inputs["mask"], inputs["scale"])
        model = keras.Model(inputs, keras.layers.Dense(3, name="head")(h))
        model.compile(keras.optimizers.Adam(0.01), "mse")
        return model

    data = {"x": x, "mask": mask, "scale": scale}
    want = blocks()
    initial = want.get_weights()
    want.fit(data, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    strategy = tfpar.PipelineStrategy(cpus(4), num_micro_batches=2, schedule="1f1b")
    with strategy.scope():
        model = blocks()
    model.fit(data, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    stages = strategy.stages(model)
    assert len(stages) == 4 and sum("block_" in " ".join(s) for s in stages) >= 3, stages
    assert max(np.abs(w - w0).max() for w, w0 in zip(want.get_weights(), initial)) > 1e-3
    for got, expected in zip(model.get_weights(), want.get_weights()):
        np.testing.assert_allclose(got, expected, atol=1e-5)


def test_schedule_table_shows_the_grid_and_bubble():
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=4)
    table = strategy.schedule_table()
    assert table.splitlines()[1].split()[2:6] == ["0F0", "0F1", "0F2", "0F3"]
    assert "bubble fraction: 0.200 (gpipe, 2 stages, 4 micro-batches)" in table
    assert bubble_fraction(make_schedule("gpipe", 2, 4)) == pytest.approx(1 / 5)
    assert "1F1B" not in repr(strategy) and "schedule='gpipe'" in repr(strategy)
    one = tfpar.PipelineStrategy(cpus(4), num_micro_batches=8, schedule="1f1b")
    assert [a.kind for a in one.schedule.stage_orders[3][:4]] == ["F", BACKWARD, "F", BACKWARD]


# --- Clear errors ---------------------------------------------------------------------------

def test_bad_arguments_are_rejected_clearly(data):
    x, y = data
    with pytest.raises(ScheduleError, match="num_micro_batches must be an integer >= 1"):
        tfpar.PipelineStrategy(cpus(2), num_micro_batches=0)
    with pytest.raises(ScheduleError, match="Unknown schedule 'pipedream'"):
        tfpar.PipelineStrategy(cpus(2), schedule="pipedream")
    with pytest.raises(DeviceError, match=r"num_replicas x num_stages \(3 x 2 = 6\) must equal "
                                          r"the number of devices \(4\)"):
        tfpar.PipelineStrategy(cpus(4), num_replicas=3, num_stages=2)
    with pytest.raises(DeviceError, match="4 devices do not split into 3 pipeline replicas"):
        tfpar.PipelineStrategy(cpus(4), num_replicas=3)
    with pytest.raises(DeviceError, match="does not exist"):
        tfpar.PipelineStrategy(["/cpu:0", "/cpu:9"])

    # More stages than layers.
    strategy = tfpar.PipelineStrategy(cpus(4))
    with strategy.scope():
        keras.utils.set_random_seed(0)
        small = compiled(keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                           keras.layers.Dense(3)]))
    with pytest.raises(PlacementError, match="Cannot cut 2 layers into 4 pipeline stages"):
        small.fit(x, y, batch_size=BATCH, verbose=0)
    # Markers that make another number of stages than the strategy runs.
    strategy = tfpar.PipelineStrategy(cpus(2))
    model = pipelined(strategy, make=lambda: mlp(boundaries=(1, 2)))
    with pytest.raises(PlacementError, match="2 StageBoundary markers make 3 stages, but the "
                                             "strategy runs 2 stages"):
        model.fit(x, y, batch_size=BATCH, verbose=0)

    # A subclassed model has no graph to cut.
    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.first, self.second = keras.layers.Dense(8), keras.layers.Dense(3)

        def call(self, inputs):
            return self.second(self.first(inputs))

    with strategy.scope():
        subclassed = compiled(Subclassed())
    with pytest.raises(PlacementError, match="subclassed model"):
        subclassed.fit(x, y, batch_size=BATCH, verbose=0)


def test_batches_that_do_not_split_into_micro_batches_fail_clearly(data):
    x, y = data
    strategy = tfpar.PipelineStrategy(cpus(4), num_micro_batches=4, num_replicas=2)
    model = pipelined(strategy)
    with pytest.raises(BatchSizeError, match=r"A batch of 12 examples does not split evenly into "
                                             r"2 pipeline replicas x 4 micro-batches \(8 equal "
                                             r"parts\)\. Use a batch size that is a multiple of 8, "
                                             r"such as 8 or 16"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(12, drop_remainder=True),
                  verbose=0)
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=4)
    model = pipelined(strategy)
    with pytest.raises(BatchSizeError, match="A batch of 10 examples does not split evenly"):
        model.train_on_batch(x[:10], y[:10])
    # Known only when the step runs: a last partial batch of 2 cannot feed 4 micro-batches.
    with pytest.raises(tf.errors.InvalidArgumentError, match="has fewer examples than its 4 "
                                                             "micro-batches"):
        model.fit(x[:18], y[:18], batch_size=8, verbose=0)


@pytest.mark.parametrize("devices, replicas, schedule, examples", [
    (2, 1, "gpipe", 22), (2, 1, "1f1b", 22), (4, 2, "gpipe", 22), (4, 2, "1f1b", 21)])
def test_a_last_partial_batch_trains_like_the_unsplit_model(devices, replicas, schedule,
                                                            examples, data):
    # 22 examples in batches of 8: the last batch of 6 does not split into 4 micro-batches
    # (2, 2, 1, 1), nor with 2 replicas into 2 (3 per replica: 2, 1). With 21 the two
    # replicas differ too (3 and 2). Each micro-batch's mean loss weighs by its share of
    # the global batch, so the weights still match.
    x, y = data
    weights = np.random.default_rng(2).uniform(0.5, 1.5, examples).astype("float32")
    kwargs = dict(batch_size=8, epochs=2, shuffle=False, verbose=0, sample_weight=weights)
    reference = compiled(mlp())
    history = reference.fit(x[:examples], y[:examples], **kwargs)
    strategy = tfpar.PipelineStrategy(cpus(devices), num_micro_batches=4 // replicas,
                                      schedule=schedule, num_replicas=replicas)
    model = pipelined(strategy)
    got = model.fit(x[:examples], y[:examples], **kwargs)
    np.testing.assert_allclose(got.history["loss"], history.history["loss"], rtol=1e-5)
    assert_weights_equal(model.get_weights(), reference.get_weights())


# --- The training binary ----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.one_process
def test_train_binary_runs_a_pipeline_and_rejects_a_batch_it_cannot_split():
    import os
    import subprocess
    import sys

    def train(*flags):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        result = subprocess.run([sys.executable, "-m", "tfpar.cli.train", "--strategy=pipeline",
                                 "--verbose=2", "--epochs=1", *flags],
                                capture_output=True, text=True, timeout=240, env=env)
        return result.returncode, result.stdout + result.stderr

    code, output = train("--num_micro_batches=8", "--schedule=zero_bubble_h1",
                         "--virtual_stages=2")
    assert code == 0, output[-3000:]
    assert re.search(r"final: loss=[\d.]+ accuracy=[\d.]+ samples/s=\d+ replicas=1", output)
    code, output = train("--num_devices=4", "--num_replicas=2", "--batch_size=60")
    assert code != 0
    assert "A batch of 60 examples does not split evenly into 2 pipeline replicas x 4 " \
           "micro-batches" in output


# --- Past 1F1B: virtual stages and zero-bubble schedules ---------------------------------

def deep_mlp(seed=0):
    """Eight Dense layers: one per chunk for 4 stages x 2 virtual stages."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,))] + [
        keras.layers.Dense(8, activation="tanh", name=f"d{i}") for i in range(7)] + [
        keras.layers.Dense(3, name="head")])


def steady_adam():
    """Adam whose epsilon (1e-3) keeps its steps well conditioned. With Keras' 1e-7, a
    weight whose gradient is ~1e-6 (this model has some) takes a step of about lr x the
    sign of that gradient, so float rounding of ~1e-9 in the gradient, from summing
    micro-batches instead of the batch, moves it by 1e-5: GPipe with one layer per
    stage differs from one device by 1.2e-5 at Adam(0.01), SGD by 1e-7."""
    return keras.optimizers.Adam(0.01, epsilon=1e-3)


@pytest.fixture(scope="session")
def deep_reference(data):
    """Weights of the unsplit deep model after 2 Adam steps."""
    x, y = data
    model = compiled(deep_mlp(), steady_adam())
    for step in range(2):
        model.train_on_batch(x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH])
    return model.get_weights()


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("schedule,v", [("interleaved_1f1b", 2), ("zero_bubble_h1", 1),
                                        ("zero_bubble_h1", 2)])
@pytest.mark.parametrize("m", [4, 8])
@pytest.mark.parametrize("k", [2, 4])
def test_interleaved_and_zero_bubble_train_equal_to_the_unsplit_model(
        k, m, schedule, v, remat, data, deep_reference):
    """Adam, 2 steps, remat on and off; each chunk's layers on its device (chunk c on
    stage c % K). (Interleaved with v=1 is 1F1B, whose orders test_schedule checks equal.)"""
    x, y = data
    strategy = tfpar.PipelineStrategy(cpus(k), num_micro_batches=m, schedule=schedule,
                                      virtual_stages=v, remat=remat)
    model = pipelined(strategy, deep_mlp, steady_adam)
    for step in range(2):
        model.train_on_batch(x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH])
    assert_weights_equal(model.get_weights(), deep_reference)
    chunks = k * v
    per_chunk = 8 // chunks
    assert [device_index(l.kernel.value.device) for l in model.layers] == [
        (i // per_chunk) % k for i in range(8)]


class _Encoder(keras.layers.Layer):
    """A transformer block as a custom layer: self-attention, then a feed-forward network
    kept in a Sequential of its own, each with dropout, a residual and LayerNorm."""

    def __init__(self, width=8, heads=2, hidden=16, rate=0.0, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(heads, width // heads)
        self.feed_forward = keras.Sequential([keras.layers.Dense(hidden, activation="relu"),
                                              keras.layers.Dense(width)])
        self.norms = [keras.layers.LayerNormalization(epsilon=1e-6) for _ in range(2)]
        self.dropouts = [keras.layers.Dropout(rate) for _ in range(2)]

    def call(self, x, training=False):
        x = self.norms[0](x + self.dropouts[0](self.attention(x, x), training=training))
        return self.norms[1](x + self.dropouts[1](self.feed_forward(x), training=training))


class _TokensAndPositions(keras.layers.Layer):
    def __init__(self, length=6, vocabulary=20, width=8, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(vocabulary, width)
        self.positions = keras.layers.Embedding(length, width)

    def call(self, x):
        return self.tokens(x) + self.positions(keras.ops.arange(keras.ops.shape(x)[-1]))


def text_classifier():
    """Functional: embeddings, a custom encoder layer, pooling, two Dense layers. (Dropout
    rate 0: masks drawn per micro-batch are not one device's.)"""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((6,), dtype="int32")
    x = _Encoder(name="encoder")(_TokensAndPositions(name="embed")(tokens))
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    x = keras.layers.Dense(8, activation="relu", name="hidden")(x)
    return keras.Model(tokens, keras.layers.Dense(3, name="logits")(x))


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_a_functional_model_with_a_model_inside_a_custom_layer_pipelines(schedule, v):
    """A model called inside a custom layer (the encoder's feed-forward Sequential) is a
    part of the layer: Keras inferring the layer's output shape calls it on placeholders,
    and interleaved stages failed there ("Could not automatically infer the output shape
    / dtype of 'encoder'": the inner Sequential was being cut into 4 chunks). Trains
    equal to the unsplit model, the encoder whole on one device."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, (2 * BATCH, 6)).astype("int32")
    y = rng.integers(0, 3, 2 * BATCH).astype("int32")
    # (SGD: the attention's key bias has no gradient, mathematically, and Adam would blow
    # the rounding noise of summing micro-batches up to steps of the learning rate's size.)
    want = compiled(text_classifier())
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=4, schedule=schedule,
                                      virtual_stages=v)
    model = pipelined(strategy, text_classifier)
    for step in range(2):
        batch = slice(step * BATCH, (step + 1) * BATCH)
        want.train_on_batch(x[batch], y[batch])
        model.train_on_batch(x[batch], y[batch])
    assert_weights_equal(model.get_weights(), want.get_weights())
    encoder = {device_index(w.value.device) for w in model.get_layer("encoder").weights}
    assert len(encoder) == 1, encoder


def test_a_custom_schedule_object_runs_after_its_dry_run(data, reference_steps):
    """`schedule=` takes a Schedule of one's own: stage 1 running its micro-batches'
    backwards last-first, stage 0 splitting its backward and deferring every W. It
    trains equal to the unsplit model; one that fits the strategy badly, or would
    deadlock, is refused before anything runs, the deadlock with the stuck steps marked."""
    from tfpar.plan.schedule import Schedule

    x, y = data
    mine = Schedule.from_strings(["0F0 0F1 0I0 0I1 0W1 0W0", "1F0 1F1 1B1 1B0"], 2, name="mine")
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=2, schedule=mine)
    assert strategy.schedule is mine and "schedule='mine'" in repr(strategy)
    model = pipelined(strategy)
    for step in range(3):
        model.train_on_batch(x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH])
    assert_weights_equal(model.get_weights(), reference_steps[-1])
    with pytest.raises(ScheduleError, match=r"has num_micro_batches=2, but the strategy has "
                                            r"num_micro_batches=4: pass num_micro_batches=2"):
        tfpar.PipelineStrategy(cpus(2), num_micro_batches=4, schedule=mine)
    stuck = Schedule.from_strings(["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"], 2)
    with pytest.raises(ScheduleError, match=r"(?s)would deadlock.*stage 1: >>1F1 1F0 1B0 1B1"):
        tfpar.PipelineStrategy(cpus(2), num_micro_batches=2, schedule=stuck)


class _Heavy(keras.layers.Layer):
    """No parameters, much work whatever the batch: products of 512 x 512 matrices."""

    def call(self, x):
        y = tf.tile(x, [1, 8])
        g = tf.matmul(y, y, transpose_a=True) / 1e3
        for _ in range(3):
            g = tf.tanh(tf.matmul(g, g) / 512.0)
        return tf.matmul(y, g)[:, :64]


def heavy_mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(64, name="wide"),
                             _Heavy(name="heavy"),
                             keras.layers.Dense(64, activation="tanh", name="a"),
                             keras.layers.Dense(64, activation="tanh", name="b"),
                             keras.layers.Dense(3, name="head")])


def test_balancing_by_time_evens_out_measured_time_not_parameters(data):
    """A parameter-free layer that does most of the work: balanced by parameters it
    shares a stage with the two hidden layers; balanced by time (each layer timed on a
    CPU the strategy does not use) it ends stage 0. The cut reads the first layer's
    time without the input gradient it never sends. Training equals the unsplit model,
    each variable on its stage's device."""
    from tfpar.keras import pipeline_stages as stages_lib

    x, y = data
    seen = []
    program = stages_lib.build_program(
        heavy_mlp(), 2, lambda layer, first: seen.append((layer.name, first)) or (
            10.0 if layer.name == "heavy" else 1.0))
    assert seen == [("wide", True), ("heavy", False), ("a", False), ("b", False),
                    ("head", False)]
    assert [s.layer_names for s in program.stages] == [["wide", "heavy"], ["a", "b", "head"]]

    reference = compiled(heavy_mlp())
    reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    by_params = tfpar.PipelineStrategy(cpus(2), num_micro_batches=2)
    by_time = tfpar.PipelineStrategy(cpus(2), num_micro_batches=2, balance_by="time")
    assert by_params.stages(pipelined(by_params, heavy_mlp))[0] == ["wide", "heavy", "a"]
    model = pipelined(by_time, heavy_mlp)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert by_time.stages(model) == [["wide", "heavy"], ["a", "b", "head"]]
    assert_weights_equal(model.get_weights(), reference.get_weights())
    assert [device_index(model.get_layer(n).kernel.value.device) for n in ("wide", "a")] == [
        0, 1]
    with pytest.raises(PlacementError, match="balance_by must be 'params' or 'time'"):
        tfpar.PipelineStrategy(cpus(2), balance_by="bytes")
    with pytest.raises(PlacementError, match="uses every CPU of this host"):
        tfpar.PipelineStrategy(cpus(len(tf.config.list_logical_devices("CPU"))),
                               balance_by="time")


def nested_mlp():
    """A functional model whose middle is a nested Sequential of three layers."""
    keras.utils.set_random_seed(0)
    block = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(16, activation="tanh", name="n1"),
                              keras.layers.Dense(16, activation="tanh", name="n2"),
                              keras.layers.Dense(16, activation="tanh", name="n3")],
                             name="block")
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(16, activation="tanh", name="stem")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(block(hidden)))


def test_stages_are_cut_inside_a_nested_model(data, tmp_path):
    """A nested Sequential is cut through: its layers fall into different stages (on
    different devices); training equals the unsplit model, and the saved model is the
    nested one, loading on one device."""
    x, y = data
    reference = compiled(nested_mlp(), adam())
    reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=2, schedule="1f1b")
    model = pipelined(strategy, nested_mlp, adam)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert strategy.stages(model) == [["stem", "n1"], ["n2", "n3", "head"]]
    block = model.get_layer("block")
    assert [device_index(block.get_layer(n).kernel.value.device) for n in ("n1", "n3")] == [0, 1]
    assert_weights_equal(model.get_weights(), reference.get_weights())
    model.save(tmp_path / "nested.keras")
    loaded = keras.models.load_model(tmp_path / "nested.keras")
    assert isinstance(loaded.get_layer("block"), keras.Sequential)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                               atol=1e-6)


# --- PipeDream-2BW -----------------------------------------------------------------------

def delayed_update_reference(x, y, steps, optimizer):
    """One device, a plain loop of PipeDream-2BW's rule: step t's gradient is that of the
    weights before the previous update, applied to the current weights (the first step's
    older weights are the initial ones). Returns the weights and the losses."""
    model = mlp()
    model.build((None, 4))
    older = [w.numpy() for w in model.trainable_weights]
    losses = []
    for t in range(steps):
        rows = slice(t * BATCH, (t + 1) * BATCH)
        current = [w.numpy() for w in model.trainable_weights]
        for w, value in zip(model.trainable_weights, older):
            w.assign(value)
        with tf.GradientTape() as tape:
            loss = LOSS(y[rows], model(x[rows]))
        grads = tape.gradient(loss, model.trainable_weights)
        for w, value in zip(model.trainable_weights, current):
            w.assign(value)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        older = current
        losses.append(float(loss))
    return model.get_weights(), losses


def returned_by_train_on_batch(step_losses):
    """What Keras' train_on_batch returns after steps of these losses (equal batches):
    each step's own from Keras 3.15 (it resets the metrics first); before, the loss
    tracker's mean since the last reset (compile, fit or evaluate)."""
    if internals.installed("keras") >= internals.release("3.15.0"):
        return list(step_losses)
    return list(np.cumsum(step_losses) / np.arange(1, len(step_losses) + 1))


@pytest.mark.parametrize("replicas", [1, 2])
def test_2bw_applies_each_gradient_to_the_next_weights_as_its_reference_does(replicas):
    """schedule="2bw", 5 Adam steps: weights and each step's loss equal the plain delayed-
    update loop (1e-5), and differ from synchronous training (the delay is real)."""
    steps = 5
    x, y = toy_data(n=steps * BATCH, seed=3)
    want, want_losses = delayed_update_reference(x, y, steps, steady_adam())
    synchronous = compiled(mlp(), steady_adam())
    synchronous.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)

    strategy = tfpar.PipelineStrategy(cpus(2 * replicas), num_micro_batches=4, schedule="2bw",
                                      num_replicas=replicas)
    assert strategy.schedule.weight_versions == 2 and "2 weight versions" in (
        strategy.schedule_table())
    model = pipelined(strategy, optimizer=steady_adam)
    losses = [float(model.train_on_batch(x[t * BATCH:(t + 1) * BATCH],
                                         y[t * BATCH:(t + 1) * BATCH]))
              for t in range(steps)]
    assert_weights_equal(model.get_weights(), want)
    np.testing.assert_allclose(losses, returned_by_train_on_batch(want_losses), rtol=1e-5)
    drift = max(np.abs(a - b).max() for a, b in zip(model.get_weights(),
                                                     synchronous.get_weights()))
    assert drift > 1e-3


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_offloaded_activations_wait_off_the_stage_device_and_train_as_unsplit(
        schedule, data, reference_steps):
    """With remat, each stage's micro-batch inputs wait for their backward on the offload
    device: the backward reads no data the forward left on a stage device (it waits for
    the forward's last op, its control input, which keeps nothing)."""
    x, y = data
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=4, schedule=schedule,
                                      remat=True, offload_activations="/cpu:2")
    model = pipelined(strategy)
    model.fit(x[:3 * BATCH], y[:3 * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    assert_weights_equal(model.get_weights(), reference_steps[-1])

    actions, _ = _traced_step(model)
    by_name = {n.name: (action, n) for action, members in actions.items() for n in members}
    read_by_backward = {device_index(by_name[parent][1].device)
                        for action, members in actions.items() if "B" in action
                        for node in members for inp in node.input if not inp.startswith("^")
                        for parent in [inp.split(":")[0]]
                        if parent in by_name and "F" in by_name[parent][0]}
    assert read_by_backward == {2}
    kept, fetched = ([n for action, members in actions.items() if kind in action
                      for n in members if device_index(n.device) == 2 and n.op == "Identity"]
                     for kind in "FB")
    assert len(kept) == len(fetched) == 2 * 4  # Each stage's input of each micro-batch,
    # sent back only when its backward starts (a receive takes what is sent at once).
    assert all(any(i.startswith("^") for i in n.input) for n in fetched)


def test_offloading_without_remat_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="needs remat=True"):
        tfpar.PipelineStrategy(cpus(2), offload_activations=True)
    with pytest.raises(ValueError, match="offload_activations must be"):
        tfpar.PipelineStrategy(cpus(2), remat=True, offload_activations=2)
