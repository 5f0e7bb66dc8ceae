"""A model bigger than one worker's memory, trained across workers, saved and resumed.

A 100.7M-parameter MLP (24 x Dense(2048, tanh) + a 10-way head, SGD with momentum) needs
about 1.9 GB in one process here. Capped at 70% of that above the base, one worker cannot
train it; two workers can, with ZeRO-3 or with a pipeline of two stages:

    tfpar launch --workers 2 --memory_cap 1.8GiB -- \\
        python examples/bigger_than_one_worker.py --strategy=zero3 --save=/tmp/big.weights.h5
    tfpar launch --workers 2 --memory_cap 1.8GiB -- \\
        python examples/bigger_than_one_worker.py --strategy=zero3 --load=/tmp/big.weights.h5
    tfpar launch --workers 2 --coordinator --memory_cap 1.8GiB -- \\
        python examples/bigger_than_one_worker.py --strategy=pipeline --save=/tmp/big.weights.h5

(`--strategy=data` under the same cap is killed by the kernel: each worker holds it all.)
Checkpoints are Keras' own `save_weights` files, written one variable at a time, which
load in plain Keras on one device. Each process prints its measured peaks
(`tfpar.process_memory`); with --report=DIR it also writes them to DIR/<task>.json.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

import tfpar  # noqa: E402  (cheap: TensorFlow is imported on first use)
from tfpar.cluster import parse_tf_config  # noqa: E402

STRATEGIES = ("one", "data", "zero1", "zero2", "zero3", "pipeline", "model", "tensor",
              "hybrid", "auto")
flags.DEFINE_enum("strategy", "zero3", STRATEGIES,
                  "one: this process alone; data: data parallelism across the TF_CONFIG "
                  "workers; zeroN: with ZeRO stage N; pipeline: one stage per worker (run "
                  "with tfpar launch --coordinator); model: model parallelism, the layers "
                  "placed on the workers' CPUs from the chief (also --coordinator); "
                  "tensor: Megatron tensor parallelism alone, one stage split over all the "
                  "workers; hybrid: --stages pipeline stages, each split over the workers "
                  "they leave (tensor x pipeline); auto: the degrees tfpar.plan.advise picks "
                  "at --bytes_per_device (tensor, hybrid and auto: --model=wide, "
                  "--coordinator).")
flags.DEFINE_enum("model", "mlp", ["mlp", "wide"],
                  "mlp: --layers x Dense(--width, tanh) + a 10-way head, SGD with momentum; "
                  "wide: one layer too wide for one worker (Dense(16384) on 1536 inputs, a "
                  "Megatron column/row pair) and a trunk that tensor parallelism leaves whole "
                  "(6 x Dense(1920)), Adam: 48.9M parameters.")
flags.DEFINE_integer("stages", 2, "Pipeline stages of --strategy=hybrid.")
flags.DEFINE_string("bytes_per_device", None, "--strategy=auto: the memory each worker has "
                    "for training (its cap less what the process needs before), e.g. 300MiB.")
flags.DEFINE_integer("width", 2048, "Units of each hidden layer (and inputs).")
flags.DEFINE_integer("layers", 24, "Hidden layers.")
flags.DEFINE_integer("micro_batches", 4, "Micro-batches of a pipeline step.")
flags.DEFINE_bool("remat", False, "Pipeline: recompute each stage's activations in its "
                  "backward, keeping only each micro-batch's stage input.")
flags.DEFINE_enum("offload_activations", "none", ["none", "chief"],
                  "Pipeline with --remat: keep those inputs in the chief's memory instead "
                  "of the stage worker's (tfpar.PipelineStrategy(offload_activations=...)).")
flags.DEFINE_integer("batch", 16, "Global batch.")
flags.DEFINE_integer("steps", 2, "Steps to train.")
flags.DEFINE_integer("first_step", 0, "The data starts at this step's batch (a resumed run "
                                      "goes on where the first one stopped).")
flags.DEFINE_string("load", None, "Weights to start from (a Keras .weights.h5 file).")
flags.DEFINE_string("save", None, "Where to save after training: a .weights.h5 file "
                    "(model.save_weights) or a .keras file (model.save).")
flags.DEFINE_string("checkpoint", None, "A keras.callbacks.ModelCheckpoint path (.keras or "
                    ".weights.h5), written after each epoch.")
flags.DEFINE_string("report", None, "Directory for this process's figures (JSON).")
flags.DEFINE_string("compare", None, "A .weights.h5 file of the same model trained elsewhere "
                    "(e.g. --strategy=one --save=...): print the largest difference between "
                    "its weights and these (the model's own, read one by one; not the "
                    "optimizer's).")
FLAGS = flags.FLAGS

BATCH = 16
SHARDS = {"zero1": "optimizer", "zero2": "gradients", "zero3": "parameters"}


CHIEF_CPU = "/job:chief/replica:0/task:0/device:CPU:0"


# --model=wide: inputs, the Megatron pair's hidden units and output, the trunk's width
# and depth. The pair's first kernel alone (25.2M parameters, 403 MB with Adam) is more
# than a worker of the README's cap holds.
WIDE = dict(inputs=1536, hidden=32768, narrow=288, trunk=2400, trunk_layers=6)


def wide_layers(batch=BATCH):
    """--model=wide as `tfpar.plan.placement.LayerCost`s for the advisor, without building
    it: parameters, the output each keeps at `batch`, and which the layout map splits."""
    from tfpar.plan.placement import LayerCost

    widths = ([("wide_in", WIDE["hidden"], True), ("wide_out", WIDE["narrow"], True)]
              + [(f"trunk_{i}", WIDE["trunk"], False) for i in range(WIDE["trunk_layers"])]
              + [("head", 10, False)])
    layers, width_in = [], WIDE["inputs"]
    for name, width, split in widths:
        params = (width_in + 1) * width
        layers.append(LayerCost(name, params, 4 * params, 0, 4 * batch * width,
                                tensor_split=split))
        width_in = width
    return layers


def wide_layout_map():
    """Megatron's split of the wide pair: column, then row (the trunk stays whole)."""
    import keras

    layout_map = keras.distribution.LayoutMap(None)
    layout_map[r".*wide_in/kernel"] = (None, "model")
    layout_map[r".*wide_out/kernel"] = ("model", None)
    return layout_map


def _degrees(name, workers):
    """(replicas, stages, tensor_parallel, shard) of --strategy tensor, hybrid or auto."""
    if FLAGS.model != "wide":
        raise app.UsageError(f"--strategy={name} splits --model=wide's Megatron pair; pass "
                             f"--model=wide.")
    if name == "tensor":
        return 1, 1, workers, None
    if name == "hybrid":
        if workers % FLAGS.stages:
            raise app.UsageError(f"--stages={FLAGS.stages} does not divide the {workers} "
                                 f"workers.")
        return 1, FLAGS.stages, workers // FLAGS.stages, None
    if not FLAGS.bytes_per_device:
        raise app.UsageError("--strategy=auto needs --bytes_per_device (the memory each "
                             "worker has for training).")
    advice = tfpar.plan.advise(wide_layers(FLAGS.batch), workers,
                               tfpar.plan.parse_bytes(FLAGS.bytes_per_device),
                               optimizer_slots=2, input_bytes=FLAGS.batch * 4 * (
                                   WIDE["inputs"] + 1))
    print(advice.explain(), flush=True)
    if advice.chosen is None or advice.data > 1 and advice.pipe == advice.model == 1:
        raise app.UsageError("--strategy=auto runs the pipeline and tensor-parallel layouts "
                             "from the chief; the advisor chose none of them (above).")
    return advice.data, advice.pipe, advice.model, advice.chosen.config.shard


def make_strategy(name, micro_batches=4, remat=False, offload="none"):
    import tensorflow as tf

    if name == "one":
        return tf.distribute.get_strategy()
    if name in ("tensor", "hybrid", "auto"):
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        replicas, stages, tensor, shard = _degrees(
            name, resolver.cluster_spec().num_tasks("worker"))
        return tfpar.PipelineStrategy(
            num_micro_batches=micro_batches, num_replicas=replicas, num_stages=stages,
            tensor_parallel=tensor, shard=shard,
            layout_map=wide_layout_map() if tensor > 1 else None, cluster_resolver=resolver)
    if name == "pipeline":
        return tfpar.PipelineStrategy(
            num_micro_batches=micro_batches, remat=remat,
            offload_activations=CHIEF_CPU if offload == "chief" else False,
            cluster_resolver=tf.distribute.cluster_resolver.TFConfigClusterResolver())
    if name == "model":
        # The chief joins the cluster itself and names the workers' devices. (Given a
        # ClusterSpec: given the resolver, TensorFlow puts all work on the chief's device.)
        spec = tf.distribute.cluster_resolver.TFConfigClusterResolver().cluster_spec()
        tf.config.experimental_connect_to_cluster(spec, job_name="chief", task_index=0)
        workers = spec.num_tasks("worker")
        return tfpar.ModelParallelStrategy(
            devices=[f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in range(workers)])
    return tfpar.DataParallelStrategy(shard=SHARDS.get(name), timeout_seconds=600)


def make_model(width, layers):
    import keras

    keras.utils.set_random_seed(0)
    if FLAGS.model == "wide":
        model = keras.Sequential(
            [keras.Input((WIDE["inputs"],)),
             keras.layers.Dense(WIDE["hidden"], activation="relu", name="wide_in"),
             keras.layers.Dense(WIDE["narrow"], name="wide_out")]
            + [keras.layers.Dense(WIDE["trunk"], activation="tanh", name=f"trunk_{i}")
               for i in range(WIDE["trunk_layers"])]
            + [keras.layers.Dense(10, name="head")])
        model.compile(keras.optimizers.Adam(1e-4),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="tanh") for _ in range(layers)]
        + [keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(0.01, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def make_data(width, first_step, steps, batch=BATCH):
    import numpy as np

    rng = np.random.default_rng(0)
    # float32 straight away: a float64 draw would double the program's own peak.
    x = rng.standard_normal(size=((first_step + steps) * batch, width), dtype=np.float32)
    y = (np.arange(len(x)) % 10).astype("int32")
    return x[first_step * batch:], y[first_step * batch:]


def main(_):
    # Before TensorFlow starts: allocator peaks on any CPU (oneDNN on or off).
    tfpar.use_allocator_statistics()
    import keras
    import tensorflow as tf

    strategy = make_strategy(FLAGS.strategy, FLAGS.micro_batches, FLAGS.remat,
                             FLAGS.offload_activations)
    inputs = WIDE["inputs"] if FLAGS.model == "wide" else FLAGS.width
    x, y = make_data(inputs, FLAGS.first_step, FLAGS.steps, FLAGS.batch)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(FLAGS.batch)
    with strategy.scope():
        model = make_model(FLAGS.width, FLAGS.layers)
    if FLAGS.load:
        model.load_weights(FLAGS.load)
    tfpar.reset_memory_peaks()
    callbacks = ([keras.callbacks.ModelCheckpoint(
        FLAGS.checkpoint, save_weights_only=FLAGS.checkpoint.endswith(".weights.h5"))]
        if FLAGS.checkpoint else [])
    model.fit(dataset, epochs=1, verbose=0, callbacks=callbacks)
    trained = tfpar.process_memory()
    config = parse_tf_config(os.environ.get("TF_CONFIG"))  # None without a cluster.
    task = config.task_name.replace(":", "-") if config and config.task_type else "single-0"
    if FLAGS.compare:
        import numpy as np

        reference = make_model(FLAGS.width, FLAGS.layers)  # Plain, in this process.
        reference.load_weights(FLAGS.compare)
        difference = max(float(np.max(np.abs(a.numpy() - b.numpy())))
                         for a, b in zip(model.weights, reference.weights))
        print(f"largest difference to {FLAGS.compare}: {difference:.3g}", flush=True)
    if FLAGS.save:
        # Every worker saves together under sharding (each variable is fetched from its
        # owner); only the chief's file is kept.
        chief = config is None or config.task_type is None or config.is_chief
        suffix = ".keras" if FLAGS.save.endswith(".keras") else ".weights.h5"
        path = FLAGS.save if chief else f"{FLAGS.save}.{task}{suffix}"
        model.save(path) if suffix == ".keras" else model.save_weights(path)
        if not chief:
            os.remove(path)
    print(f"{task}: {model.count_params():,} parameters, trained {FLAGS.steps} steps with "
          f"{FLAGS.strategy}; {trained.format()}", flush=True)
    if FLAGS.report:
        os.makedirs(FLAGS.report, exist_ok=True)
        with open(os.path.join(FLAGS.report, f"{task}.json"), "w") as f:
            json.dump({"allocator_peak": trained.allocator_peak_bytes,
                       "rss_peak": trained.rss_peak_bytes,
                       "peak_source": trained.peak_source}, f)


if __name__ == "__main__":
    app.run(main)
