"""The chief of the hybrid-across-workers tests, run by `tfpar launch --workers 4
--coordinator` (the workers serve; this process runs the program):

    python hybrid_chief.py --out=FILE --replicas=R --stages=K --tensor_parallel=T [--shard=S]

1. Before connecting: the reference, the Megatron MLP trained with Adam on this process's
   CPU for 2 epochs of 4 steps.
2. `tfpar.PipelineStrategy(num_replicas=R, num_stages=K, tensor_parallel=T, shard=S,
   cluster_resolver=TFConfigClusterResolver())` over the R x K x T worker processes: the
   same model and steps.

Writes FILE (JSON): the largest difference to the reference, how far training moved the
weights, the stage devices, and where each variable of the model and of its optimizer
lives (the devices of its copies, or of its shards).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfpar  # noqa: E402

tfpar.virtual_cpus(2)  # One per pipeline replica (R <= 2 here): each feeds its replica.

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import multi_worker_common as common  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Where to write the results (JSON).")
flags.DEFINE_integer("replicas", 1, "Pipeline replicas R.")
flags.DEFINE_integer("stages", 2, "Stages K.")
flags.DEFINE_integer("tensor_parallel", 1, "Devices T each stage is split over.")
flags.DEFINE_string("shard", None, "ZeRO over the replicas: optimizer, gradients, parameters.")

BATCH = 16


def _trained(strategy=None):
    x, y = common.megatron_data()
    scope = strategy.scope() if strategy is not None else _nothing()
    with scope:
        model = common.megatron_mlp()
        model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return model


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _devices(variable):
    """The devices holding `variable`: its copies', or its shards' copies'."""
    from tfpar.keras import internals
    from tfpar.keras import split_variables

    storage = split_variables.sharded_storage(variable)
    parts = storage.shards if storage is not None else [variable]
    found = set()
    for part in parts:
        value = internals.attr(part, "_value") if hasattr(part, "path") else part
        value = getattr(value, "_tfpar_distributed", value)
        found.update(c.device for c in getattr(value, "values", [value]))
    return sorted(found)


def main(argv):
    import tensorflow as tf

    initial = common.megatron_mlp().get_weights()
    want = _trained().get_weights()
    keras.backend.clear_session()
    strategy = tfpar.PipelineStrategy(
        num_micro_batches=2, num_replicas=FLAGS.replicas, num_stages=FLAGS.stages,
        tensor_parallel=FLAGS.tensor_parallel, shard=FLAGS.shard,
        layout_map=common.megatron_layout() if FLAGS.tensor_parallel > 1 else None,
        cluster_resolver=tf.distribute.cluster_resolver.TFConfigClusterResolver())
    model = _trained(strategy)
    got = model.get_weights()
    result = {
        "difference": max(float(np.abs(a - b).max()) for a, b in zip(got, want)),
        "moved": max(float(np.abs(a - b).max()) for a, b in zip(got, initial)),
        "stage_devices": [list(row) for row in strategy.stage_devices],
        "weights": {v.path: _devices(v) for v in model.weights},
        "slots": {v.path: _devices(v) for v in model.optimizer.variables
                  if v.path.endswith(("momentum", "velocity"))},
    }
    with open(FLAGS.out, "w") as f:
        json.dump(result, f)
    print("DONE", flush=True)


if __name__ == "__main__":
    app.run(main)
