"""R=2 replicas of a K=2 x T=2 tensor-parallel pipeline on 8 logical CPUs (more than the
test process has), without ZeRO and with ZeRO-1 and ZeRO-3 over the replicas, each trained
with Adam against one device; then the 3D example of the pipeline guide, a keras-hub GPT-2 style
decoder on a DeviceMesh (2, 2, 2) of axes data, pipe, model with ZeRO-1; prints one JSON
line per run."""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tfpar  # noqa: E402

tfpar.virtual_cpus(8)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
from multi_worker_common import megatron_data as _data  # noqa: E402
from multi_worker_common import gpt2, gpt2_layout, megatron_layout, megatron_mlp  # noqa: E402
from tfpar.keras import internals  # noqa: E402
from tfpar.keras import split_variables as keras_tp  # noqa: E402

BATCH = 16


def _devices(strategy, variable):
    return [tf.DeviceSpec.from_string(c.device).device_index
            for c in strategy.experimental_local_results(internals.attr(variable, "_value"))]


def main():
    x, y = _data()
    reference = megatron_mlp()
    reference.compile(keras.optimizers.Adam(0.01), "mse")
    reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for shard in (None, "optimizer", "parameters"):
        run(reference, x, y, shard)
    run_3d()


def run_3d():
    """The pipeline guide's 3D example: data x pipe x model = 2 x 2 x 2, said once by the mesh."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 16, (32, 8)).astype("int32")
    y = rng.integers(0, 16, (32, 8)).astype("int32")
    reference = gpt2()
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    mesh = keras.distribution.DeviceMesh((2, 2, 2), ("data", "pipe", "model"),
                                         devices=[f"cpu:{i}" for i in range(8)])
    strategy = tfpar.PipelineStrategy(layout_map=gpt2_layout(mesh), shard="optimizer",
                                      num_micro_batches=2, schedule="1f1b")
    with strategy.scope():
        model = gpt2()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    difference = max(float(np.abs(a - b).max())
                     for a, b in zip(model.get_weights(), reference.get_weights()))
    print(json.dumps({"shard": "3d", "difference": difference, "stages": strategy.stages(model),
                      "degrees": [len(strategy.stage_devices), strategy.num_stages,
                                  len(strategy.tensor_parallel_devices[0][0])]}))


def run(reference, x, y, shard):
    strategy = tfpar.PipelineStrategy([f"/cpu:{i}" for i in range(8)], num_micro_batches=2,
                                      num_replicas=2, num_stages=2, schedule="1f1b",
                                      tensor_parallel=2, layout_map=megatron_layout(),
                                      shard=shard)
    with strategy.scope():
        model = megatron_mlp()
        model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    difference = max(float(np.abs(a - b).max())
                     for a, b in zip(model.get_weights(), reference.get_weights()))
    # Each shard of stage 0's column kernel: one copy per replica, on that replica's device t.
    shards = keras_tp.sharded_storage(model.get_layer("mlp_in_0").kernel).shards
    devices = [_devices(strategy, s) for s in shards]
    copies_equal = all(
        np.array_equal(*[c.numpy() for c in strategy.experimental_local_results(
            internals.attr(s, "_value"))]) for s in shards) if shard != "parameters" else None
    # Each shard's devices and its Adam state's (m and v, after the two scalars; under ZeRO,
    # on one of the shard's R devices).
    trained = strategy._tfpar_optimizer_variables(model.trainable_variables)
    state = [(_devices(strategy, v), _devices(strategy, model.optimizer.variables[2 + 2 * i])
              + _devices(strategy, model.optimizer.variables[3 + 2 * i]))
             for i, v in enumerate(trained) if "shard" in v.path]
    print(json.dumps({"shard": shard, "difference": difference, "devices": devices,
                      "copies_equal": copies_equal, "state": state}))


if __name__ == "__main__":
    main()
