"""The tfpar training binary: `python -m tfpar.cli.train` or `tfpar train`.

With no flags: data-parallel training on 2 logical CPUs on the built-in
spirals dataset, printing Keras progress, then final loss, accuracy, samples/s.

    python -m tfpar.cli.train --strategy=data --num_devices=4 --epochs=10 \
        --model_dir=/tmp/run --log_dir=/tmp/run/logs
    python -m tfpar.cli.train --strategy=pipeline --num_micro_batches=8 --schedule=1f1b
    python -m tfpar.cli.train --strategy=auto --bytes_per_device=400KB
    tfpar launch --workers 2 --coordinator -- python -m tfpar.cli.train --strategy=pipeline

Under `tfpar launch --coordinator` the pipeline runs on the chief with one stage per
worker process. `--strategy=auto` asks `tfpar.plan.advise` for the data x pipe x model
degrees that fit --bytes_per_device on this host's --num_devices, prints its reasoning and
trains with that strategy (or stops, saying why, when nothing it can build fits).
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags, logging  # noqa: E402

from tfpar.cli import factory  # noqa: E402
from tfpar.plan.schedule import SCHEDULES  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("strategy", "data", factory.STRATEGIES, "Which tfpar strategy trains the model.")
flags.DEFINE_string("bytes_per_device", None,
                    "For --strategy=auto: memory of each device, e.g. 16GiB (default: the "
                    "host's available memory over --num_devices).")
flags.DEFINE_integer("num_devices", 2, "Devices to use; on a host with no GPU, logical CPUs.")
flags.DEFINE_string("communication", "auto", "All-reduce for --strategy=data.")
flags.DEFINE_enum("compression", "none", ("none", "fp16", "bf16"),
                  "For --strategy=data: the type gradients are summed in on the wire.")
flags.DEFINE_integer("sync_every", 1, "For --strategy=data: periodic averaging, each replica "
                     "steps alone and the weights are averaged every this many steps (1: "
                     "gradients summed every step).", lower_bound=1)
flags.DEFINE_string("dataset", "spirals", "'spirals' (built in) or a tfds name prepared in --data_dir.")
flags.DEFINE_string("data_dir", None, "tfds data directory (tfpar never downloads).")
flags.DEFINE_integer("epochs", 10, "Epochs to train (a resumed run stops at the same total).")
flags.DEFINE_integer("batch_size", 64, "Global batch size, split evenly over the replicas.")
flags.DEFINE_float("learning_rate", 0.01, "Adam learning rate (the first, with cosine decay).")
flags.DEFINE_enum("learning_rate_decay", "cosine", ("cosine", "none"),
                  "cosine: the rate decays to 0 over all epochs' steps, so the last epochs "
                  "settle (asynchronous updates swing at a constant rate); none: constant.")
flags.DEFINE_string("model_dir", None, "Checkpoints and the final model; a rerun resumes from it.")
# absl.logging already defines --log_dir ("directory to write logfiles into"):
# tfpar writes its TensorBoard logs there rather than define a clashing flag.
if "log_dir" not in FLAGS:
    flags.DEFINE_string("log_dir", None, "TensorBoard log directory.")
flags.DEFINE_integer("seed", 0, "Seed for weights and shuffling (the same on every worker).")
flags.DEFINE_float("timeout_seconds", 60.0,
                   "Across workers: a collective waiting longer than this for a peer fails.")
flags.DEFINE_enum("ps_mode", "async", ("async", "sync"),
                  "For --strategy=ps: asynchronous updates, or one averaged update per batch.")
flags.DEFINE_integer("verbose", 1, "Keras progress: 0 silent, 1 bar, 2 a line an epoch.")
flags.DEFINE_integer("num_micro_batches", 4,
                     "For --strategy=pipeline: micro-batches each batch is split into.")
flags.DEFINE_enum("schedule", "gpipe", SCHEDULES, "For --strategy=pipeline: the schedule.")
flags.DEFINE_integer("virtual_stages", 1,
                     "For --strategy=pipeline: model chunks per device (interleaved_1f1b, "
                     "zero_bubble_h1).")
flags.DEFINE_integer("num_stages", None,
                     "For --strategy=pipeline: stages (default num_devices / num_replicas).")
flags.DEFINE_bool("remat", False,
                  "For --strategy=pipeline: recompute activations in the backward pass.")
flags.DEFINE_integer("num_replicas", 1,
                     "For --strategy=pipeline: pipeline replicas (devices = replicas x stages).")


WIDTHS = (128, 128, 64)  # The hidden layers of build_model.


def build_model(source, seed=0):
    """A multilayer perceptron for `source` (images are rescaled and flattened)."""
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input(source.input_shape)
    x = keras.layers.Flatten()(inputs) if len(source.input_shape) > 1 else inputs
    for i, width in enumerate(WIDTHS):
        x = keras.layers.Dense(width, activation="relu", name=f"hidden_{i}")(x)
    outputs = keras.layers.Dense(source.num_classes)(x)
    return keras.Model(inputs, outputs)


def megatron_layout_map(num_layers=len(WIDTHS)):
    """Hidden layers named `hidden_<i>` (as `build_model`'s) split Megatron's way over the
    "model" axis: even layers by output units (column), odd ones by inputs (row), so a
    column layer's output reaches the next row layer split. For
    `PipelineStrategy(tensor_parallel=T)`."""
    import keras

    layout_map = keras.distribution.LayoutMap(None)
    for i in range(num_layers):
        if i % 2 == 0:
            layout_map[f".*hidden_{i}/kernel"] = (None, "model")
            layout_map[f".*hidden_{i}/bias"] = ("model",)
        else:
            layout_map[f".*hidden_{i}/kernel"] = ("model", None)
    return layout_map


def model_layers(input_shape, num_classes, batch_size, dtype_bytes=4):
    """`build_model`'s Dense layers as `tfpar.plan.placement.LayerCost`s (parameters, and
    the output each keeps for the backward pass at `batch_size`), without building it."""
    import math

    from tfpar.plan.placement import LayerCost

    layers, width_in = [], math.prod(input_shape)
    for i, width in enumerate(WIDTHS + (num_classes,)):
        params = (width_in + 1) * width
        layers.append(LayerCost(f"dense_{i}", params, params * dtype_bytes, 0,
                                batch_size * width * dtype_bytes))
        width_in = width
    return layers


def _available_memory():
    """Bytes of memory available on this host (Linux), or None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def auto_advice(dataset="spirals", data_dir=None, num_devices=2, batch_size=64,
                bytes_per_device=None):
    """`tfpar.plan.advise` for training `build_model` on `dataset` (Adam, float32) over
    `num_devices` devices of this host, at the global batch (counted whole on every model
    copy: on the safe side for data parallelism). `bytes_per_device`: an int or text such
    as "16GiB"; None: the host's available memory over the devices."""
    import math

    from tfpar import data
    from tfpar.plan import advise, parse_bytes

    if bytes_per_device is None:
        available = _available_memory()
        if available is None:
            raise factory.AutoError("--strategy=auto needs --bytes_per_device here (this host "
                                    "does not say how much memory it has available).")
        bytes_per_device = available // num_devices
    elif isinstance(bytes_per_device, str):
        try:
            bytes_per_device = parse_bytes(bytes_per_device)
        except ValueError as error:
            raise factory.AutoError(f"--bytes_per_device: {error}") from None
    input_shape, num_classes = data.describe(dataset, data_dir)
    return advise(model_layers(input_shape, num_classes, batch_size), num_devices,
                  bytes_per_device, optimizer_slots=2, dtype_bytes=4,
                  input_bytes=batch_size * (4 * math.prod(input_shape) + 8))


def _as_float(features, label):
    import tensorflow as tf

    if features.dtype == tf.uint8:
        features = tf.cast(features, tf.float32) / 255.0
    return tf.cast(features, tf.float32), label


def _throughput_callback(examples_per_epoch):
    """A Keras callback measuring samples/s; the first epoch (tracing) counts only if alone."""
    import keras

    class Throughput(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epoch_seconds = []

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.epoch_seconds.append(time.perf_counter() - self._start)

        def samples_per_second(self):
            timed = self.epoch_seconds[1:] or self.epoch_seconds
            return examples_per_epoch * len(timed) / sum(timed) if timed else 0.0

    return Throughput()


def callbacks_for(model_dir, log_dir):
    """The callbacks that make a run resumable and observable."""
    import keras

    callbacks = []
    if model_dir:
        callbacks.append(keras.callbacks.BackupAndRestore(
            os.path.join(model_dir, "backup"), delete_checkpoint=False))
        callbacks.append(keras.callbacks.ModelCheckpoint(
            os.path.join(model_dir, "checkpoints", "epoch-{epoch:03d}.weights.h5"),
            save_weights_only=True))
    if log_dir:
        callbacks.append(keras.callbacks.TensorBoard(log_dir))
    return callbacks


def _devices_of(strategy):
    """The devices `strategy` trains on, or None (a TF_CONFIG cluster's are its tasks')."""
    if hasattr(strategy, "tensor_parallel_devices"):
        return [d for row in strategy.tensor_parallel_devices for stage in row for d in stage]
    devices = getattr(strategy, "devices", None) or getattr(strategy.extended,
                                                             "worker_devices", None)
    return list(devices) if devices else None


def what_runs(strategy, devices, gpu_absent, dataset, train_examples, test_examples,
              batch_size, epochs):
    """The one line that says what the job runs: strategy, devices (and why CPUs), data."""
    import re

    if devices is None:
        where = "the TF_CONFIG cluster's tasks"
    else:
        kinds = {"GPU" if re.search(r"gpu:\d+$", d, re.I) else "CPU" for d in devices}
        kind = kinds.pop() if len(kinds) == 1 else "device"
        names = ", ".join(d.split("device:")[-1] for d in devices)
        where = f"{len(devices)} {'logical ' if kind == 'CPU' else ''}{kind}" \
                f"{'s' if len(devices) > 1 else ''} ({names})"
        if kind == "CPU":
            where += ("; no GPU on this host (no NVIDIA driver)" if gpu_absent
                      else "; TensorFlow sees no GPU")
    return (f"tfpar.cli.train: {type(strategy).__name__} on {where}; dataset {dataset} "
            f"({train_examples} train / {test_examples} test examples), global batch "
            f"{batch_size}, {epochs} epoch{'s' if epochs != 1 else ''}")


def run(strategy_name="data", num_devices=2, communication="auto", dataset="spirals",
        data_dir=None, epochs=10, batch_size=64, learning_rate=0.01, model_dir=None,
        log_dir=None, seed=0, verbose=1, timeout_seconds=60.0, ps_mode="async", pipeline=None,
        learning_rate_decay="cosine", bytes_per_device=None, compression=None, sync_every=1):
    """Trains and evaluates; returns a dict with loss, accuracy and samples_per_second.

    `pipeline`: for strategy "pipeline", a dict of `PipelineStrategy` keyword arguments.
    `learning_rate_decay`: "cosine" (to 0 over all the steps of `epochs`) or "none".
    `compression`: for strategy "data", "fp16" or "bf16" (`DataParallelStrategy(compression=)`);
    `sync_every`: for strategy "data", `DataParallelStrategy(sync_every=)`.
    Strategy "auto": the one `auto_advice` (at `bytes_per_device`) names; its reasoning is
    printed; a `factory.AutoError` when nothing it can build fits.
    """
    from tfpar import data

    if learning_rate_decay not in ("cosine", "none"):
        raise ValueError(f"learning_rate_decay must be 'cosine' or 'none'. Received: "
                         f"{learning_rate_decay!r}")
    shard = None
    if strategy_name == "auto":
        from tfpar.cluster.tf_config import parse_tf_config

        if parse_tf_config() is not None:
            raise factory.AutoError("--strategy=auto plans this host's devices; on a TF_CONFIG "
                                    "cluster choose --strategy yourself.")
        advice = auto_advice(dataset, data_dir, num_devices, batch_size, bytes_per_device)
        print(advice.explain(), end="", flush=True)
        strategy_name, chosen = factory.from_advice(advice)
        if chosen.get("tensor_parallel", 1) > 1:
            chosen["layout_map"] = megatron_layout_map()
        if strategy_name == "pipeline":
            pipeline = {**(pipeline or {}), **chosen}
        else:
            shard = chosen["shard"]
    strategy = factory.make_strategy(strategy_name, num_devices, communication, timeout_seconds,
                                     ps_mode, pipeline, shard=shard, compression=compression,
                                     sync_every=sync_every)
    import keras

    from tfpar.plan.batching import per_replica_batch_size

    per_replica_batch_size(batch_size, strategy.num_replicas_in_sync)
    # A pipeline splits every training batch into equal micro-batches: the last,
    # partial batch of an epoch is dropped.
    drop_remainder = strategy_name == "pipeline"
    if drop_remainder:
        from tfpar.plan.stages import check_micro_batches

        check_micro_batches(batch_size, strategy.num_micro_batches, strategy.num_replicas_in_sync)
    train = data.load(dataset, "train", data_dir, seed=seed)
    test = data.load(dataset, "test", data_dir, seed=seed)
    train_ds = (train.dataset.map(_as_float).cache()
                .shuffle(min(train.num_examples, 10000), seed=seed)
                .batch(batch_size, drop_remainder=drop_remainder).prefetch(2))
    test_ds = test.dataset.map(_as_float).batch(batch_size)
    from tfpar.cli import cuda_noise

    print(what_runs(strategy, _devices_of(strategy), cuda_noise.gpu_absent(), dataset,
                    train.num_examples, test.num_examples, batch_size, epochs), flush=True)
    if learning_rate_decay == "cosine":
        # The optimizer's iterations drive it, so a resumed run goes on where it stopped.
        steps_per_epoch = (train.num_examples // batch_size if drop_remainder
                           else -(-train.num_examples // batch_size))
        learning_rate = keras.optimizers.schedules.CosineDecay(
            learning_rate, decay_steps=max(1, epochs * steps_per_epoch))
    with strategy.scope():
        model = build_model(train, seed)
        model.compile(
            optimizer=keras.optimizers.Adam(learning_rate),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"])
    throughput = _throughput_callback(
        train.num_examples - (train.num_examples % batch_size if drop_remainder else 0))
    model.fit(train_ds, epochs=epochs, validation_data=test_ds, verbose=verbose, shuffle=False,
              callbacks=callbacks_for(model_dir, log_dir) + [throughput])
    loss, accuracy = model.evaluate(test_ds, verbose=0)
    if model_dir and strategy.extended.should_checkpoint:  # the chief only
        model.save(os.path.join(model_dir, "model.keras"))
    return {"loss": float(loss), "accuracy": float(accuracy),
            "samples_per_second": throughput.samples_per_second(),
            "replicas": strategy.num_replicas_in_sync}


def _peer_failure(error):
    """A clear message for a worker that lost its peers, or None for other errors."""
    import tensorflow as tf

    from tfpar.errors import ClusterError

    if isinstance(error, ClusterError):
        return f"tfpar: {error}"

    peer_errors = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                   tf.errors.AbortedError, tf.errors.InternalError, tf.errors.CancelledError)
    from tfpar.cluster.tf_config import parse_tf_config

    cluster = parse_tf_config()
    if not isinstance(error, peer_errors) or cluster is None or cluster.num_workers < 2:
        return None
    detail = " ".join(str(error.message).split())[:300]
    return (f"tfpar: training stopped on {cluster.task_name}: a peer worker failed or became "
            f"unreachable ({type(error).__name__}: {detail}). Restart all workers with the same "
            f"--model_dir to resume from the last completed epoch.")


def _pipeline_flags():
    """PipelineStrategy's keyword arguments from the flags (used by --strategy=pipeline)."""
    return {"num_micro_batches": FLAGS.num_micro_batches, "schedule": FLAGS.schedule,
            "remat": FLAGS.remat, "num_replicas": FLAGS.num_replicas,
            "num_stages": FLAGS.num_stages, "virtual_stages": FLAGS.virtual_stages}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    try:
        result = run(FLAGS.strategy, FLAGS.num_devices, FLAGS.communication, FLAGS.dataset,
                     FLAGS.data_dir, FLAGS.epochs, FLAGS.batch_size, FLAGS.learning_rate,
                     FLAGS.model_dir, FLAGS.log_dir, FLAGS.seed, FLAGS.verbose,
                     FLAGS.timeout_seconds, FLAGS.ps_mode, _pipeline_flags(),
                     FLAGS.learning_rate_decay, FLAGS.bytes_per_device,
                     None if FLAGS.compression == "none" else FLAGS.compression,
                     FLAGS.sync_every)
    except factory.AutoError as error:
        print(f"tfpar.cli.train: {error}", file=sys.stderr, flush=True)
        return 2
    except Exception as error:
        message = _peer_failure(error)
        if message is None:
            raise
        print(message, file=sys.stderr, flush=True)
        return 1
    print(f"final: loss={result['loss']:.4f} accuracy={result['accuracy']:.4f} "
          f"samples/s={result['samples_per_second']:.0f} replicas={result['replicas']}")
    return 0


def entry():
    from tfpar.cli import cuda_noise

    cuda_noise.filter_stderr()  # Before TensorFlow is imported.
    app.run(main)


if __name__ == "__main__":
    entry()
