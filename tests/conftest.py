"""Test setup: 4 logical CPUs, made once before TensorFlow starts."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

NUM_CPUS = 4


def pytest_configure(config):
    import tfpar

    tfpar.virtual_cpus(NUM_CPUS)


def cpus(n):
    return [f"/cpu:{i}" for i in range(n)]


def small_model(seed=0, inputs=4, classes=3):
    """A small MLP with deterministic weights."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((inputs,)),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(classes),
    ])


def toy_data(n=64, inputs=4, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, inputs)).astype("float32"),
            rng.integers(0, classes, n).astype("int32"))


@pytest.fixture(scope="session")
def toy():
    return toy_data()
