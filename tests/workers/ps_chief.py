"""The chief of the parameter-server tests: runs one scenario, writes <out>/result.json.

    python ps_chief.py --scenario=async|sync|faults --out=DIR

Scenarios (each needs its own cluster: a process joins one cluster, once):
  async   2 workers, 1 ps: fit on spirals against one device, exact step counts
          (Keras' own train_step in a custom loop, fit, steps_per_execution, a
          dataset function), variable placement, evaluate/predict exactness, and
          the infinite-dataset error.
  sync    2 workers, 2 ps, mode="sync", a partitioned Embedding: weights against
          one device on the combined batch, shard placement, weights round trip,
          loading on one device.
  exact   2 workers, 2 ps, async: stateful updates lose nothing (metrics, BatchNorm,
          LossScaleOptimizer under mixed precision) in fit and evaluate against one
          device; batch logs; each worker reads its own shard.
  faults  2 workers, 1 ps: a long fit (--fault_epochs of 150 steps) during which the
          test kills and restarts workers (prints "FIT STARTED", "FIT ENDED"); then a
          fit during which the test kills the ps (prints "PS FIT STARTED").
  no_workers  1 worker, 1 ps: a long fit during which the test kills the only
          worker (prints "FIT STARTED").
  data_service  under `tfpar launch --data_service`: async fits reading through the
          tf.data service (--data_service_epochs), which batches each epoch saw.
  chiefless  1 worker, 1 ps, no TF_CONFIG: a SimpleClusterResolver naming the workers
          and ps only (as the TensorFlow tutorial); the public properties of the
          strategy (stock with --stock) and, for tfpar, a short fit.
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("scenario", "async",
                  ["async", "sync", "exact", "faults", "no_workers", "data_service",
                   "chiefless"],
                  "What to run.")
flags.DEFINE_integer("fault_epochs", 4, "faults: epochs of 150 steps in the first fit.")
flags.DEFINE_integer("data_service_epochs", 3, "data_service: epochs of 20 batches.")
flags.DEFINE_bool("stock", False, "chiefless: TensorFlow's ParameterServerStrategy instead.")
flags.DEFINE_string("out", None, "Directory for result.json.")


def _devices(model):
    return sorted({v.value.device for v in model.variables if hasattr(v.value, "device")}
                  | {s.device for v in model.variables for s in getattr(v.value, "variables", [])})


def _spirals_model(strategy, seed=0, decay_steps=None):
    """The training binary's spirals model; with `decay_steps`, Adam's rate decays to 0
    over them, so the last epoch's weights settle instead of riding async noise."""
    import keras

    from tfpar import data
    from tfpar.cli.train import build_model

    source = data.load("spirals", "train", seed=seed)
    with strategy.scope():
        model = build_model(source, seed)
        rate = 0.01 if decay_steps is None else keras.optimizers.schedules.CosineDecay(
            0.01, decay_steps)
        model.compile(keras.optimizers.Adam(rate),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    return model


def _spirals(split, batch_size=64):
    from tfpar import data

    source = data.load("spirals", split, seed=0)
    return source.dataset.batch(batch_size), source


def run_async(strategy, result):
    import keras
    import numpy as np
    import tensorflow as tf

    # Keras' own train_step, scheduled 100 times: the atomic assign_add alone must
    # count every step (the chief corrects nothing in this loop).
    model = _spirals_model(strategy)
    train, source = _spirals("train")
    with strategy.scope():
        model._symbolic_build(data_batch=train.element_spec)
    iterator = strategy.per_worker_iterator(train.repeat())
    for _ in range(100):
        strategy.schedule_steps(model.train_step, iterator, 1)
    strategy.join()
    result["custom_loop_iterations"] = int(model.optimizer.iterations.numpy())
    result["variable_devices"] = _devices(model) + sorted(
        {v.value.device for v in model.optimizer.variables})

    # fit against one device, same model, data and epochs. Async updates are stale by up to
    # a step per worker: at a constant rate one epoch's accuracy swung to 0.92 under load.
    epochs = 4
    decay_steps = epochs * int(train.cardinality())
    model = _spirals_model(strategy, decay_steps=decay_steps)
    test, _ = _spirals("test")
    start = time.perf_counter()
    history = model.fit(train.shuffle(1000, seed=0), epochs=epochs, verbose=2,
                        validation_data=test)
    result["fit_seconds"] = time.perf_counter() - start
    result["history"] = history.history
    result["steps_per_epoch"] = int(train.cardinality())
    result["fit_iterations"] = int(model.optimizer.iterations.numpy())
    result["accuracy"] = model.evaluate(test, verbose=0, return_dict=True)["accuracy"]
    local = _spirals_model(tf.distribute.get_strategy(), decay_steps=decay_steps)
    local.fit(train.shuffle(1000, seed=0), epochs=epochs, verbose=0)
    result["single_device_accuracy"] = local.evaluate(test, verbose=0, return_dict=True)["accuracy"]

    # evaluate and predict see each example once: equal to the same weights locally.
    local.set_weights(model.get_weights())
    result["evaluate"] = model.evaluate(test, verbose=0, return_dict=True)
    result["local_evaluate"] = local.evaluate(test, verbose=0, return_dict=True)
    features = np.stack([f for f, _ in test.unbatch().as_numpy_iterator()])
    remote = model.predict(features, batch_size=50, verbose=0)
    mine = local.predict(features, batch_size=50, verbose=0)
    result["predict_max_difference"] = float(np.abs(remote - mine).max())
    result["predict_scale"] = float(np.abs(mine).max())
    result["predict_shape"] = list(remote.shape)
    result["test_examples"] = len(features)

    # steps_per_execution with a remainder, and a dataset function.
    with strategy.scope():
        small = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
        small.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=3)

    def dataset_fn(context):
        return _spirals("train", 32)[0].repeat()

    small.fit(dataset_fn, steps_per_epoch=10, epochs=2, verbose=0)
    result["steps_per_execution_iterations"] = int(small.optimizer.iterations.numpy())

    # Re-compiling replaces the optimizer, loss and metrics: a learning rate of 0 must
    # leave the weights alone, and the new metric must be the one reported.
    with strategy.scope():
        small.compile(keras.optimizers.SGD(0.0),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=[keras.metrics.SparseCategoricalAccuracy(name="recompiled")])
    before = small.get_weights()
    history = small.fit(dataset_fn, steps_per_epoch=4, epochs=1, verbose=0)
    result["recompile_weight_change"] = float(max(
        np.abs(a - b).max() for a, b in zip(small.get_weights(), before)))
    result["recompile_logs"] = sorted(history.history)
    result["recompile_iterations"] = int(small.optimizer.iterations.numpy())
    for call in ("train_on_batch", "test_on_batch", "predict_on_batch"):
        arguments = (np.zeros((4, 2), "float32"),) + (
            () if call == "predict_on_batch" else (np.zeros(4, "int32"),))
        try:
            getattr(small, call)(*arguments)
            result[call] = "ran"
        except ValueError as error:
            result[call] = str(error)
    try:
        small.fit(dataset_fn, np.zeros(4), steps_per_epoch=2, verbose=0)
        result["dataset_fn_with_y"] = "ran"
    except ValueError as error:
        result["dataset_fn_with_y"] = str(error)
    try:
        small.fit(train.repeat(), epochs=1, verbose=0)
    except ValueError as error:
        result["infinite_error"] = str(error)
    with strategy.scope():
        small.compile(keras.optimizers.SGD(0.0),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=True)
    try:
        small.fit(dataset_fn, steps_per_epoch=2, verbose=0)
        result["jit_compile"] = "ran"
    except ValueError as error:
        result["jit_compile"] = str(error)


def _user_errors(strategy, result, tries=5):
    """A loss of mismatched shapes ([64] against [64, 10], known only when the step runs):
    the error each of `tries` fits raises, its type and text. Whether the error that comes
    back is the one relayed by a ps (whose text names /job:ps) is a race: 3 runs in 4 here.
    Run last: each error cancels the queued closures."""
    import keras
    import numpy as np
    import tensorflow as tf

    with strategy.scope():
        wrong = keras.Sequential([keras.Input((2,)), keras.layers.Dense(10)])
        wrong.compile("sgd", "mse")
    # Batches of unknown size: the shapes meet only at run time, on a worker.
    data = tf.data.Dataset.from_tensor_slices(
        (np.zeros((128, 2), "float32"), np.zeros(128, "float32"))).batch(64)
    result["user_errors"] = []
    for _ in range(tries):
        try:
            wrong.fit(data, verbose=0)
            result["user_errors"].append(["none", ""])
        except Exception as error:  # Whatever fit raises is the result.
            result["user_errors"].append([type(error).__name__, str(error)])


def run_sync(strategy, result):
    import keras
    import numpy as np
    import tensorflow as tf

    def make(scope_strategy):
        keras.utils.set_random_seed(0)
        with scope_strategy.scope():
            model = keras.Sequential([keras.Input((3,), dtype="int32"),
                                      keras.layers.Embedding(64, 8), keras.layers.Flatten(),
                                      keras.layers.Dense(3)])
            model.compile(keras.optimizers.SGD(0.5),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
        return model

    rng = np.random.default_rng(0)
    x = rng.integers(0, 64, (72, 3)).astype("int32")  # 72 = 4 batches of 16 and one of 8
    y = (x[:, 0] % 3).astype("int32")
    model = make(strategy)
    local = make(tf.distribute.get_strategy())
    initial = model.get_weights()
    local.set_weights(initial)
    embedding = model.layers[0].embeddings.value
    result["embedding_shards"] = [[int(s.shape[0]), s.device] for s in embedding.variables]
    result["variable_devices"] = _devices(model)

    model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    local.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    result["iterations"] = int(model.optimizer.iterations.numpy())
    result["max_weight_difference"] = max(
        float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), local.get_weights()))
    result["moved"] = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), initial))

    # Every loss reduction, with sample or class weights, a masked loss and a regularizer,
    # on batches that split 8 + 7 and 6 + 6: one device on the combined batch.
    def make_case(scope_strategy, reduction, masked, batch_norm, optimizer=None, dense=False):
        keras.utils.set_random_seed(0)
        with scope_strategy.scope():
            if dense:  # Dense gradients only (see `recipes`).
                inputs = keras.Input((3,))
                hidden = keras.layers.Dense(8, activation="tanh")(inputs)
            else:
                inputs = keras.Input((3,), dtype="int32")
                hidden = keras.layers.Embedding(64, 8, mask_zero=masked)(inputs)
            if not masked and not dense:
                hidden = keras.layers.Flatten()(hidden)
            if batch_norm:
                hidden = keras.layers.BatchNormalization(momentum=0.8)(hidden)
            outputs = keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(0.01))(
                hidden)
            case = keras.Model(inputs, outputs)
            # Each part normalizes by its own batch moments (as each replica does), so
            # with BatchNorm only its statistics are compared: a learning rate of 0.
            case.compile(optimizer() if optimizer else
                         keras.optimizers.SGD(0.0 if batch_norm else 0.5),
                         keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction=reduction), metrics=["accuracy"])
        return case

    weights = rng.uniform(0.1, 2.0, len(x)).astype("float32")
    tokens = np.where(rng.uniform(size=x.shape) < 0.3, 0, x)  # 0 is masked
    cases = {"sum, sample weights": ("sum", False, dict(sample_weight=weights)),
             "batch norm": ("sum_over_batch_size", False, {}),
             "mean_with_sample_weight": ("mean_with_sample_weight", False,
                                         dict(sample_weight=weights)),
             "class weights": ("sum_over_batch_size", False,
                               dict(class_weight={0: 0.2, 1: 1.0, 2: 3.0})),
             "masked, sample weights": ("mean_with_sample_weight", True,
                                        dict(sample_weight=np.stack([weights] * 3, 1))),
             "mixed_float16": ("sum_over_batch_size", False, {})}
    # Recipes (the conformance suite's rows, tests/conformance): clipping and weight decay act
    # on the global gradient, the moving averages follow every step, as on one device. On a
    # model of dense layers: the parts' sparse gradients (an embedding's) are summed densely,
    # and Keras clips and updates a sparse gradient row by row, repeated rows apart (the
    # parameter-server guide's table says so).
    # (SGD's sparse update adds repeated rows as a dense one does: weight decay on the
    # partitioned embedding, which Keras' decay could not update.)
    recipes = {"AdamW, global_clipnorm": lambda: keras.optimizers.AdamW(
                   0.05, weight_decay=0.1, global_clipnorm=0.05),
               "clipnorm": lambda: keras.optimizers.SGD(0.5, clipnorm=0.05),
               "clipvalue": lambda: keras.optimizers.SGD(0.5, clipvalue=0.01),
               "use_ema": lambda: keras.optimizers.Adam(0.05, use_ema=True,
                                                        ema_overwrite_frequency=2),
               "weight decay, partitioned embedding": lambda: keras.optimizers.SGD(
                   0.5, weight_decay=0.05)}
    sparse_recipes = ("weight decay, partitioned embedding",)
    cases.update({name: ("sum_over_batch_size", False, dict(sample_weight=weights))
                  for name in recipes})
    result["cases"] = {}
    for name, (reduction, masked, weighting) in cases.items():
        inputs, targets = (tokens, np.stack([y] * 3, 1)) if masked else (x, y)
        if name in recipes and name not in sparse_recipes:
            inputs = (x / 64.0).astype("float32")
        trained = []
        # Compiled under mixed_float16, the optimizer is a LossScaleOptimizer.
        keras.mixed_precision.set_global_policy(
            "mixed_float16" if name == "mixed_float16" else "float32")
        for scope_strategy in (strategy, tf.distribute.get_strategy()):
            case = make_case(scope_strategy, reduction, masked, name == "batch norm",
                             recipes.get(name), name in recipes and name not in sparse_recipes)
            history = case.fit(inputs, targets, batch_size=15, epochs=2, shuffle=False,
                               verbose=0, **weighting)
            trained.append((case.get_weights(), history.history))
        keras.mixed_precision.set_global_policy("float32")
        (remote, remote_history), (local_weights, local_history) = trained
        result["cases"][name] = {
            "weight_difference": max(float(np.abs(a - b).max())
                                     for a, b in zip(remote, local_weights)),
            "history": remote_history, "local_history": local_history}

    # Compile again: the new optimizer (a learning rate of 0) and metric are the ones used;
    # steps_per_execution > 1 cannot be honoured in sync mode.
    with strategy.scope():
        model.compile(keras.optimizers.SGD(0.0),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=[keras.metrics.SparseCategoricalAccuracy(name="recompiled")])
    before = model.get_weights()
    history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    result["recompile_weight_change"] = max(
        float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), before))
    result["recompile_logs"] = sorted(history.history)
    with strategy.scope():
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=2)
    try:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        result["steps_per_execution_error"] = "ran"
    except ValueError as error:
        result["steps_per_execution_error"] = str(error)
    model.set_weights(before)

    # Round trip through a weights file, and loading on one device.
    path = os.path.join(FLAGS.out, "sync.weights.h5")
    trained = model.get_weights()
    model.save_weights(path)
    model.set_weights([np.zeros_like(w) for w in trained])
    model.load_weights(path)
    result["round_trip_difference"] = max(
        float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), trained))
    single = make(tf.distribute.get_strategy())
    single.load_weights(path)
    result["single_device_difference"] = float(
        np.abs(single.predict(x, verbose=0) - model.predict(x, verbose=0)).max())


def run_exact(strategy, result):
    import keras
    import numpy as np
    import tensorflow as tf

    keras.mixed_precision.set_global_policy("mixed_float16")

    def make(scope_strategy):
        keras.utils.set_random_seed(1)
        with scope_strategy.scope():
            model = keras.Sequential([
                keras.Input((4,)), keras.layers.Dense(8),
                keras.layers.BatchNormalization(momentum=0.99),
                keras.layers.Dense(1, activation="sigmoid", dtype="float32")])
            # A learning rate of 0: every step sees the same weights, so one device on the
            # same examples gives the same per-step metric updates in any order.
            model.compile(
                # Scaled gradients stay finite: the loss scale doubles every 50 steps.
                keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.0),
                                                    initial_scale=16.0,
                                                    dynamic_growth_steps=50),
                "binary_crossentropy",
                metrics=[keras.metrics.BinaryAccuracy(name="accuracy"),
                         keras.metrics.Precision(name="precision"),
                         keras.metrics.Recall(name="recall"), keras.metrics.AUC(name="auc")],
                steps_per_execution=5)  # Workers run steps back to back: updates collide.
        return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32") + 3.0
    y = rng.integers(0, 2, (32, 1)).astype("float32")
    train = tf.data.Dataset.from_tensors((x, y))
    model, local = make(strategy), make(tf.distribute.get_strategy())
    local.set_weights(model.get_weights())
    batch_logs = []
    logger = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batch_logs.append(dict(logs)))
    history = model.fit(train.repeat(), steps_per_epoch=100, epochs=2, verbose=0,
                        callbacks=[logger])
    local_history = local.fit(train.repeat(), steps_per_epoch=100, epochs=2, verbose=0)
    result["exact_history"] = history.history
    result["exact_local_history"] = local_history.history
    result["batch_logs"] = [{k: float(v) for k, v in logs.items()} for logs in batch_logs]
    bn = model.layers[1]
    local_bn = local.layers[1]
    result["moving_mean_difference"] = float(np.abs(
        bn.moving_mean.numpy() - local_bn.moving_mean.numpy()).max())
    result["moving_mean_moved"] = float(np.abs(bn.moving_mean.numpy()).max())
    result["moving_variance_difference"] = float(np.abs(
        bn.moving_variance.numpy() - local_bn.moving_variance.numpy()).max())
    for name, optimizer in (("ps", model.optimizer), ("local", local.optimizer)):
        result[f"{name}_loss_scale"] = float(optimizer.dynamic_scale.numpy())
        result[f"{name}_scale_steps"] = int(optimizer.step_counter.numpy())
        result[f"{name}_iterations"] = int(optimizer.iterations.numpy())

    # evaluate on distinct batches, which workers update the metrics with at once.
    test_x = rng.normal(size=(1024, 4)).astype("float32") + 3.0
    test_y = (test_x[:, :1] + rng.normal(size=(1024, 1)) > 3.0).astype("float32")
    local.set_weights(model.get_weights())
    result["exact_evaluate"] = model.evaluate(test_x, test_y, batch_size=16, verbose=0,
                                              return_dict=True)
    result["exact_local_evaluate"] = local.evaluate(test_x, test_y, batch_size=16, verbose=0,
                                                    return_dict=True)
    keras.mixed_precision.set_global_policy("float32")

    # Which batches an epoch reads: each worker its own shard, not all of them the same.
    result["seen_counts"] = _batches_seen(strategy, epochs=1)[0]

    # TerminateOnNaN sees the batch logs.
    with strategy.scope():
        nan_model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        nan_model.compile("sgd", "mse")
    nan_data = tf.data.Dataset.from_tensors(
        (np.full((4, 1), np.nan, "float32"), np.zeros((4, 1), "float32"))).repeat()
    nan_model.fit(nan_data, steps_per_epoch=200, epochs=1, verbose=0,
                  callbacks=[keras.callbacks.TerminateOnNaN()])
    result["nan_iterations"] = int(nan_model.optimizer.iterations.numpy())

    # Once a PipelineStrategy exists, keras.Model.train_step is tfpar's hook; a model that
    # does not override it still gets the step that differentiates sharded variables.
    from tfpar.keras import hooks

    hooks.install_train_step_hook()
    with strategy.scope():
        sharded = keras.Sequential([keras.Input((2,), dtype="int32"),
                                    keras.layers.Embedding(256, 8), keras.layers.Flatten(),
                                    keras.layers.Dense(1)])
        sharded.compile(keras.optimizers.SGD(0.1), "mse")
    before = sharded.get_weights()[0]
    sharded.fit(rng.integers(0, 256, (64, 2)).astype("int32"),
                rng.normal(size=(64, 1)).astype("float32"), batch_size=16, epochs=1, verbose=0)
    result["sharded_shards"] = len(sharded.layers[0].embeddings.value.variables)
    result["sharded_moved"] = float(np.abs(sharded.get_weights()[0] - before).max())
    result["sharded_iterations"] = int(sharded.optimizer.iterations.numpy())
    _user_errors(strategy, result)


def _batches_seen(strategy, epochs):
    """How often async fit read each of 20 batches (counted by a metric on the ps), in all
    and per epoch, and the steps the optimizer ran."""
    import keras
    import numpy as np
    import tensorflow as tf

    class Seen(keras.metrics.Metric):
        def __init__(self, batches):
            super().__init__(name="seen")
            self.counts = self.add_variable((batches,), "zeros", name="counts")
            self.batches = batches

        def update_state(self, y_true, y_pred, sample_weight=None):
            hits = tf.one_hot(tf.cast(y_true[:, 0], "int32"), self.batches)
            # One add on the ps: a read, then a write of the sum, lost one of two workers'
            # counts when their steps met (a full-suite run saw a batch counted twice in 3
            # epochs).
            self.counts.assign_add(tf.reduce_sum(hits, axis=0))

        def result(self):
            return tf.reduce_sum(self.counts)

    seen = Seen(20)
    with strategy.scope():
        counter = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        counter.compile(keras.optimizers.SGD(0.0), "mse", metrics=[seen], steps_per_execution=10)
    batch_ids = np.repeat(np.arange(20), 8).astype("float32")[:, None]
    per_epoch, steps = [], []
    for _ in range(epochs):  # fit resets the metric each epoch
        counter.fit(batch_ids, batch_ids, batch_size=8, shuffle=False, epochs=1, verbose=0)
        per_epoch.append([int(c) for c in seen.counts.numpy() / 8])
        # The optimizer's steps, and the steps the closures ran (counted apart, on the ps).
        steps.append([int(counter.optimizer.iterations.numpy()),
                      int(strategy.steps_run.numpy())])
    # Steps run, counted apart from the metric: a batch counted short with every step run
    # means a lost count, not a lost batch.
    return [sum(c) for c in zip(*per_epoch)], per_epoch, steps[-1][0], steps


def run_data_service(strategy, result):
    result["data_service"] = strategy.data_service
    (result["seen_counts"], result["seen_per_epoch"], result["steps_run"],
     result["steps_after_each_epoch"]) = _batches_seen(strategy, FLAGS.data_service_epochs)


def run_faults(strategy, result):
    import keras

    class StepCounter(keras.layers.Layer):
        """Counts training forward passes in a ps variable, apart from the optimizer."""

        def build(self, input_shape):
            self.count = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                         dtype="int64", name="count")

        def call(self, inputs, training=None):
            if training:
                self.count.assign_add(1)
            return inputs

    model = _spirals_model(strategy)
    with strategy.scope():
        counter = StepCounter()
        counted = keras.Sequential([keras.Input((2,)), counter,
                                    keras.layers.Dense(64, activation="relu"),
                                    keras.layers.Dense(3)])
        counted.compile(keras.optimizers.Adam(0.01),
                        keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    train, _ = _spirals("train", 32)

    print("FIT STARTED", flush=True)
    counted.fit(train.repeat(), steps_per_epoch=150, epochs=FLAGS.fault_epochs, verbose=2)
    print("FIT ENDED", flush=True)
    result["iterations_after_worker_failure"] = int(counted.optimizer.iterations.numpy())
    result["forward_passes_after_worker_failure"] = int(counter.count.numpy())
    result["steps_asked"] = 150 * FLAGS.fault_epochs
    _write(result)
    _fit_until_cluster_error(model, train, result, "PS FIT", "ps_error")


def run_no_workers(strategy, result):
    _fit_until_cluster_error(_spirals_model(strategy), _spirals("train", 32)[0], result,
                             "FIT", "error")


def _fit_until_cluster_error(model, train, result, label, key):
    """A fit that runs until the test breaks the cluster; records the ClusterError."""
    from tfpar.errors import ClusterError

    print(f"{label} STARTED", flush=True)
    start = time.monotonic()
    try:
        model.fit(train.repeat(), steps_per_epoch=100000, epochs=1, verbose=0)
    except ClusterError as error:
        result[key] = str(error)
        result[f"{key}_seconds"] = time.monotonic() - start
    print(f"{label} ENDED", flush=True)


def run_chiefless(result):
    """The coordinator is not in the cluster spec: it joins as chief, as in stock."""
    import numpy as np
    import tensorflow as tf

    import tfpar
    from api_walk import property_outcomes
    from tfpar.cluster.tf_config import parse_tf_config

    cluster = parse_tf_config(os.environ.pop("TF_CONFIG")).cluster
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({job: list(cluster[job]) for job in ("worker", "ps")}),
        rpc_layer="grpc")
    make = (tf.distribute.experimental.ParameterServerStrategy if FLAGS.stock
            else tfpar.ParameterServerStrategy)
    strategy = make(resolver)
    result["properties"] = property_outcomes(strategy)
    if not FLAGS.stock:
        model = _spirals_model(strategy)
        x = np.random.default_rng(0).normal(size=(64, 2)).astype("float32")
        model.fit(x, (x[:, 0] > 0).astype("int64"), batch_size=8, epochs=2, verbose=0)
        result["iterations"] = int(model.optimizer.iterations.numpy())
    return strategy


def _write(result):
    with open(os.path.join(FLAGS.out, "result.json"), "w") as f:
        json.dump(result, f)


def main(argv):
    import keras

    import tfpar

    keras.config.disable_traceback_filtering()
    sys.stdout.reconfigure(line_buffering=True)
    result = {}
    if FLAGS.scenario == "sync":
        import tensorflow as tf

        partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=256, max_shards=2)
        strategy = tfpar.ParameterServerStrategy(variable_partitioner=partitioner, mode="sync")
        run_sync(strategy, result)
    elif FLAGS.scenario == "exact":
        import tensorflow as tf

        # Only the Embedding of the last part (8 KiB) is split over the two ps.
        partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=4096, max_shards=2)
        strategy = tfpar.ParameterServerStrategy(variable_partitioner=partitioner)
        run_exact(strategy, result)
    elif FLAGS.scenario == "chiefless":
        strategy = run_chiefless(result)
    elif FLAGS.scenario == "no_workers":
        strategy = tfpar.ParameterServerStrategy(worker_timeout_seconds=10)
        run_no_workers(strategy, result)
    else:
        strategy = tfpar.ParameterServerStrategy()
        {"async": run_async, "faults": run_faults,
         "data_service": run_data_service}[FLAGS.scenario](strategy, result)
    result["strategy"] = repr(strategy)
    _write(result)
    print("DONE", flush=True)


if __name__ == "__main__":
    app.run(main)
