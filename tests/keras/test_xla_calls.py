"""jit_compile=True under DataParallelStrategy: each replica's model call compiled by XLA on
its device (`tfpar.keras.xla_calls`), the sums across replicas outside it. (Equal to one
device with jit_compile=True: the conformance rows jit_compile*.)"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar

from conftest import cpus, gpt2_language_model


class NotCompilable(keras.layers.Layer):
    """A layer XLA refuses (a string op): shows whether a call runs inside XLA."""

    def call(self, x):
        text = tf.strings.as_string(x)
        return x + 0.0 * tf.strings.to_number(text)


def _data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(32, 4)).astype("float32"),
            rng.integers(0, 3, size=(32,)).astype("int32"))


def _fit(strategy, layers, jit_compile, **fit):
    x, y = _data()
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,))] + layers())
        model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy",
                      jit_compile=jit_compile)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, **fit)
    return model


@pytest.mark.parametrize("make", [
    lambda: tfpar.DataParallelStrategy(cpus(2)),
    lambda: tfpar.DataParallelStrategy(cpus(2), shard="parameters"),
    lambda: tfpar.ModelParallelStrategy(cpus(2)),
], ids=["data", "zero3", "model"])
def test_each_replica_or_placed_layer_compiles_its_call(make):
    layers = lambda: [keras.layers.Dense(8), NotCompilable(), keras.layers.Dense(3)]  # noqa
    _fit(make(), layers, jit_compile=False)  # Trains without XLA...
    with pytest.raises(tf.errors.InvalidArgumentError, match="XLA|compil"):
        _fit(make(), layers, jit_compile=True)  # ... and its call is compiled with it.


def test_model_parallelism_compiles_each_layer_on_its_device():
    strategy = tfpar.ModelParallelStrategy(cpus(2))
    model = _fit(strategy, lambda: [keras.layers.Dense(8, name="first"),
                                    keras.layers.Dense(3, name="last")], True)
    # Each layer has its compiled call (run by placed_call under its device) and the two
    # layers live on the two devices; the model as a whole has none.
    for layer in model.layers:
        assert list(layer._tfpar_compiled_per_replica) == ["layer"]
        assert layer._tfpar_compiled_per_replica["layer"][0].experimental_get_tracing_count()
    assert model._tfpar_compiled_per_replica == {}
    devices = {tf.DeviceSpec.from_string(v.value.device).device_index
               for v in model.trainable_variables}
    assert devices == {0, 1}


def _calls_in_step_graphs():
    """(function name, device, must compile) of every function call in the live graphs of
    Keras' one-step functions."""
    import gc

    from tensorflow.python.framework.func_graph import FuncGraph

    calls = []
    for graph in [o for o in gc.get_objects() if isinstance(o, FuncGraph)]:
        if not graph.name.startswith("one_step_on_data"):
            continue
        for op in graph.get_operations():
            if op.type in ("PartitionedCall", "StatefulPartitionedCall"):
                try:
                    xla = op.get_attr("_XlaMustCompile")
                except ValueError:
                    xla = False
                calls.append((op.get_attr("f").name, op.device, xla))
    return calls


def test_forward_and_backward_are_compiled_on_each_replica_device():
    strategy = tfpar.DataParallelStrategy(cpus(2))
    model = _fit(strategy, lambda: [keras.layers.Dense(8), keras.layers.Dense(3)], True)
    compiled = [(name, device) for name, device, xla in _calls_in_step_graphs() if xla]
    del model
    for kind in ("__forward_pure", "__backward_pure"):
        devices = {tf.DeviceSpec.from_string(d).device_index
                   for name, d in compiled if kind in name}
        assert devices == {0, 1}, (kind, compiled)  # (Other tests' graphs may be alive.)


def test_each_replica_traces_its_own_compiled_call_once_per_mode():
    strategy = tfpar.DataParallelStrategy(cpus(2))
    model = _fit(strategy, lambda: [keras.layers.Dense(8), keras.layers.Dense(3)], True,
                 validation_data=_data())
    compiled = model._tfpar_compiled_per_replica
    assert sorted(compiled) == [0, 1]
    # One trace for training, one for evaluation (training=False), per replica.
    assert [compiled[r][0].experimental_get_tracing_count() for r in (0, 1)] == [2, 2]
    assert model.jit_compile  # Not switched off behind the user's back.
    model.predict(_data()[0], batch_size=8, verbose=0)
    assert model.jit_compile


def test_state_written_in_the_compiled_call_reaches_the_variables():
    """BatchNorm's moving statistics are written in the compiled call's scope and assigned
    outside it: they move, as without XLA."""
    strategy = tfpar.DataParallelStrategy(cpus(2))
    layers = lambda: [keras.layers.Dense(8), keras.layers.BatchNormalization(),  # noqa
                      keras.layers.Dense(3)]
    compiled = _fit(strategy, layers, True)
    plain = _fit(tfpar.DataParallelStrategy(cpus(2)), layers, False)
    mean = [v for v in compiled.non_trainable_variables if "moving_mean" in v.path][0]
    assert np.abs(mean.numpy()).max() > 1e-3  # Moved from zeros.
    want = [v for v in plain.non_trainable_variables if "moving_mean" in v.path][0]
    # (XLA's rounding differs: 6e-5 of 4e-3 measured after 4 Adam steps.)
    np.testing.assert_allclose(mean.numpy(), want.numpy(), atol=3e-4)


def test_synchronized_batchnorm_is_refused_before_the_first_step():
    strategy = tfpar.DataParallelStrategy(cpus(2))
    layers = lambda: [keras.layers.Dense(8),  # noqa
                      keras.layers.BatchNormalization(synchronized=True, name="sync_bn"),
                      keras.layers.Dense(3)]
    with pytest.raises(ValueError, match=r"\['sync_bn'\].*synchronized=True.*"
                                         r"jit_compile=False"):
        _fit(strategy, layers, True)


@pytest.mark.parametrize("shard", [None, "parameters"])
@pytest.mark.parametrize("option", ["steps_per_execution", "gradient_accumulation_steps"])
def test_steps_per_execution_and_accumulation_equal_one_device_compiled(option, shard):
    """Keras' loop of steps in one function, and accumulation (tfpar's outside Keras' cond),
    around the compiled calls: equal to one device with jit_compile=True."""
    x, y = _data()

    def fit(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(3)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, "tanh"),
                                      keras.layers.Dense(3)])
            optimizer = keras.optimizers.Adam(
                0.01, gradient_accumulation_steps=2 if option != "steps_per_execution"
                else None)
            model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(
                from_logits=True), jit_compile=True,
                steps_per_execution=2 if option == "steps_per_execution" else 1)
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        return model.get_weights()

    want = fit(tf.distribute.get_strategy())
    got = fit(tfpar.DataParallelStrategy(cpus(2), shard=shard))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=2e-6)


def test_a_keras_hub_decoder_with_padding_equals_one_device_compiled():
    """GPT-2 (its causal-and-padding masks made inside the compiled call), ZeRO-3."""
    pytest.importorskip("keras_hub")
    length, vocabulary = 16, 64
    rng = np.random.default_rng(0)
    padding = np.ones((16, length), "int32")
    padding[::2, :4] = 0
    x = {"token_ids": rng.integers(1, vocabulary, (16, length)).astype("int32") * padding,
         "padding_mask": padding}
    y = rng.integers(0, vocabulary, (16, length)).astype("int32")

    def fit(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = gpt2_language_model(length, vocabulary)
            model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(
                from_logits=True), jit_compile=True)
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        return model.get_weights()

    want = fit(tf.distribute.get_strategy())
    got = fit(tfpar.DataParallelStrategy(cpus(2), shard="parameters"))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=2e-5)  # (Measured 1.8e-6.)


def test_a_layer_frozen_after_fit_and_compiled_again_equals_one_device():
    """The compiled call is made again for the new trainable variables (a stale one mapped
    the frozen kernel's place to the next layer's value: a shape error at the second fit)."""
    x, y = _data()

    def fit(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="a"),
                                      keras.layers.Dense(3, name="b")])
        for frozen in (False, True):
            model.layers[0].trainable = not frozen
            with strategy.scope():
                model.compile(keras.optimizers.Adam(0.01),
                              keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                              jit_compile=True)
            model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
        return model.get_weights()

    want = fit(tf.distribute.get_strategy())
    got = fit(tfpar.DataParallelStrategy(cpus(2)))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=2e-6)
