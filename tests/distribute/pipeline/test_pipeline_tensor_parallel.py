"""PipelineStrategy(tensor_parallel=T, layout_map=...): each stage's Dense layers split over
its T devices as Megatron splits them (column, then row), trained as one device; shards on
their devices (read off the built variables), one reduction each way per micro-batch (counted
in the traced step), checkpoints whole, and what cannot be split refused before the first
step, naming the layer and the key."""

import functools
import json
import re
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar.distribute.pipeline import tensor_groups
from tfpar.distribute.pipeline import tensor_parallel as tp
from tfpar.errors import DeviceError, PlacementError
from tfpar.keras import internals
from tfpar.keras import split_variables as keras_tp

import multi_worker_common as common
from conftest import cpus

TESTS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

H, INPUTS, OUTPUTS = common.MEGATRON_HIDDEN, common.MEGATRON_INPUTS, common.MEGATRON_OUTPUTS
BATCH, M = 16, 2
megatron_mlp, megatron_layout, _data = common.megatron_mlp, common.megatron_layout, common.megatron_data


def _optimizer(name):
    return (keras.optimizers.SGD(0.05, momentum=0.9) if name == "sgd_momentum"
            else keras.optimizers.Adam(0.01))


def _strategy(schedule="1f1b", layout_map=None, **kwargs):
    # K=2 stages x T=2 devices on 4 CPUs: stage s on /cpu:(2s) and /cpu:(2s + 1).
    return tfpar.PipelineStrategy(cpus(4), num_micro_batches=M, num_stages=2,
                                  schedule=schedule, tensor_parallel=2,
                                  layout_map=layout_map or megatron_layout(), **kwargs)


@functools.lru_cache(maxsize=None)
def _trained(optimizer, schedule, make=megatron_mlp, layout=megatron_layout, epochs=2,
             **kwargs):
    """(strategy, model) after `epochs` epochs of 4 steps; schedule None: one device."""
    x, y = _data()
    strategy = None if schedule is None else _strategy(schedule, layout(), **kwargs)
    if strategy is None:
        model = make()
        model.compile(_optimizer(optimizer), "mse")
    else:
        with strategy.scope():
            model = make()
            model.compile(_optimizer(optimizer), "mse")
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return strategy, model


def _check_equal(model, want, label):
    initial = megatron_mlp().get_weights()
    assert max(np.abs(w - w0).max() for w, w0 in zip(model.get_weights(), initial)) > 1e-3
    for got, expected, variable in zip(model.get_weights(), want.get_weights(), model.weights):
        assert got.shape == tuple(variable.shape)
        np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=f"{label} {variable.path}")


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam"])
def test_megatron_mlp_trains_as_one_device_with_gpipe_and_1f1b(optimizer):
    _, want = _trained(optimizer, None)
    for schedule in ("gpipe", "1f1b"):
        strategy, model = _trained(optimizer, schedule)
        assert strategy.stages(model) == [["embed", "mlp_in_0", "mlp_out_0"],
                                          ["mlp_in_1", "mlp_out_1", "head"]]
        _check_equal(model, want, (optimizer, schedule))
        # Evaluation and prediction run the split layers too.
        x, y = _data(16)
        np.testing.assert_allclose(model.predict(x, batch_size=BATCH, verbose=0),
                                   want.predict(x, batch_size=BATCH, verbose=0), atol=1e-5)


@pytest.mark.parametrize("schedule, kwargs", [
    ("gpipe", {"remat": True, "offload_activations": True}),
    ("zero_bubble_h1", {}),
    ("interleaved_1f1b", {"virtual_stages": 2}),
])
def test_remat_offload_zero_bubble_and_interleaved_stages_train_as_one_device(schedule, kwargs):
    _, want = _trained("adam", None)
    strategy, model = _trained("adam", schedule, **kwargs)
    _check_equal(model, want, (schedule, kwargs))
    if "virtual_stages" in kwargs:  # Chunk c on stage c % 2: its shards on that stage's CPUs.
        assert strategy.stages(model)[1] == ["mlp_out_0"]
        shards = keras_tp.sharded_storage(model.get_layer("mlp_out_0").kernel).shards
        with strategy.scope():
            assert [_device_index(_copies(s)[0].device) for s in shards] == [2, 3]


def _device_index(device):
    return tf.DeviceSpec.from_string(device).device_index


def _copies(variable):
    return tf.distribute.get_strategy().experimental_local_results(
        internals.attr(variable, "_value"))


def test_each_shard_lives_on_its_own_device_with_its_shape():
    strategy, model = _trained("adam", "1f1b")
    assert strategy.tensor_parallel_devices == (
        (tuple(f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in (0, 1)),
         tuple(f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in (2, 3))),)
    shapes = {"mlp_in": ((H, 2 * H), (2 * H,)), "mlp_out": ((2 * H, H), None)}
    for stage in (0, 1):
        for kind in ("mlp_in", "mlp_out"):
            layer = model.get_layer(f"{kind}_{stage}")
            kernel_shape, bias_shape = shapes[kind]
            split = [(layer.kernel, kernel_shape)] + (
                [(layer.bias, bias_shape)] if bias_shape else [])
            for variable, shard_shape in split:
                storage = keras_tp.sharded_storage(variable)
                assert storage is not None, variable.path
                assert len(storage.shards) == 2
                for t, shard in enumerate(storage.shards):
                    assert tuple(shard.shape) == shard_shape
                    with strategy.scope():
                        (copy,) = _copies(shard)
                    assert _device_index(copy.device) == 2 * stage + t
                # The layer's own variable is whole for Keras (the shards side by side).
                assert tuple(variable.shape) == tuple(np.asarray(variable).shape)
            if not bias_shape:  # A row layer's bias is added once, on the stage's first device.
                assert keras_tp.sharded_storage(layer.bias) is None
                with strategy.scope():
                    (copy,) = _copies(layer.bias)
                assert _device_index(copy.device) == 2 * stage
    # Adam's state of each shard (m and v) has the shard's shape, on the shard's device.
    shard_slots = [v for v in model.optimizer.variables if "shard" in v.path]
    assert len(shard_slots) == 2 * 2 * 3 * 2  # (m, v) x T x (column kernel and bias, row kernel) x K.
    for variable in shard_slots:
        assert tuple(variable.shape) in {(H, 2 * H), (2 * H,), (2 * H, H)}
        with strategy.scope():
            (copy,) = _copies(variable)
        t = int(variable.path.split("shard")[1][0])
        assert _device_index(copy.device) % 2 == t
    assert not [v for v in model.optimizer.variables if tuple(v.shape) == (H, 4 * H)]


def _trains_as_one_device(make, strategy, x, y, epochs=2):
    """`make()` trained on one device and under `strategy` (batches of 16, in order): the
    strategy's model, whose weights moved and equal one device's (1e-5)."""
    want = make()
    initial = want.get_weights()
    want.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    with strategy.scope():
        model = make()
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    assert max(np.abs(w - w0).max() for w, w0 in zip(model.get_weights(), initial)) > 1e-3
    for got, expected, variable in zip(model.get_weights(), want.get_weights(), model.weights):
        np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=variable.path)
    return model


def _traced_step(strategy, model, x=None, y=None):
    y = _data(BATCH)[1] if y is None else y
    x = _data(BATCH)[0] if x is None else x

    @tf.function
    def step(x, y):
        return strategy.run(model.train_step, args=((x, y),))

    return step.get_concrete_function(tf.TensorSpec(x.shape, x.dtype),
                                      tf.TensorSpec(y.shape, y.dtype)).graph


def _action_of(op):
    """The pipeline action ("1F0": stage 1's forward of micro-batch 0) an op was built in."""
    found = re.search(r"/(\d+)([FBIW])(\d+)/", op.name)
    return found.group(2) if found else None


def _all_reduces(ops):
    return [op for op in ops if op.type == "CollectiveReduceV2"
            and tensor_groups.ALL_REDUCE in op.name]


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble_h1"])
def test_the_traced_step_has_one_reduction_each_way_per_micro_batch_and_no_gather(schedule):
    """Two Megatron MLPs (one per stage) x M micro-batches: M forward reductions each
    (the row layer's partial products) and M backward ones (the column layer's input
    gradients); nothing gathered between the column and the row layer. Each is an
    all-reduce of peer collectives on every device of the stage (no root), and no device
    adds the others' partial sums; zero bubble's backward reductions belong to its
    input-gradient pass (I), which sends them on (the weight pass W needs none)."""
    strategy, model = _trained("sgd_momentum", schedule)
    ops = _traced_step(strategy, model).get_operations()
    assert not [op for op in ops if tp.GATHER in op.name]
    reduces = _all_reduces(ops)
    backward = "B" if schedule == "1f1b" else "I"
    for d in range(4):
        mine = [_action_of(op) for op in reduces if _device_index(op.device) == d]
        assert mine.count("F") == M and mine.count(backward) == M, (d, mine)
        assert len(mine) == 2 * M, (d, mine)
    assert not [op for op in ops if op.type == "AddN" and (
        tp.FORWARD_REDUCTION in op.name or tp.BACKWARD_REDUCTION in op.name)]
    # Every device multiplies, forward and backward (the shards' gradients on their device).
    matmuls = [op for op in ops if op.type == "MatMul"]
    assert {_device_index(op.device) for op in matmuls} == {0, 1, 2, 3}
    grads = [op for op in matmuls if "gradient" in op.name.lower()]
    assert {_device_index(op.device) for op in grads} == {0, 1, 2, 3}


def test_weights_save_whole_and_load_into_a_plain_model(tmp_path):
    strategy, model = _trained("adam", "gpipe")
    path = str(tmp_path / "tp.weights.h5")
    model.save_weights(path)
    plain = megatron_mlp(seed=1)
    plain.load_weights(path)
    for got, want in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, want)
    # And back: a plain model's weights load into the split one (divided over the shards).
    other = megatron_mlp(seed=2)
    other_path = str(tmp_path / "plain.weights.h5")
    other.save_weights(other_path)
    with strategy.scope():
        split = megatron_mlp(seed=3)
        split.compile(_optimizer("adam"), "mse")
    split.load_weights(other_path)
    for got, want in zip(split.get_weights(), other.get_weights()):
        np.testing.assert_array_equal(got, want)
    storage = keras_tp.sharded_storage(split.get_layer("mlp_in_0").kernel)
    np.testing.assert_array_equal(np.asarray(storage.shards[1]),
                                  other.get_layer("mlp_in_0").kernel.numpy()[:, 2 * H:])


def _other_splits():
    layout_map = keras.distribution.LayoutMap(None)
    layout_map[".*embed/kernel"] = (None, "model")   # Column, read by an unsplit layer.
    layout_map[".*embed/bias"] = ("model",)
    layout_map[".*head/kernel"] = ("model", None)    # Row, reading a whole activation.
    return layout_map


def test_a_column_layer_read_by_an_unsplit_one_and_a_row_layer_of_a_whole_input():
    # The column layer's slices are gathered; the row layer slices its input itself.
    _, want = _trained("sgd_momentum", None, epochs=1)
    strategy, model = _trained("sgd_momentum", "gpipe", layout=_other_splits, epochs=1)
    _check_equal(model, want, "embed column, head row")
    ops = _traced_step(strategy, model).get_operations()
    assert len([op for op in ops if tp.GATHER in op.name and op.type == "ConcatV2"]) == M


def test_two_replicas_of_the_split_pipeline_train_as_one_device_with_and_without_zero():
    # R=2 x K=2 x T=2 needs 8 devices: a process of its own.
    worker = os.path.join(TESTS, "workers", "pipeline_tp_replicas.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(TESTS)]
        + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    done = subprocess.run([sys.executable, worker], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.strip().splitlines()[-4:]]
    assert [r["shard"] for r in results] == [None, "optimizer", "parameters", "3d"]
    for result in results:
        assert result["difference"] < 1e-5, result
    plain, zero1, zero3, three_d = results
    # The pipeline guide's 3D example (keras-hub blocks, R x K x T from the mesh, ZeRO-1).
    assert three_d["degrees"] == [2, 2, 2]
    assert [s[-1] for s in three_d["stages"]] == ["transformer_layer_0", "lm_head"], three_d
    # Replica r's copy of stage 0's shard t on /cpu:(4r + t); the copies took the same update,
    # and each copy keeps its own Adam state.
    assert plain["devices"] == [[0, 4], [1, 5]] and plain["copies_equal"], plain
    assert len(plain["state"]) == 2 * 2 * 3  # K x T x (column kernel and bias, row kernel).
    assert all(state == shard * 2 for shard, state in plain["state"]), plain
    # ZeRO-1: one copy of each shard's state (m and v), on one of that shard's devices.
    assert zero1["copies_equal"] and all(
        len(state) == 2 and state[0] == state[1] and state[0] in shard
        for shard, state in zero1["state"]), zero1
    # ZeRO-3: each shard lives on its owner only, one of the shard's two devices.
    assert all(len(d) == 1 and d[0] in (t, t + 4) for t, d in enumerate(zero3["devices"])), zero3


def einsum_mlp(seed=0):
    """Sequences through an EinsumDense Megatron pair (column over d, row over d)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((5, INPUTS)),
        keras.layers.EinsumDense("abc,cd->abd", (5, 4 * H), bias_axes="d",
                                 activation="relu", name="ein_in"),
        keras.layers.EinsumDense("abd,de->abe", (5, H), bias_axes="e", name="ein_out"),
        keras.layers.Flatten(name="flat"),
        keras.layers.Dense(OUTPUTS, name="head"),
    ])


def einsum_layout():
    layout_map = keras.distribution.LayoutMap(None)
    layout_map[".*ein_in/kernel"] = (None, "model")
    layout_map[".*ein_out/kernel"] = ("model", None)
    return layout_map


def test_an_einsum_dense_megatron_pair_trains_as_one_device():
    x = np.random.default_rng(1).normal(size=(32, 5, INPUTS)).astype("float32")
    y = _data(32)[1]
    want = einsum_mlp()
    want.compile(_optimizer("adam"), "mse")
    want.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=M, tensor_parallel=2,
                                      layout_map=einsum_layout())
    with strategy.scope():
        model = einsum_mlp()
        model.compile(_optimizer("adam"), "mse")
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    for got, expected in zip(model.get_weights(), want.get_weights()):
        np.testing.assert_allclose(got, expected, atol=1e-5)
    column = keras_tp.sharded_storage(model.get_layer("ein_in").kernel).shards
    bias = keras_tp.sharded_storage(model.get_layer("ein_in").bias).shards
    row = keras_tp.sharded_storage(model.get_layer("ein_out").kernel).shards
    assert [tuple(s.shape) for s in column + bias + row] == (
        [(INPUTS, 2 * H)] * 2 + [(2 * H,)] * 2 + [(2 * H, H)] * 2)
    ops = _traced_step(strategy, model, x[:BATCH]).get_operations()
    assert not [op for op in ops if tp.GATHER in op.name]
    forward = [op for op in _all_reduces(ops) if _action_of(op) == "F"]
    assert sorted(_device_index(op.device) for op in forward) == [0] * M + [1] * M


def test_gpu_stages_reduce_with_nccl_cpu_stages_add_on_the_first_device_and_processes_peer():
    gpus = ["/job:localhost/replica:0/task:0/device:GPU:0",
            "/job:localhost/replica:0/task:0/device:GPU:1"]
    assert tp.communication_of(gpus) == "nccl"
    assert tp.communication_of(cpus(2)) == "reduce_to_one"

    @tf.function(autograph=False)
    def reduce(a, b):
        return tp.reduce_sum([a, b], gpus, tp.communication_of(gpus), "r")

    graph = reduce.get_concrete_function(tf.TensorSpec([4]), tf.TensorSpec([4])).graph
    (nccl,) = [op for op in graph.get_operations() if op.type == "NcclReduce"]
    assert nccl.device == gpus[0] and len(nccl.inputs) == 2
    # Devices of two processes: peer collectives, never TensorFlow's in-process NCCL op (it
    # would hang) nor an add on one device: NCCL's collective on GPUs, the ring on CPUs.
    remote = ["/job:worker/replica:0/task:0/device:{}:0",
              "/job:worker/replica:0/task:1/device:{}:0"]
    assert tp.communication_of([d.format("GPU") for d in remote]) == "nccl"
    assert tp.communication_of([d.format("CPU") for d in remote]) == "ring"


def test_a_group_of_several_processes_sums_by_an_all_reduce_of_peer_collectives():
    """The sum over T GPUs of several processes is an all-reduce by collectives (one per
    device, each device sending and receiving a share), not an add on the first device.
    (Built here with the ring implementation on this process's CPUs: no GPU here.)"""
    from tfpar.keras import tf_runtime

    devices = [tf_runtime.canonical_device(d) for d in cpus(2)]
    strategy = tfpar.DataParallelStrategy(cpus(2))  # (For collective keys of its own.)
    ops = tf_runtime.ring_all_reduce(devices, 0, tf_runtime.collective_keys(strategy.extended))

    @tf.function(autograph=False)
    def reduce(a, b):
        with tf.device(devices[0]):
            a = tf.identity(a)
        with tf.device(devices[1]):
            b = tf.identity(b)
        return tp.reduce_sum([a, b], devices, ops, "r")

    a, b = tf.constant([1.0, 2.0]), tf.constant([10.0, 20.0])
    np.testing.assert_array_equal(reduce(a, b), [11.0, 22.0])
    graph = reduce.get_concrete_function(a, b).graph
    collectives = [op for op in graph.get_operations() if op.type.startswith("CollectiveReduce")]
    assert sorted(op.device for op in collectives) == sorted(devices)
    assert not [op for op in graph.get_operations() if op.type in ("AddN", "AddV2", "Add")]


def test_contradictory_or_unsupported_arguments_are_refused_at_construction():
    layout_map = megatron_layout()
    with pytest.raises(ValueError, match="tensor_parallel=1"):
        tfpar.PipelineStrategy(cpus(2), layout_map=layout_map)
    with pytest.raises(ValueError, match="needs a layout_map"):
        tfpar.PipelineStrategy(cpus(4), tensor_parallel=2)
    with pytest.raises(DeviceError, match="tensor_parallel=2"):
        tfpar.PipelineStrategy(cpus(3), tensor_parallel=2, layout_map=layout_map)
    # The devices counted as passed, R x K x T of them (6 devices in 3 groups of T=2; this
    # process has 4 CPUs).
    from tfpar.distribute.pipeline.pipeline_config import _stage_count
    with pytest.raises(DeviceError, match=r"\(2 x 2 x 2 = 8\) must equal the number of "
                                          r"devices \(6\).*Pass 8 devices"):
        _stage_count(3, num_replicas=2, num_stages=2, tensor_parallel=2)
    with pytest.raises(DeviceError, match=r"6 devices do not split into 2 .*multiple of 4"):
        _stage_count(3, num_replicas=2, num_stages=None, tensor_parallel=2)
    mesh = keras.distribution.DeviceMesh((2, 2), ("pipe", "model"), cpus(4))
    with pytest.raises(ValueError, match="'model' of size 2.*tensor_parallel=4"):
        tfpar.PipelineStrategy(cpus(4), num_stages=1, tensor_parallel=4, layout_map=(
            megatron_layout(keras.distribution.DeviceMesh((2,), ("model",), cpus(2)))))
    with pytest.raises(ValueError, match="'pipe' of size 2.*num_stages=1"):
        tfpar.PipelineStrategy(cpus(2), num_stages=1, tensor_parallel=2,
                               layout_map=megatron_layout(mesh))
    for kwargs, name in (({"balance_by": "time"}, "balance_by"),
                         ({"schedule": "2bw"}, "schedule")):
        with pytest.raises(ValueError, match=f"does not run with .*{name}"):
            tfpar.PipelineStrategy(cpus(4), tensor_parallel=2, layout_map=layout_map,
                                   **kwargs)


def test_memory_is_not_planned_or_reported_yet():
    strategy, model = _trained("adam", "1f1b")
    with pytest.raises(NotImplementedError, match="tensor-parallel"):
        tfpar.plan.estimate_memory(model, strategy)
    with pytest.raises(NotImplementedError, match="tensor-parallel"):
        strategy.memory_report(model)


gpt2, gpt2_layout = common.gpt2, common.gpt2_layout


def _subclassed_decoder():
    import keras_hub

    class Decoder(keras_hub.layers.TransformerDecoder):
        """A block tfpar does not know: its code may need a split layer's whole output."""

    return Decoder


@pytest.mark.parametrize("replicated", [True, False])
def test_layers_inside_a_keras_hub_transformer_block_are_split_and_train_as_one_device(
        replicated):
    """A Transformer block is one node of the model graph: its layers are split where the
    block calls them, 2 stages x 2 devices, Adam: equal to one device, each shard on its
    device. keras-hub's block runs replicated (Megatron's: every device runs the block,
    row sums all-reduced by peer collectives, no sum on a first device); a block class
    tfpar does not know runs on the stage's first device, its attention by heads (each
    device's scores and softmax its own) and its MLP's column slices handed to the row
    layer (no gather is read)."""
    block = None if replicated else _subclassed_decoder()
    rng = np.random.default_rng(0)
    x = rng.integers(0, 16, (32, 8)).astype("int32")
    y = rng.integers(0, 16, (32, 8)).astype("int32")
    strategy = tfpar.PipelineStrategy(cpus(4), num_stages=2, num_micro_batches=2,
                                      schedule="1f1b", tensor_parallel=2,
                                      layout_map=gpt2_layout())
    model = _trains_as_one_device(functools.partial(gpt2, block=block), strategy, x, y)
    stages = strategy.stages(model)
    assert "transformer_layer_0" in stages[0] and "transformer_layer_1" in stages[1], stages
    ops = _traced_step(strategy, model, x[:16], y[:16]).get_operations()
    if replicated:
        _check_blocks_replicated(ops, blocks_per_stage=1)
    else:
        _check_attention_by_heads_and_slices_handed(ops, blocks_per_stage=1)
    if not replicated:
        return
    # 2 blocks x 10 split variables (q, k, v kernels and biases, the output kernel, the
    # MLP's two kernels and the first's bias) x 2 shards, each with its Adam state on the
    # device of its stage and rank: stage s on CPUs 2s, 2s + 1.
    slots = [v for v in model.optimizer.variables if "_shard" in v.path]
    assert len(slots) == 2 * 10 * 2 * 2
    query = [v for v in model.optimizer.variables
             if v.path.endswith("kernel_shard1_momentum") and v.shape == (16, 1, 8)]
    assert sorted(_device_index(_copies(v)[0].device) for v in query) == [1, 1, 1, 3, 3, 3]


def _head_size_layout():
    layout_map = keras.distribution.LayoutMap(None)
    layout_map[r".*self_attention/(query|key|value)/kernel"] = (None, None, "model")
    layout_map[r".*self_attention/attention_output/kernel"] = (None, "model", None)
    return layout_map


def _column_only_layout():
    layout_map = keras.distribution.LayoutMap(None)
    layout_map[r".*feedforward_intermediate_dense/kernel"] = (None, "model")
    return layout_map


@pytest.mark.parametrize("layout", [_head_size_layout, _column_only_layout])
def test_a_block_whose_shares_need_a_whole_output_runs_on_the_first_device(layout):
    """Attention split by head size (each device's scores would be partial sums), or an
    MLP column read whole by an unsplit layer: each device could not compute its share of
    the block alone, so the block runs on the stage's first device (no peer all-reduce),
    equal to one device."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 16, (32, 8)).astype("int32")
    y = rng.integers(0, 16, (32, 8)).astype("int32")
    strategy = tfpar.PipelineStrategy(cpus(2), num_stages=1, num_micro_batches=2,
                                      tensor_parallel=2, layout_map=layout())
    model = _trains_as_one_device(gpt2, strategy, x, y, epochs=1)
    ops = _traced_step(strategy, model, x[:16], y[:16]).get_operations()
    assert not _all_reduces(ops)


def _llama(vocabulary=16, length=8):
    """A Llama-shaped decoder of keras-hub's blocks: rotary positions, 4 query heads sharing
    2 key/value heads, a gated MLP; causal."""
    import keras_hub

    keras.utils.set_random_seed(0)
    tokens = keras.Input((length,), dtype="int32")
    x = keras.layers.Embedding(vocabulary, 16, name="embed")(tokens)
    for i in range(2):
        x = keras_hub.src.models.llama.llama_decoder.LlamaTransformerDecoder(
            32, 4, 2, name=f"block_{i}")(x)
    model = keras.Model(tokens, keras.layers.Dense(vocabulary, name="lm_head")(x))
    model.compile(keras.optimizers.Adam(0.01, epsilon=1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _masked_attention(vocabulary=16, length=8):
    """Keras' own MultiHeadAttention as a node of the model, on an input whose padding
    rides as a Keras mask (Embedding(mask_zero=True))."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((length,), dtype="int32")
    x = keras.layers.Embedding(vocabulary, 16, mask_zero=True, name="embed")(tokens)
    x = keras.layers.MultiHeadAttention(4, 4, name="attention")(x, x)
    model = keras.Model(tokens, keras.layers.Dense(vocabulary, name="lm_head")(x))
    # A summed loss: a pipeline refuses a masked mean (its divisor is the whole batch's).
    model.compile(keras.optimizers.Adam(0.01, epsilon=1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum"))
    return model


def _heads_layout(mlp):
    layout_map = keras.distribution.LayoutMap(None)
    layout_map[r".*attention/(query|key|value)/kernel"] = (None, "model", None)
    layout_map[r".*attention/attention_output/kernel"] = ("model", None, None)
    if mlp:
        layout_map[r".*feedforward_(intermediate|gate)_dense/kernel"] = (None, "model")
        layout_map[r".*feedforward_output_dense/kernel"] = ("model", None)
    return layout_map


@pytest.mark.parametrize("make, stages", [(_llama, 2), (_masked_attention, 1)])
def test_attention_runs_by_heads_on_each_device_and_trains_as_one_device(make, stages):
    """Llama's attention (rotary positions, grouped key/value heads) in keras-hub's block,
    and Keras' MultiHeadAttention as a node on a masked input: each device runs its share
    of the heads, equal to one device (1e-5)."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 16, (32, 8)).astype("int32")
    x[::3, 5:] = 0  # Padding: masked out where the embedding masks zeros.
    y = rng.integers(0, 16, (32, 8)).astype("int32")
    strategy = tfpar.PipelineStrategy(cpus(2 * stages), num_stages=stages, num_micro_batches=M,
                                      tensor_parallel=2, layout_map=_heads_layout(make is _llama))
    model = _trains_as_one_device(make, strategy, x, y)
    ops = _traced_step(strategy, model, x[:16], y[:16]).get_operations()
    softmax = [_device_index(op.device) for op in ops if op.type == "Softmax"]
    assert sorted(set(softmax)) == list(range(2 * stages)), softmax
    assert all(softmax.count(d) == M for d in range(2 * stages)), softmax


def test_an_attention_it_cannot_run_by_heads_runs_with_its_projections_gathered():
    """Dropout on the attention's scores (a share of the heads would draw another mask than
    the whole layer draws), a gate, or a class not known to run head by head."""
    def attention(**kwargs):
        layer = keras.layers.MultiHeadAttention(2, 4, **kwargs)
        layer(np.zeros((1, 3, 8), "float32"), np.zeros((1, 3, 8), "float32"))
        return layer

    assert keras_tp.attention_projections(attention()) is not None
    assert keras_tp.attention_projections(attention(dropout=0.1)) is None

    class Custom(keras.layers.MultiHeadAttention):
        pass

    layer = Custom(2, 4)
    layer(np.zeros((1, 3, 8), "float32"), np.zeros((1, 3, 8), "float32"))
    assert keras_tp.attention_projections(layer) is None


def _check_blocks_replicated(ops, blocks_per_stage, stages=((0, 1), (2, 3))):
    """Each block ran on every device of its stage: its layer norms (a Mean each) and
    softmax there, and per block and micro-batch 4 all-reduces on each device (the
    attention's and the MLP's row sums forward, their column inputs' gradients backward;
    one for query, key and value together), and no sum on one device."""
    def on(op_type, name=""):
        return [_device_index(op.device) for op in ops if op.type == op_type and name in op.name]

    reduces = on("CollectiveReduceV2", tensor_groups.ALL_REDUCE)
    for d in (d for stage in stages for d in stage):
        assert on("Softmax").count(d) == blocks_per_stage * M
        assert on("Mean").count(d) >= 2 * blocks_per_stage * M
        assert reduces.count(d) == 4 * blocks_per_stage * M, reduces
    assert not [op for op in ops if op.type == "AddN" and (
        tp.FORWARD_REDUCTION in op.name or tp.BACKWARD_REDUCTION in op.name)]


def _check_attention_by_heads_and_slices_handed(ops, blocks_per_stage, stages=((0, 1), (2, 3))):
    # One softmax per block and micro-batch on every device of its stage (its heads), and
    # the scores' products backward there too: no attention core runs whole on one device.
    softmax = [_device_index(op.device) for op in ops if op.type == "Softmax"]
    backward = [_device_index(op.device) for op in ops
                if op.type == "BatchMatMulV2" and "gradient" in op.name.lower()]
    for d in (d for stage in stages for d in stage):
        assert softmax.count(d) == blocks_per_stage * M, softmax
        assert backward.count(d) == backward.count(stages[0][0]) > 0, backward
    # A column layer's gather is built for Keras (the block's output), but no op reads it.
    gathers = [op for op in ops if op.type == "ConcatV2" and op.name.endswith(tp.GATHER)]
    assert gathers and not [op for op in gathers if op.outputs[0].consumers()]


def test_a_layout_on_a_weight_no_dense_layer_of_a_block_owns_is_refused():
    layout_map = gpt2_layout()
    layout_map[r".*self_attention_layer_norm/gamma"] = ("model",)
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=1, tensor_parallel=2,
                                      layout_map=layout_map)
    with pytest.raises(PlacementError, match=r"transformer_layer_0/self_attention_layer_norm/"
                                             r"gamma, a weight of layer 'transformer_layer_0' "
                                             r"\(TransformerDecoder\) that no Dense"):
        with strategy.scope():
            model = gpt2()
        strategy.stages(model)


def _placed(layers, layout):
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=1, tensor_parallel=2,
                                      layout_map=layout)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4, 4, 2) if isinstance(
            layers[0], keras.layers.Conv2D) else (4,))] + layers)
    return strategy.stages(model)


def _layout(**entries):
    layout_map = keras.distribution.LayoutMap(None)
    for key, value in entries.items():
        layout_map[key.replace("_S_", "/")] = value
    return layout_map


@pytest.mark.parametrize("layers, layout, message", [
    (lambda: [keras.layers.Conv2D(4, 3, name="conv")],
     {".*conv_S_kernel": (None, None, None, "model")}, r"key '\.\*conv/kernel'.*'conv' \(Conv2D\)"),
    (lambda: [keras.layers.Dense(5, name="odd")], {".*odd_S_kernel": (None, "model")},
     r"key '\.\*odd/kernel'.*'odd' by output units \(5\) over tensor_parallel=2"),
    (lambda: [keras.layers.EinsumDense("ab,bc->ac", 4, name="ein")],
     {".*ein_S_kernel": ("model", "model")}, r"'ein' the layout \('model', 'model'\)"),
    (lambda: [keras.layers.Embedding(8, 4, name="emb")],
     {".*emb_S_embeddings": (None, "model")}, r"'emb' \(Embedding\)"),
    (lambda: [keras.layers.Dense(4, name="d")], {".*d_S_bias": ("model",)},
     r"bias of layer 'd' but not its kernel"),
    (lambda: [keras.layers.Dense(4, name="r")],
     {".*r_S_kernel": ("model", None), ".*r_S_bias": ("model",)}, r"row layer"),
    (lambda: [keras.layers.Dense(4, name="b")], {".*b_S_kernel": ("batch", "model")},
     r"over mesh axes \['batch'\]"),
    (lambda: [keras.layers.Dense(4, name="c", kernel_constraint="non_neg")],
     {".*c_S_kernel": (None, "model")}, r"'c' cannot be split.*kernel_constraint"),
    # A misspelt key would leave its layer whole and a device idle, without a word.
    (lambda: [keras.layers.Dense(4, name="d1")],
     {".*d1_S_kernel": (None, "model"), ".*dl_S_kernel": (None, "model")},
     r"key\(s\) '\.\*dl/kernel' match no variable.*paths are sequential.*/d1/kernel"),
])
def test_layouts_it_cannot_run_are_refused_before_the_first_step(layers, layout, message):
    with pytest.raises(PlacementError, match=message):
        _placed(layers(), _layout(**layout))


def test_the_degrees_and_devices_can_be_said_once_by_the_layout_maps_device_mesh():
    """A DeviceMesh with axes "data", "pipe" and "model" gives R, K, T and the devices (its
    array read replica-major, then stage, then model axis, whatever the axes' order)."""
    mesh = keras.distribution.DeviceMesh((2, 2), ("model", "pipe"),
                                         devices=[["cpu:0", "cpu:2"], ["cpu:1", "cpu:3"]])
    strategy = tfpar.PipelineStrategy(num_micro_batches=M, schedule="1f1b",
                                      layout_map=megatron_layout(mesh))
    assert (strategy.num_stages, len(strategy.stage_devices)) == (2, 1)
    assert [[[_device_index(d) for d in stage] for stage in replica]
            for replica in strategy.tensor_parallel_devices] == [[[0, 1], [2, 3]]]
    _, want = _trained("adam", None)
    x, y = _data()
    with strategy.scope():
        model = megatron_mlp()
        model.compile(_optimizer("adam"), "mse")
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    _check_equal(model, want, "mesh")
    rows = keras.distribution.LayoutMap(keras.distribution.DeviceMesh(
        (2,), ("rows",), devices=["cpu:0", "cpu:1"]))
    rows[".*mlp_in_0/kernel"] = (None, "rows")
    with pytest.raises(ValueError, match=r"axes \['rows'\], which a PipelineStrategy does not"):
        tfpar.PipelineStrategy(layout_map=rows)


def _float_edges(ops, within_actions=True):
    """(producer device, consumer device, elements, producer op) for each float tensor an op
    reads from another device, once per (tensor, device); without shape-only readers."""
    seen, edges = set(), []
    for op in ops:
        if op.type in ("ZerosLike", "Shape", "OnesLike"):
            continue  # (Only the shape is read: grappler sends no values for these.)
        for x in op.inputs:
            if not x.dtype.is_floating or not x.op.device or not op.device:
                continue
            a, b = _device_index(x.op.device), _device_index(op.device)
            if a == b or (x.name, b) in seen:
                continue
            if within_actions and (_action_of(x.op) is None or _action_of(op) is None):
                continue
            seen.add((x.name, b))
            edges.append((a, b, x.shape.num_elements(), x.op))
    return edges


def test_stage_boundaries_cross_rank_to_rank_by_slices_and_all_gathers():
    """Megatron's scatter-gather between two tensor-parallel stages (K=2 x T=2): device t of
    stage 0 sends its t-th slice of rows of each micro-batch's activation to device t of
    stage 1 (CPU 2 + t), which all-gather; the gradient comes back the same way, slice by
    slice, and stage 0's devices all-gather it. No whole activation leaves one device for
    the next stage, and no copy of a stage's output is sent to its first device (the
    slices' shapes are those of one rank's rows: 1/T of the micro-batch)."""
    strategy, model = _trained("sgd_momentum", "1f1b")
    ops = _traced_step(strategy, model).get_operations()
    rows = BATCH // M
    crossing = [(a, b, n) for a, b, n, _ in _float_edges(ops) if (a < 2) != (b < 2)]
    assert crossing, "nothing crossed between the stages"
    assert sorted({(a, b) for a, b, _ in crossing}) == [(0, 2), (1, 3), (2, 0), (3, 1)]
    assert {n for _, _, n in crossing} == {rows // 2 * H}, crossing
    assert len(crossing) == 2 * 2 * M  # Each rank, each way, each micro-batch.
    gathers = [op for op in ops if op.type == "CollectiveGatherV2"
               and tensor_groups.ALL_GATHER in op.name]
    for d in range(4):
        mine = [_action_of(op) for op in gathers if _device_index(op.device) == d]
        # Stage 1 gathers each micro-batch's slices; stage 0 each one's gradient slices.
        assert mine.count("F" if d >= 2 else "B") == M, (d, mine)
    # Within a stage the first device copies the others what it alone computed (the
    # embedding's output, the loss's gradient): nothing is sent to it but scalars (the
    # ties of `tensor_groups.leave`, not each copy of the stage's output).
    within = [(a, b, n) for a, b, n, _ in _float_edges(ops) if (a < 2) == (b < 2)]
    assert all(n is not None and n <= rows * H for _, _, n in within), within
    assert not [(a, b, n) for a, b, n in within if a > b and n > 1], within


def test_a_first_column_layer_reads_its_input_spread_from_where_it_is_fed():
    """A model whose first layer is a column layer (T=2, one stage): the micro-batch is cut
    where it is fed (CPU 0), each device gets its half of the rows and all-gathers the
    rest, as Megatron's ranks share a batch; training equals one device."""
    from tfpar.cli.train import megatron_layout_map

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((12,))] + [
            keras.layers.Dense(16, activation="relu", name=f"hidden_{i}") for i in range(2)]
            + [keras.layers.Dense(3, name="head")])
        model.compile(keras.optimizers.Adam(0.01), "mse")
        return model

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 12)).astype("float32"), rng.normal(size=(32, 3)).astype(
        "float32")
    strategy = tfpar.PipelineStrategy(cpus(2), num_micro_batches=M, tensor_parallel=2,
                                      layout_map=megatron_layout_map(2))
    model = _trains_as_one_device(make, strategy, x, y)
    ops = _traced_step(strategy, model, x[:16], y[:16]).get_operations()
    sent = [n for a, b, n, _ in _float_edges(ops, within_actions=False) if (a, b) == (0, 1)]
    rows = 16 // M
    assert rows // 2 * 12 in sent and rows * 12 not in sent, sent
    gathers = [op for op in ops if op.type == "CollectiveGatherV2"
               and tensor_groups.ALL_GATHER in op.name and _action_of(op) == "F"]
    assert sorted(_device_index(op.device) for op in gathers) == [0] * M + [1] * M


def test_keras_hub_blocks_run_replicated_under_a_zero_bubble_schedule():
    """GPT-2 blocks (K=2 x T=2) with zero bubble, whose backward is split into an input
    pass (I) and a deferred weight pass (W): the blocks run replicated and train as one
    device. Each device's all-reduces run in its forwards and input passes: a first
    stage's backward all-reduces feed only its weights, and deferred to W they held every
    later collective of the device (its ordering token) behind a W that waits for them:
    "7188 nodes in a cycle" before they stayed in I."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 16, (32, 8)).astype("int32")
    y = rng.integers(0, 16, (32, 8)).astype("int32")
    micro = 4  # (With 2, no forward runs between a first stage's I and its W.)
    strategy = tfpar.PipelineStrategy(cpus(4), num_stages=2, num_micro_batches=micro,
                                      schedule="zero_bubble_h1", tensor_parallel=2,
                                      layout_map=gpt2_layout())
    model = _trains_as_one_device(gpt2, strategy, x, y)
    ops = _traced_step(strategy, model, x[:16], y[:16]).get_operations()
    reduces = [op for op in _all_reduces(ops)]
    for d in range(4):  # 2 forward, 2 backward per block and micro-batch, on every device.
        mine = [_action_of(op) for op in reduces if _device_index(op.device) == d]
        assert mine.count("F") == mine.count("I") == 2 * micro, (d, mine)
    actions = {_action_of(op) for op in ops if op.type.startswith("Collective")}
    assert actions <= {"F", "I"}, actions


def test_a_tensorflow_checkpoint_saves_each_split_variable_whole_as_its_shards_slices(
        tmp_path):
    """`tf.train.Checkpoint(model=...).write` of a tensor-parallel pipeline: each split
    variable is saved once, under its own key and whole shape, as its T shards' slices (each
    written where its shard lives: across processes, by its owner); the optimizer's hold on
    the shards saves nothing more. A model built without a strategy reads the weights
    exactly, and so does the split model again, each shard from its own slice (TensorFlow
    alone would hand each variable one slice), and a model split T=4 (resharded: each
    quarter cut from the saved halves)."""
    strategy, model = _trained("adam", "1f1b")
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    saved = dict(tf.train.list_variables(path))
    split = [v for v in model.weights if keras_tp.sharded_storage(v) is not None]
    assert split
    whole = [shape for name, shape in saved.items() if "_operations" in name]
    assert sorted(whole) == sorted(list(v.shape) for v in split), saved
    assert not [n for n in saved if "_trainable_variables" in n
                and saved[n] not in [list(v.shape) for v in model.weights]], saved
    reader = tf.train.load_checkpoint(path)
    for variable in split:
        key = next(n for n, shape in saved.items()
                   if "_operations" in n and shape == list(variable.shape)
                   and np.array_equal(reader.get_tensor(n), variable.numpy()))
        assert key
    plain = megatron_mlp()
    tf.train.Checkpoint(model=plain).read(path).assert_existing_objects_matched()
    for got, expected in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, expected)
    # Read back into the split model: each shard takes its own slice (TensorFlow's own
    # restore would hand each variable one slice: tfpar groups them, `variable_birth`).
    saved_weights = model.get_weights()
    model.set_weights([np.zeros_like(w) for w in saved_weights])
    tf.train.Checkpoint(model=model).read(path).assert_existing_objects_matched()
    for got, expected in zip(model.get_weights(), saved_weights):
        np.testing.assert_array_equal(got, expected)
    # Resharded: into one stage split T=4 (built and split by a predict before any
    # training), each shard a quarter cut from the saved halves; it predicts as the plain
    # model. (The optimizer's state is per shard: it carries over into the same layout
    # only, so this model's optimizer is not built.)
    four = tfpar.PipelineStrategy(cpus(4), num_stages=1, num_micro_batches=M,
                                  tensor_parallel=4, layout_map=megatron_layout())
    with four.scope():
        other = megatron_mlp(seed=1)
        other.compile(_optimizer("adam"), "mse")
    x, _ = _data()
    other.predict(x[:BATCH], verbose=0)
    assert {len(keras_tp.sharded_storage(v).shards) for v in other.weights
            if keras_tp.sharded_storage(v) is not None} == {4}
    tf.train.Checkpoint(model=other).read(path).expect_partial()
    for got, expected in zip(other.get_weights(), saved_weights):
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_allclose(other.predict(x, batch_size=BATCH, verbose=0),
                               plain.predict(x, batch_size=BATCH, verbose=0), atol=1e-5)
