"""Periodic averaging (`DataParallelStrategy(sync_every=n)`): the replicas' own copies of the
weights, read on each device, part between averagings and meet at every n-th step; the traced
step sums no gradient. (Its numbers against a one-device emulation: the conformance column
"dp2_local"; across workers: test_multi_worker.py.)"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar

BATCH = 16


def _data(examples=112):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(examples, 6)).astype("float32")
    return x, (np.arange(examples) % 3).astype("int32")


def _model(optimizer=None):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(3)])
    model.compile(optimizer or keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _spread(strategy, variable):
    """The largest difference between the replicas' copies of `variable` (its devices')."""
    copies = [c.numpy() for c in strategy.experimental_local_results(
        getattr(variable, "value", variable))]
    return max(float(np.abs(c - copies[0]).max()) for c in copies)


class _Spreads(keras.callbacks.Callback):
    """After every batch: the spread of the first kernel over the replicas."""

    def __init__(self, strategy):
        super().__init__()
        self.strategy, self.spreads = strategy, []

    def on_train_batch_end(self, batch, logs=None):
        self.spreads.append(_spread(self.strategy, self.model.trainable_variables[0]))


@pytest.mark.parametrize("every", [3, 4])
def test_the_replicas_part_between_averagings_and_meet_every_n_steps_and_after_fit(every):
    strategy = tfpar.DataParallelStrategy(["/cpu:0", "/cpu:1"], sync_every=every)
    with strategy.scope():
        model = _model()
    spreads = _Spreads(strategy)
    x, y = _data()  # 7 steps: the last ones are averaged by the end of fit only.
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[spreads])
    met = [step for step, spread in enumerate(spreads.spreads, 1) if spread == 0.0]
    assert met == list(range(every, 8, every)), spreads.spreads
    assert min(s for s in spreads.spreads if s) > 1e-4
    assert all(_spread(strategy, v) == 0.0 for v in model.trainable_variables)


def test_sync_every_1_is_data_parallelism_and_n_steps_change_the_weights():
    x, y = _data()
    weights = {}
    for every in (1, 3):
        strategy = tfpar.DataParallelStrategy(["/cpu:0", "/cpu:1"], sync_every=every)
        with strategy.scope():
            model = _model()
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        weights[every] = model.get_weights()
    plain = tfpar.DataParallelStrategy(["/cpu:0", "/cpu:1"])
    with plain.scope():
        model = _model()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(weights[1], model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert max(float(np.abs(a - b).max()) for a, b in zip(weights[3], weights[1])) > 1e-3


@pytest.mark.parametrize("average_state", [False, True])
def test_optimizer_state_stays_per_replica_unless_asked(average_state):
    strategy = tfpar.DataParallelStrategy(["/cpu:0", "/cpu:1"], sync_every=2,
                                          sync_optimizer_state=average_state)
    with strategy.scope():
        model = _model()
    x, y = _data(64)  # 4 steps: the last one averages.
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    moments = [v for v in model.optimizer.variables if v.path.endswith("_momentum")]
    assert moments
    spread = max(_spread(strategy, v) for v in moments)
    assert (spread == 0.0) if average_state else (spread > 1e-6), spread
    assert _spread(strategy, model.optimizer.iterations) == 0


def _traced_reductions(strategy, model, x, y):
    """CollectiveReduceV2 ops of a custom step's graph: in its body, and in the functions it
    calls (a cond's branches)."""

    @tf.function
    def step(x, y):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(
                    keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True),
                    global_batch_size=BATCH)
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(replica_step, args=(x, y))

    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))
    batch = next(iter(dataset))
    graph = step.get_concrete_function(*batch).graph.as_graph_def()
    body = sum(node.op == "CollectiveReduceV2" for node in graph.node)
    called = sum(node.op == "CollectiveReduceV2" for function in graph.library.function
                 for node in function.node_def)
    return body, called, step, dataset


def test_the_step_sums_no_gradient_and_averages_inside_its_cond_then_a_custom_loop_averages():
    x, y = _data(48)  # 3 steps with sync_every=2: a custom loop ends parted.
    counts = {}
    for every in (1, 2):
        strategy = tfpar.DataParallelStrategy(["/cpu:0", "/cpu:1"], communication="ring",
                                              sync_every=every)
        with strategy.scope():
            model = _model(keras.optimizers.SGD(0.1))
        body, called, step, dataset = _traced_reductions(strategy, model, x, y)
        counts[every] = body, called
    # Summed every step: the gradients' reductions (on each replica) in the step's body.
    assert counts[1][0] >= 2, counts
    # Averaged every 2 steps: none in the body, the weights' inside the cond's branch.
    assert counts[2][0] == 0 and counts[2][1] >= 2, counts
    for batch in dataset:
        step(*batch)
    assert int(model.optimizer.iterations.numpy()) == 3
    parted = [_spread(strategy, v) for v in model.trainable_variables]
    assert min(parted) > 1e-5, parted
    copies = [strategy.experimental_local_results(v.value) for v in model.trainable_variables]
    mean = [np.mean([c.numpy() for c in cs], axis=0) for cs in copies]
    strategy.average_replicas(model)
    assert all(_spread(strategy, v) == 0.0 for v in model.trainable_variables)
    for got, want in zip(model.get_weights(), mean):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kwargs, message", [
    ({"sync_every": 0}, "sync_every must be an int >= 1"),
    ({"sync_every": 2.5}, "sync_every must be an int >= 1"),
    ({"sync_every": True}, "sync_every must be an int >= 1"),
    ({"sync_every": 4, "shard": "optimizer"}, "Choose one: drop shard= or sync_every="),
    ({"sync_every": 4, "compression": "bf16"}, "Choose one: drop compression= or sync_every="),
])
def test_bad_sync_every_is_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tfpar.DataParallelStrategy(["/cpu:0", "/cpu:1"], **kwargs)


def test_the_training_binary_passes_sync_every_to_the_data_strategy_only():
    from tfpar.cli import factory

    assert factory.make_strategy("data", 4, sync_every=8).sync_every == 8
    with pytest.raises(ValueError, match="sync_every=8 is for the data strategy"):
        factory.make_strategy("model", 4, sync_every=8)
