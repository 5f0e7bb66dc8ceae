"""Installs every patch tfpar makes in Keras and TensorFlow, then removes them all, and
prints (JSON) whether each replaced attribute holds its original again and whether stock
Keras + MirroredStrategy trains bit-identically before and after. A process of its own:
removing the patches from a test session would change the tests after it."""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfpar  # noqa: E402

tfpar.virtual_cpus(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfpar.keras import hooks  # noqa: E402

CPUS = ["/cpu:0", "/cpu:1"]


def stock_weights():
    strategy = tf.distribute.MirroredStrategy(CPUS)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.BatchNormalization(), keras.layers.Dense(3)])
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype("float32"), rng.normal(size=(32, 3)).astype("float32")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    return [w.tolist() for w in model.get_weights()]


before = stock_weights()
tfpar.DataParallelStrategy(CPUS)
tfpar.DataParallelStrategy(CPUS, shard="parameters")
tfpar.PipelineStrategy(CPUS)
tfpar.ModelParallelStrategy(CPUS)
tfpar.use_keras_distribution()
# What the cluster strategies install when they are made (they need a cluster).
hooks.install_parameter_server_training()
hooks.install_multi_worker_callbacks()
hooks.install_cluster_error_explanation()
# Per-object patches: the layers of a model placed by ModelParallelStrategy get a `call` of
# their own, and a pipelined model one too.
with tfpar.ModelParallelStrategy(CPUS).scope():
    placed = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(3)])
    placed.compile("sgd", "mse")
with tfpar.PipelineStrategy(CPUS, num_micro_batches=2).scope():
    pipelined = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                  keras.layers.Dense(3)])
    pipelined.compile("sgd", "mse")
for model in (placed, pipelined):
    model.fit(np.zeros((4, 4), "float32"), np.zeros((4, 3), "float32"), batch_size=4,
              verbose=0)
objects = [placed, *placed.layers, pipelined]
own_calls = sum("call" in vars(o) for o in objects)
object_patches = len(hooks._object_patches)
records = list(hooks._applied)
first_before = {}
for owner, name, previous in records:
    first_before.setdefault((id(owner), name), (owner, name, previous))
undone = hooks.remove_patches()
own_calls_after = sum("call" in vars(o) for o in objects)
restored = all(vars(owner).get(name, hooks._ABSENT) is previous
               for owner, name, previous in first_before.values())
after = stock_weights()
print(json.dumps({"replaced": len(records) + object_patches, "attributes": len(first_before),
                  "undone": undone, "restored": restored, "stock_equal": before == after,
                  "own_calls": own_calls, "own_calls_after": own_calls_after}))
