"""The chief of the hybrid-across-workers tests, run by `tfpar launch --workers 4
--coordinator` (the workers serve; this process runs the program):

    python hybrid_chief.py --out=FILE --layouts=R,K,T,S[;R,K,T,S ...]

1. Before connecting: the reference, the Megatron MLP trained with Adam on this process's
   CPU for 2 epochs of 4 steps.
2. For each layout in turn, `tfpar.PipelineStrategy(num_replicas=R, num_stages=K,
   tensor_parallel=T, shard=S (or None), cluster_resolver=TFConfigClusterResolver())` over
   the R x K x T worker processes: the same model and steps (one job for several layouts:
   each start of 5 processes costs seconds).

Writes FILE (JSON, one entry per layout): the largest difference to the reference, how far
training moved the weights, the stage devices, and where each variable of the model and of
its optimizer lives (the devices of its copies, or of its shards).
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
flags.DEFINE_string("layouts", None, "R,K,T,shard;... (shard: optimizer, gradients, "
                    "parameters or none).")

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


def _tensor_reductions(strategy, model):
    """{device: [op type]} of the tensor-parallel reductions in a traced training step:
    the peer all-reduces (`tp_all_reduce`) and any sum on one device (`tp_reduce_*`)."""
    import tensorflow as tf

    x, y = common.megatron_data(BATCH)

    @tf.function
    def step(x, y):
        return strategy.run(model.train_step, args=((x, y),))

    graph = step.get_concrete_function(tf.TensorSpec(x.shape), tf.TensorSpec(y.shape)).graph
    found = {}
    for op in graph.get_operations():
        if ((op.type == "CollectiveReduceV2" and "tp_all_reduce" in op.name)
                or (op.type == "AddN" and "tp_reduce" in op.name)):
            found.setdefault(op.device, []).append(op.type)
    return found


def main(argv):
    import tensorflow as tf

    initial = common.megatron_mlp().get_weights()
    want = _trained().get_weights()
    results = []
    for layout in FLAGS.layouts.split(";"):
        replicas, stages, tensor_parallel, shard = layout.split(",")
        tensor_parallel = int(tensor_parallel)
        keras.backend.clear_session()
        strategy = tfpar.PipelineStrategy(
            num_micro_batches=2, num_replicas=int(replicas), num_stages=int(stages),
            tensor_parallel=tensor_parallel, shard=None if shard == "none" else shard,
            layout_map=common.megatron_layout() if tensor_parallel > 1 else None,
            cluster_resolver=tf.distribute.cluster_resolver.TFConfigClusterResolver())
        model = _trained(strategy)
        got = model.get_weights()
        results.append({
            "layout": layout,
            "difference": max(float(np.abs(a - b).max()) for a, b in zip(got, want)),
            "moved": max(float(np.abs(a - b).max()) for a, b in zip(got, initial)),
            "stage_devices": [list(row) for row in strategy.stage_devices],
            "stage_communication": {str(k): v for k, v in strategy.communication.items()},
            "tensor_communication": strategy.tensor_communication,
            "tensor_reductions": (_tensor_reductions(strategy, model)
                                  if tensor_parallel > 1 else {}),
            "weights": {v.path: _devices(v) for v in model.weights},
            "slots": {v.path: _devices(v) for v in model.optimizer.variables
                      if v.path.endswith(("momentum", "velocity"))},
        })
    with open(FLAGS.out, "w") as f:
        json.dump(results, f)
    print("DONE", flush=True)


if __name__ == "__main__":
    app.run(main)
