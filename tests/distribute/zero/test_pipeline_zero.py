"""PipelineStrategy(num_replicas=R, shard=...): ZeRO stages 1-3 over each stage's R replicas
(DeepSpeed's pipeline + ZeRO) train as one device, keep each stage's state divided over its
replicas (read off the devices of the built variables), and are planned as measured."""

import contextlib
import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar.keras import internals

from conftest import cpus, small_model, tf_functions_in, toy_data
from tfpar.viz.pipeline_trace import action_of_op
# The data-parallel ZeRO tests' stages, loss, batch, optimizers and balanced model.
from test_sharded import BATCH, LOSS, STAGES, _optimizer, balanced_memory_report


def _strategy(shard, schedule="1f1b", **kwargs):
    # K=2 stages x R=2 replicas on 4 CPUs: replica r's stage s on /cpu:(2r + s).
    return tfpar.PipelineStrategy(cpus(4), num_micro_batches=2, num_replicas=2,
                                  schedule=schedule, shard=shard, **kwargs)


def _fit(strategy, optimizer, epochs=2):
    x, y = toy_data(n=64)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = small_model()
        model.compile(_optimizer(optimizer), LOSS)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model


@functools.lru_cache(maxsize=None)
def _trained(shard, optimizer, schedule="1f1b", **kwargs):
    """(strategy, model) after 2 epochs (8 steps), shared by the tests."""
    strategy = None if shard == "one device" else _strategy(shard, schedule, **kwargs)
    return strategy, _fit(strategy, optimizer)


def _copies(strategy, variable):
    """The tf.Variables holding a Keras variable (one per copy), from the built strategy."""
    return strategy.experimental_local_results(internals.attr(variable, "_value"))


def _device(tensor_or_variable):
    return tf.DeviceSpec.from_string(tensor_or_variable.device).device_index


def _check_equal(model, label, shard):
    _, want = _trained("one device", label[0])
    initial = small_model().get_weights()
    assert max(np.abs(w - w0).max() for w, w0 in zip(model.get_weights(), initial)) > 1e-3
    for got, expected in zip(model.get_weights(), want.get_weights()):
        np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=str(label + (shard,)))


@pytest.mark.parametrize("shard", STAGES)
def test_every_stage_trains_as_one_device_with_gpipe_and_1f1b(shard):
    for optimizer in ("sgd_momentum", "adam"):
        for schedule in ("gpipe", "1f1b"):
            strategy, model = _trained(shard, optimizer, schedule)
            _check_equal(model, (optimizer, schedule), shard)
            if shard == "parameters":
                continue
            # Every copy of a stage's variable took the owner's update (all-gathered).
            for variable in model.weights:
                copies = [c.numpy() for c in _copies(strategy, variable)]
                assert len(copies) == 2
                np.testing.assert_array_equal(copies[1], copies[0])


def test_remat_and_offloaded_activations_under_stage_3():
    _, model = _trained("parameters", "adam", remat=True, offload_activations=True)
    _check_equal(model, ("adam", "1f1b remat offload"), "parameters")


def _five_layers():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,))]
                            + [keras.layers.Dense(8, activation="tanh") for _ in range(4)]
                            + [keras.layers.Dense(3)])


@pytest.mark.parametrize("shard, schedule, virtual_stages", [
    ("optimizer", "zero_bubble_h1", 1), ("parameters", "interleaved_1f1b", 2)])
def test_split_backward_and_interleaved_schedules(shard, schedule, virtual_stages):
    """Zero-bubble H1 (input and weight gradients apart) and interleaved 1F1B (two chunks
    per device, whose variables share their device's owners)."""
    x, y = toy_data(n=64)
    models = []
    for strategy in (None, _strategy(shard, schedule, virtual_stages=virtual_stages)):
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            model = _five_layers()
            model.compile(_optimizer("adam"), LOSS)
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        models.append(model)
    for got, want in zip(models[1].get_weights(), models[0].get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)


def _stage_devices(strategy, variable):
    """The devices of the copies of `variable` under an unsharded twin: its stage's R
    devices, read from where the mirrored copies live."""
    return {_device(c) for c in _copies(strategy, variable)}


def _slots_by_variable(model):
    """The optimizer state variables of each trainable variable, in order (Keras names each
    slot after its variable's path)."""
    found = []
    for variable in model.trainable_variables:
        prefix = variable.path.replace("/", "_") + "_"
        found.append([s for s in model.optimizer.variables
                      if s.name.startswith(prefix)
                      and s.name[len(prefix):] in ("momentum", "velocity")])
    return found


@pytest.mark.parametrize("shard", ["optimizer", "parameters"])
def test_each_replica_of_a_stage_holds_only_its_share_of_the_optimizer_state(shard):
    """Counted from the built variables' devices: each slot has one copy, on one of its
    variable's stage devices, and both devices of each stage hold a part; the unsharded
    pipeline (the same count) keeps two copies of everything. Under stage 3 the variables
    too."""
    mirrored, unsharded_model = _trained(None, "adam")
    strategy, model = _trained(shard, "adam")
    # Each trainable variable's stage devices (in model order, the same in both models).
    stage_of = [_stage_devices(mirrored, v) for v in unsharded_model.trainable_variables]
    assert set(map(frozenset, stage_of)) == {frozenset({0, 2}), frozenset({1, 3})}
    for name, (m, label) in {"unsharded": (unsharded_model, None),
                             "sharded": (model, shard)}.items():
        held = {}  # device -> bytes of optimizer state
        per_slot = []
        for path, slots in enumerate(_slots_by_variable(m)):
            assert len(slots) == 2, (name, path, slots)  # Adam: momentum and velocity.
            for slot in slots:
                copies = _copies(mirrored if label is None else strategy, slot)
                per_slot.append(len(copies))
                for copy in copies:
                    assert _device(copy) in stage_of[path], (name, path, copy.device)
                    held[_device(copy)] = held.get(_device(copy), 0) + np.prod(copy.shape) * 4
                    if label is not None:  # The owner's state has trained (Adam's moments).
                        assert np.abs(copy.numpy()).max() > 0, (path, slot.name)
        total = sum(np.prod(s.shape) * 4 for slots in _slots_by_variable(m) for s in slots)
        if label is None:
            assert set(per_slot) == {2} and sum(held.values()) == 2 * total
            continue
        assert set(per_slot) == {1}, per_slot
        assert sum(held.values()) == total
        # Each of the 4 devices holds a part of its stage's state, none all of it.
        for stage in ({0, 2}, {1, 3}):
            stage_total = sum(held[d] for d in stage)
            assert all(0 < held[d] < stage_total for d in stage), held
    trainable = [_copies(strategy, v) for v in model.trainable_variables]
    if shard == "parameters":
        assert all(len(c) == 1 for c in trainable)
        for stage, copies in zip(stage_of, trainable):
            assert _device(copies[0]) in stage
        assert {_device(c[0]) for c in trainable} == {0, 1, 2, 3}
    else:
        assert all(len(c) == 2 for c in trainable)


def test_checkpoints_are_unsharded_and_load_on_one_device(tmp_path):
    _, sharded = _trained("parameters", "adam", "gpipe")
    path = str(tmp_path / "pipeline_zero3.weights.h5")
    sharded.save_weights(path)
    one_device = small_model(seed=7)
    one_device.compile(_optimizer("adam"), LOSS)
    one_device.optimizer.build(one_device.trainable_variables)
    one_device.load_weights(path)
    for got, want in zip(one_device.get_weights(), sharded.get_weights()):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(one_device.optimizer.variables, sharded.optimizer.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


@pytest.mark.parametrize("shard, per_param", [
    (None, 16), ("optimizer", 8 + 8 / 2), ("gradients", 4 + 12 / 2), ("parameters", 16 / 2)])
def test_measured_bytes_per_device_match_zero_over_each_stage(shard, per_param):
    """fp32 Adam, K=2 x R=2, eight equal Dense layers (four per stage, two per owner): each
    device holds its stage's state divided as ZeRO divides it over 2 replicas (bytes per
    parameter of its stage), measured from where the variables live;
    `tfpar.plan.estimate_memory` of the strategy agrees."""
    strategy = _strategy(shard)
    report = balanced_memory_report(strategy)
    assert len(report.devices) == 4 and report.config.num_replicas == 2
    stage_params = report.num_params / 2
    for device in report.devices:
        resident = device.weights + device.gradients + device.optimizer
        assert abs(resident / stage_params - per_param) / per_param < 0.05, (shard, device)
        # Stage 3: the stage's variables it reads from the other owner, all kept.
        gathered = stage_params * 4 - device.weights if shard == "parameters" else 0
        assert device.gather_buffer == gathered, (shard, device)


def test_what_the_combination_cannot_do_is_refused_at_construction():
    with pytest.raises(ValueError, match="with num_replicas=1 there is one copy.*Pass "
                                         "num_replicas=2 or more"):
        tfpar.PipelineStrategy(cpus(2), num_replicas=1, shard="optimizer")
    with pytest.raises(ValueError, match="Use schedule='1f1b' .* with shard"):
        _strategy("gradients", schedule="2bw")
    with pytest.raises(ValueError, match="balance_by='time'.*Use balance_by='params'"):
        _strategy("parameters", balance_by="time")
    with pytest.raises(ValueError, match="shard must be None .*Received: shard='zero1'"):
        _strategy("zero1")


def test_an_optimizer_that_cannot_be_sharded_is_refused_before_any_step():
    strategy = _strategy("optimizer")
    with strategy.scope():
        model = small_model()
        model.compile(keras.optimizers.Adafactor(), LOSS)
    x, y = toy_data(n=16)
    with pytest.raises(ValueError, match=r"PipelineStrategy\(shard='optimizer'\) cannot shard "
                                         r"Adafactor"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


def _forward_reads(model):
    """{(replica, micro-batch): ReadVariableOp nodes} of the forward actions of the traced
    pipeline step that fit ran (named by action: `pipeline_r0/1F2/...`)."""
    functions = [c for f in tf_functions_in(model.train_function)
                 for c in f._list_all_concrete_functions()]
    reads = {}
    for concrete in functions:
        for function in concrete.graph.as_graph_def().library.function:
            for node in function.node_def:
                found = action_of_op(node.name)
                if node.op == "ReadVariableOp" and found and "F" in found[1]:
                    micro_batch = int(found[1].split("F")[1])
                    reads[found[0], micro_batch] = reads.get((found[0], micro_batch), 0) + 1
    return reads


@pytest.mark.parametrize("remat", [False, True])
def test_stage_3_reads_each_weight_from_its_owner_once_per_step_not_per_micro_batch(
        remat, monkeypatch):
    """Counted in the traced step (R=2, M=4): a replica's forward passes read the stage
    variables in their first micro-batch only (its copies for the step), where they read
    them in every micro-batch before, M x (R-1)/R of the stage's weights from the owners per
    device and step. Equal to one device, with and without remat (whose rerun reads the
    copies too)."""
    from tfpar.distribute.pipeline import execution

    counts = {}
    for once in (True, False):
        if not once:  # As before: every micro-batch reads the variables.
            init = execution.TrainStep.__init__
            monkeypatch.setattr(execution.TrainStep, "__init__", lambda self, *a, **k: init(
                self, *a, **{**k, "copy_weights_once": False}))
        strategy = tfpar.PipelineStrategy(cpus(4), num_micro_batches=4, num_replicas=2,
                                          schedule="1f1b", shard="parameters", remat=remat)
        x, y = toy_data(n=64)
        with strategy.scope():
            model = small_model()
            model.compile(_optimizer("adam"), LOSS)
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        _check_equal(model, ("adam", f"1f1b remat={remat} once={once}"), "parameters")
        counts[once] = _forward_reads(model)
    variables = len(model.trainable_variables)
    # Replica 0's actions (the other replica's ops carry its replica's name scope first):
    # copies, every variable read once, at the first micro-batch of its stage.
    assert counts[True] == {(0, 0): variables}, counts
    # Before: read again in every micro-batch.
    assert counts[False] == {(0, m): variables for m in range(4)}, counts
