"""DataParallelStrategy(shard=...): ZeRO stages 1-3 train as unsharded, keep state sharded,
and save full, unsharded checkpoints."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar.distribute.zero.zero_collectives import ShardCollectives
from tfpar.keras import internals

from conftest import cpus, small_model, toy_data

STAGES = ["optimizer", "gradients", "parameters"]
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
BATCH = 16


def _optimizer(name):
    return (keras.optimizers.SGD(0.1, momentum=0.9) if name == "sgd_momentum"
            else keras.optimizers.Adam(0.01))


def _compiled(strategy, optimizer):
    with strategy.scope():
        model = small_model()
        model.compile(_optimizer(optimizer), LOSS)
    return model


def _fit(strategy, optimizer, x, y, epochs=2):
    model = _compiled(strategy, optimizer)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model


def _device(variable):
    return tf.DeviceSpec.from_string(internals.attr(variable, "_value").device).device_index


def _components(strategy, variable):
    value = internals.attr(variable, "_value")
    return strategy.experimental_local_results(value)


def _state(optimizer):
    # Per-variable state, without the step counter and learning rate.
    return [v for v in optimizer.variables
            if v is not optimizer.iterations and v.name != "learning_rate"]


@pytest.fixture(scope="session")
def data():
    return toy_data(n=64)


@pytest.fixture(scope="session")
def unsharded(data):
    x, y = data
    return {name: _fit(tfpar.DataParallelStrategy(cpus(2)), name, x, y)
            for name in ("sgd_momentum", "adam")}


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam"])
def test_every_stage_trains_as_unsharded_with_its_state_on_owners(unsharded, data, optimizer):
    x, y = data
    want = unsharded[optimizer]
    initial = small_model().get_weights()
    for shard in STAGES:
        for n in (2, 4):
            strategy = tfpar.DataParallelStrategy(cpus(n), shard=shard)
            model = _fit(strategy, optimizer, x, y)
            label = f"shard={shard} replicas={n}"
            assert max(np.abs(w - w0).max()
                       for w, w0 in zip(model.get_weights(), initial)) > 1e-3, label
            for got, expected in zip(model.get_weights(), want.get_weights()):
                np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=label)
            # Every replica's copy of a mirrored variable was updated (all-gathered).
            for variable in model.weights:
                copies = [c.numpy() for c in _components(strategy, variable)]
                for copy in copies[1:]:
                    np.testing.assert_array_equal(copy, copies[0], err_msg=label)
            # Optimizer state: one copy per variable, spread over all replicas.
            state = _state(model.optimizer)
            assert all(len(_components(strategy, v)) == 1 for v in state), label
            assert {_device(v) for v in state} == set(range(n)), label
            trainable = {len(_components(strategy, v)) for v in model.trainable_variables}
            assert trainable == ({1} if shard == "parameters" else {n}), label
            if shard == "parameters":
                assert {_device(v) for v in model.trainable_variables} == set(range(n))
            if n == 2:
                continue  # evaluate and predict: once per stage (each traces anew)
            np.testing.assert_allclose(model.evaluate(x, y, batch_size=BATCH, verbose=0),
                                       want.evaluate(x, y, batch_size=BATCH, verbose=0),
                                       rtol=1e-5)
            np.testing.assert_allclose(model.predict(x, batch_size=BATCH, verbose=0),
                                       want.predict(x, batch_size=BATCH, verbose=0), atol=1e-5)


def test_checkpoints_are_unsharded_and_load_on_one_device_and_other_replica_counts(
        tmp_path, data):
    x, y = data
    sharded = _fit(tfpar.DataParallelStrategy(cpus(4), shard="parameters"), "adam", x, y)
    path = str(tmp_path / "sharded.weights.h5")
    sharded.save_weights(path)

    one_device = small_model(seed=7)  # other weights: they must come from the file
    one_device.compile(_optimizer("adam"), LOSS)
    one_device.optimizer.build(one_device.trainable_variables)
    one_device.load_weights(path)
    for got, want in zip(one_device.get_weights(), sharded.get_weights()):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(_state(one_device.optimizer), _state(sharded.optimizer)):
        assert np.abs(want.numpy()).max() > 0  # Adam's state is not all zeros
        np.testing.assert_array_equal(got.numpy(), want.numpy())

    strategy = tfpar.DataParallelStrategy(cpus(2), shard="optimizer")
    resumed = _compiled(strategy, "adam")
    with strategy.scope():
        resumed.optimizer.build(resumed.trainable_variables)
    resumed.load_weights(path)
    resumed.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    one_device.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(resumed.get_weights(), one_device.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("shard", [None, "gradients", "parameters"])
def test_moving_averages_follow_every_step_on_their_owners_as_on_one_device(data, shard):
    """use_ema with gradient accumulation and an overwrite every 3 steps: Keras updates the
    averages every step (between accumulation steps too), overwrites the weights at steps
    3 and 6, and gives each weight its average when fit ends. Under ZeRO the averages live
    on the weights' owners; without it (tfpar accumulates outside Keras' cond), mirrored."""
    x, y = data

    def optimizer():
        return keras.optimizers.SGD(0.1, momentum=0.5, use_ema=True, ema_momentum=0.6,
                                    ema_overwrite_frequency=3, gradient_accumulation_steps=2)

    keras.utils.set_random_seed(0)
    one_device = small_model()
    one_device.compile(optimizer(), LOSS)
    initial = one_device.get_weights()
    one_device.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    strategy = tfpar.DataParallelStrategy(cpus(2), shard=shard)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        sharded = small_model()
        sharded.compile(optimizer(), LOSS)
    sharded.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    averages = sharded.optimizer._model_variables_moving_average
    copies = [strategy.experimental_local_results(a.value) for a in averages]
    if shard:  # each average on its weight's owner, both owners used
        assert all(len(c) == 1 for c in copies)
        assert len({c[0].device for c in copies}) == 2, [c[0].device for c in copies]
    assert max(np.abs(a - b).max() for a, b in zip(initial, one_device.get_weights())) > 1e-2
    for got, want in zip(sharded.get_weights(), one_device.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6)
    for got, want in zip(averages, one_device.optimizer._model_variables_moving_average):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


def test_an_optimizer_that_makes_trainable_state_is_refused_under_stage_3(data):
    x, y = data
    strategy = tfpar.DataParallelStrategy(cpus(2), shard="parameters")
    with strategy.scope():
        model = small_model()
        model.compile(keras.optimizers.Nadam(), LOSS)
    with pytest.raises(ValueError, match="cannot shard Nadam: it makes state as a trainable "
                                         "variable .* Use shard='gradients'"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_what_cannot_be_sharded_is_refused_before_any_step(data):
    x, y = data
    strategy = tfpar.DataParallelStrategy(cpus(2), shard="gradients")
    for options, what in [({"gradient_accumulation_steps": 2, "global_clipnorm": 1.0},
                           "gradient_accumulation_steps with global_clipnorm")]:
        with strategy.scope():
            model = small_model()
            model.compile(keras.optimizers.SGD(0.1, **options), LOSS)
        with pytest.raises(ValueError, match=f"cannot shard .*{what}"):
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 0
    with strategy.scope():
        model = small_model()
        model.compile(keras.optimizers.Adafactor(), LOSS)
    with pytest.raises(ValueError, match="cannot shard Adafactor: it keeps state that is not "
                                         "one copy per variable"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="shard must be None .*'optimizer'.*Received: "
                                         "shard='zero2'"):
        tfpar.DataParallelStrategy(cpus(2), shard="zero2")


def test_gpu_shards_move_with_nccl_reduce_scatter_and_all_gather():
    """NCCL cannot run here: the GPU path is traced, not run, and its ops checked."""
    keys = internals.attr(tfpar.DataParallelStrategy(cpus(2)).extended, "_collective_keys")
    collectives = ShardCollectives("nccl", keys, ["/gpu:0", "/gpu:1"])

    class _Context:
        num_replicas_in_sync = 2

    @tf.function(autograph=False)
    def step(flat):
        return collectives.all_gather(_Context, collectives.reduce_scatter(_Context, flat), 2)

    graph = step.get_concrete_function(tf.TensorSpec([8], tf.float32)).graph
    hints = {op.type: op.get_attr("communication_hint") for op in graph.get_operations()
             if op.type.startswith("Collective")}
    assert hints == {"CollectiveReduceScatterV2": b"nccl", "CollectiveGatherV2": b"nccl"}
    assert tfpar.plan.sharding.collectives_for("nccl") == "nccl"
    assert tfpar.plan.sharding.collectives_for("reduce_to_one") == "all_reduce"


@pytest.mark.parametrize("n", [2, 3])
def test_pairwise_reduce_to_owners_sums_each_variable_on_its_owner(n):
    """The CPU reduce-scatter used across workers (TensorFlow has none): each gradient sent
    to its owner alone, for more variables than replicas, owned in turn, with a step run
    twice (the collective keys of a second step must match). Run on logical CPUs."""
    strategy = tfpar.DataParallelStrategy(cpus(n))
    extended = strategy.extended
    collectives = ShardCollectives(
        "pairwise", internals.attr(extended, "_collective_keys"), extended.worker_devices,
        timeout_seconds=30, key_base=strategy._collective_key_base)
    count = 2 * n + 1
    owners = {k: k % n for k in range(count)}

    @tf.function
    def step():
        def replica():
            ctx = tf.distribute.get_replica_context()
            me = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
            mine, _ = collectives.reduce_to_owners(
                ctx, {k: tf.range(k + 2, dtype=tf.float32) + 100 * me for k in range(count)},
                owners)
            return {k: mine.get(k, tf.constant(-1.0)) for k in range(count)}
        return strategy.run(replica)

    step()
    got = step()
    for k in range(count):
        values = [r.numpy() for r in strategy.experimental_local_results(got[k])]
        whole = n * np.arange(k + 2) + 100 * sum(range(n))
        np.testing.assert_allclose(values[owners[k]], whole)
        assert all((v == -1).all() for r, v in enumerate(values) if r != owners[k])
    # Each replica sends each variable it does not own once: (n-1)/n of its gradients.
    sends = [op for op in step.get_concrete_function().graph.get_operations()
             if op.type == "CollectiveBcastSendV2"]
    assert len(sends) == count * (n - 1)


@pytest.mark.parametrize("n", [2, 3])
def test_pairwise_reduce_to_owner_sums_on_the_owner_and_sends_once_per_replica(n):
    """How a stage-3 read's gradient goes back across workers: each other replica sends its
    gradient to the owner alone, which sums. Run for real on logical CPUs; the non-owners'
    results are not used, as in a step (their sends must run anyway, or the owner waits
    until the timeout)."""
    from tfpar.distribute.zero.zero_collectives import _runs

    strategy = tfpar.DataParallelStrategy(cpus(n))
    extended = strategy.extended
    collectives = ShardCollectives(
        "pairwise", internals.attr(extended, "_collective_keys"), extended.worker_devices,
        timeout_seconds=30, key_base=strategy._collective_key_base)
    owner = n - 1

    @tf.function
    def step():
        def replica():
            ctx = tf.distribute.get_replica_context()
            me = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
            summed = collectives.reduce_to_owner(ctx, tf.fill([5], me + 1.0), owner,
                                                 tf.zeros([0]), 0)
            if summed.shape[0] == 0:  # A non-owner: its result is dropped.
                _runs([summed])
                return tf.fill([5], -1.0)
            return summed
        return strategy.run(replica)

    step()
    got = [r.numpy() for r in strategy.experimental_local_results(step())]
    np.testing.assert_allclose(got[owner], np.full(5, sum(range(1, n + 1))))
    assert all((g == -1).all() for g in got[:owner])
    sends = [op for op in step.get_concrete_function().graph.get_operations()
             if op.type == "CollectiveBcastSendV2"]
    assert len(sends) == n - 1 and {tuple(op.inputs[0].shape) for op in sends} == {(5,)}


def test_pairwise_needs_a_group_key_per_pair_and_falls_back_to_all_reduce():
    from tfpar.distribute.common import group_keys

    assert group_keys.pairs_fit(32) and not group_keys.pairs_fit(33)
    keys = {group_keys.pair_key(5000, a, b, 32) for a in range(32) for b in range(a + 1, 32)}
    assert len(keys) == 32 * 31 // 2 and min(keys) > 5000 + 1000 // 2 - 1 and max(keys) == 6000
    with pytest.raises(ValueError, match="No group key for every pair of 33"):
        group_keys.pair_key(5000, 0, 1, 33)
    assert tfpar.plan.sharding.collectives_for("ring", True, pair_groups=False) == "all_reduce"


def _reads_shared_by_forward_and_backward(graph, model):
    """Per trainable variable: how many of its reads (ReadVariableOps of its handle, a
    copy from the owner at stage 3) feed both the model's forward pass and an op of the
    backward pass, so that the read value is held from one to the other."""
    inside = {id(external): internal for external, internal in graph.captures}
    shared = []
    for variable in model.trainable_variables:
        handle = inside[id(internals.attr(variable, "_value").handle)]
        count = 0
        for op in graph.get_operations():
            if op.type != "ReadVariableOp" or op.inputs[0] is not handle:
                continue
            users = [re.sub(r"^replica_\d+/", "", c.name) for c in op.outputs[0].consumers()]
            # Forward ops are named in the model's and layer's scopes; backward ones in the
            # tape's (Keras' recomputation runs at the top level, unscoped).
            backward = [u for u in users if u.startswith("gradient_tape/")]
            forward = [u for u in users if "/" in u and u not in backward]
            count += bool(backward and forward)
        shared.append(count)
    return shared


@pytest.mark.parametrize("how", ["reshard_after_forward", "keras_remat"])
def test_stage_3_reads_each_variable_again_for_the_backward_pass(how):
    """FSDP frees a layer's gathered weights after its forward and gathers them again for
    its backward. In TensorFlow a tensor lives while a later op needs it, and a layer's
    backward needs its weights; with reshard_after_forward (the default) or under Keras'
    own RematScope, a stage-3 read (a copy from the owner on one host, a broadcast across
    workers) is made inside the recomputed call: the backward pass reads the variable
    again, and no read of the forward pass is held for it. Training is unchanged."""
    x, y = toy_data(n=16)

    def traced(kept):
        strategy = tfpar.DataParallelStrategy(
            cpus(2), shard="parameters",
            reshard_after_forward=False if kept or how == "keras_remat" else None)
        keras.utils.set_random_seed(0)
        with strategy.scope():
            with keras.RematScope(mode="full" if how == "keras_remat" and not kept else None):
                layers = [keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)]
            model = keras.Sequential([keras.Input((4,))] + layers)
            optimizer = keras.optimizers.Adam(0.01)

        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(LOSS(y, model(x)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        @tf.function
        def step(x, y):
            strategy.run(replica_step, args=(x, y))

        step(tf.constant(x), tf.constant(y))
        graph = step.get_concrete_function(tf.constant(x), tf.constant(y)).graph
        return model, _reads_shared_by_forward_and_backward(graph, model)

    kept_model, kept = traced(True)
    model, regathered = traced(False)
    # Kept, each replica's read of the last kernel (what the backward pass needs to reach
    # the first layer) is held from the forward to the backward pass.
    assert kept[2] == 2, kept
    assert regathered == [0, 0, 0, 0], regathered
    for got, expected in zip(model.get_weights(), kept_model.get_weights()):
        np.testing.assert_allclose(got, expected, atol=1e-6)


def test_reshard_after_forward_needs_stage_3_and_leaves_stateful_layers_alone():
    with pytest.raises(ValueError, match="only shard='parameters' does"):
        tfpar.DataParallelStrategy(cpus(2), shard="gradients", reshard_after_forward=True)
    with pytest.raises(ValueError, match="True, False or None"):
        tfpar.DataParallelStrategy(cpus(2), shard="parameters", reshard_after_forward=1)
    assert not tfpar.DataParallelStrategy(cpus(2), shard="optimizer").reshard_after_forward
    from tfpar.keras.zero_optimizers import regather_in_backward

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                              keras.layers.BatchNormalization(), keras.layers.Dropout(0.5),
                              keras.layers.Dense(2),
                              keras.layers.Dense(2, dtype="mixed_float16")])
    # The two float32 Dense layers only: BatchNorm updates its statistics, Dropout draws
    # masks (a recomputation would do both twice), and a mixed-precision layer's autocast
    # does not reach a recomputation.
    assert regather_in_backward(model) == 2
    assert regather_in_backward(model) == 0


def test_stage_3_fits_a_model_built_under_keras_remat_as_unsharded(unsharded, data):
    """Keras' RematScope fails under model.fit on TensorFlow (keras-team/keras#21207);
    under a sharding strategy the layers' calls are recomputed and training equals the
    unsharded run. (SGD with momentum: with Adam the recomputation's rounding, amplified by
    its normalization, once reached 1e-4 in a whole-suite run, session 27.)"""
    x, y = data
    strategy = tfpar.DataParallelStrategy(cpus(2), shard="parameters")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        with keras.RematScope(mode="full"):
            layers = [keras.layers.Dense(16, activation="tanh"),
                      keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
        model = keras.Sequential([keras.Input((4,))] + layers)
        model.compile(_optimizer("sgd_momentum"), LOSS)
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for got, expected in zip(model.get_weights(), unsharded["sgd_momentum"].get_weights()):
        np.testing.assert_allclose(got, expected, atol=1e-5)


def test_a_worker_that_cannot_see_the_chiefs_backup_is_named(tmp_path, monkeypatch):
    """Resuming sharded state needs the chief's backup on every worker: a worker whose
    backup_dir is elsewhere is named, with what to change (the store stands in for
    TensorFlow's coordination service, the other worker's answer written into it)."""
    from tfpar.distribute.common import rendezvous
    from tfpar.errors import ClusterError

    values = {"tfpar/backup/1/worker:1": "0"}

    class Store:
        def set_config_key_value(self, key, value):
            values[key] = value

        def get_config_key_value(self, key, timeout_in_ms):
            return values[key]

    class Peers:
        me, peers = "worker:0", ["worker:1"]

    monkeypatch.setattr(rendezvous, "_store", Store)
    backup = tmp_path / "backup"
    backup.mkdir()
    with pytest.raises(ClusterError, match="but worker:1 cannot see .*backup. Put "
                                           "BackupAndRestore's backup_dir on a filesystem "
                                           "all workers share"):
        rendezvous.check_backup_everywhere(Peers, "backup/1", str(backup), 1.0)
    assert values["tfpar/backup/1/worker:0"] == "1"
    values["tfpar/backup/1/worker:1"] = "1"  # Both see it: no error.
    rendezvous.check_backup_everywhere(Peers, "backup/1", str(backup), 1.0)
    values["tfpar/backup/2/worker:1"] = "0"  # Neither has one: a fresh start, no error.
    rendezvous.check_backup_everywhere(Peers, "backup/2", str(tmp_path / "none"), 1.0)


def _balanced_model():
    # Eight equal kernels (plus small biases): whole-variable owners split them evenly.
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((64,))] + [keras.layers.Dense(64) for _ in range(8)])


@pytest.mark.parametrize("shard, per_param", [
    (None, lambda n: 16), ("optimizer", lambda n: 8 + 8 / n),
    ("gradients", lambda n: 4 + 12 / n), ("parameters", lambda n: 16 / n)])
def test_measured_bytes_per_replica_match_the_zero_figures(shard, per_param):
    """fp32 Adam on 4 replicas. Measured: the variables resident on each device, and the
    gradient buffer the traced step allocated; the ZeRO paper's figures per parameter."""
    n = 4
    strategy = tfpar.DataParallelStrategy(cpus(n), shard=shard)
    report = balanced_memory_report(strategy)
    params = report.num_params
    largest = 64 * 64 * 4
    for device in report.devices:
        resident = device.weights + device.gradients + device.optimizer
        assert abs(resident / params - per_param(n)) / per_param(n) < 0.05, (shard, device)
        assert device.gather_buffer == (largest if shard == "parameters" else 0)


def balanced_memory_report(strategy):
    """`strategy.memory_report` of `_balanced_model` with Adam after a step, checked against
    the estimate made from shapes alone (`tfpar.plan.estimate_memory`, within 5%)."""
    with strategy.scope():
        model = _balanced_model()
        model.compile(keras.optimizers.Adam(1e-3), "mse")
    x = np.zeros((8, 64), "float32")
    model.fit(x, x, batch_size=8, epochs=1, verbose=0)
    report = strategy.memory_report(model)
    assert report.num_params == 8 * (64 * 64 + 64)
    estimate = tfpar.plan.estimate_memory(model, strategy)
    assert len(estimate.devices) == len(report.devices)
    for measured, estimated in zip(report.devices, estimate.devices):
        held = estimated.total - estimated.update  # A report counts held state only.
        assert abs(measured.total - held) / held < 0.05, (
            strategy, measured, estimated)
    return report


def _ancestors(tensors):
    seen, stack = set(), [t.op for t in tensors]
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        stack.extend(i.op for i in op.inputs)
        stack.extend(op.control_inputs)
    return seen


@pytest.mark.parametrize("shard", STAGES)
def test_each_bucket_waits_only_for_its_own_gradients(shard):
    """Buckets of about bytes_per_pack, the last layers' first: the first bucket's
    reduction does not depend on the first layer's gradient, so it can run while the
    backward pass is still computing it."""
    strategy = tfpar.DataParallelStrategy(cpus(2), shard=shard, bytes_per_pack=1)
    with strategy.scope():
        model = small_model()
        optimizer = keras.optimizers.Adam(0.01)
    first_gradient = []

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(LOSS(y, model(x)))
        grads = tape.gradient(loss, model.trainable_variables)
        first_gradient.append(grads[0].op.name)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def step(x, y):
        strategy.run(replica_step, args=(x, y))

    x, y = toy_data(n=16)
    graph = step.get_concrete_function(tf.constant(x), tf.constant(y)).graph
    buckets = sorted({op.name.split("tfpar_zero_bucket_")[1].split("/")[0]
                      for op in graph.get_operations() if "tfpar_zero_bucket_" in op.name})
    assert len(buckets) == len(model.trainable_variables)  # one variable per bucket here
    last_bucket_ops = [op for op in graph.get_operations()
                       if "tfpar_zero_bucket_0/" in op.name]
    ancestors = _ancestors([t for op in last_bucket_ops for t in op.outputs]
                           + [i for op in last_bucket_ops for i in op.inputs])
    assert first_gradient and not set(first_gradient) & ancestors
    # ...and the last bucket (the first layer's kernel) does wait for it.
    first_bucket = [op for op in graph.get_operations()
                    if f"tfpar_zero_bucket_{len(buckets) - 1}/" in op.name]
    assert set(first_gradient) & _ancestors([i for op in first_bucket for i in op.inputs])


def test_weight_gradients_wait_for_earlier_transfers_within_a_window():
    """Across workers the backward pass is paced: each weight gradient's op waits for the
    transfer of the gradient about a window before it (last layers first), and an op that
    is not a weight gradient's (one clipped by the global norm) is left alone, so nothing
    it feeds can wait for itself."""
    from tfpar.distribute.zero import zero_pacing

    @tf.function
    def step():
        x = tf.ones([4, 8])
        dy = tf.ones([4, 8])
        grads = [tf.matmul(x, dy, transpose_a=True) for _ in range(4)]
        grads.append(grads[0] * 0.5)  # Clipped: a Mul.
        transfers = [(i, tf.identity(grads[i], name=f"transfer_{i}").op, 256)
                     for i in (4, 3, 2, 1, 0)]
        zero_pacing._pace_gradients(grads, transfers, window_bytes=300)
        return grads

    graph = step.get_concrete_function().graph
    waits = {}
    for op in graph.get_operations():
        if op.type == "MatMul" or op.type == "Mul":
            waits[op.name] = sorted(c.name for c in op.control_inputs)
    matmuls = sorted(n for n in waits if n.startswith("MatMul"))
    # Transfers in the order 4 (the Mul), 3, 2, 1, 0; 256 B each in a window of 300 B: the
    # gradient at each position waits for the transfer just before it.
    assert waits["mul"] == []
    assert [waits[m] for m in matmuls] == [["transfer_1"], ["transfer_2"], ["transfer_3"],
                                           ["transfer_4"]]
    # Eagerly (run_eagerly=True) each transfer has ended before the next gradient is used:
    # nothing to pace, and eager tensors have no ops.
    zero_pacing._pace_gradients([tf.ones([2, 2])] * 2, [(1, None, 16), (0, None, 16)], 8)
    from tfpar.keras import steps
    in_turn = steps.InTurn()
    assert [float(in_turn(tf.reduce_sum, tf.ones([k]))) for k in (2, 3)] == [2.0, 3.0]
