"""One-device models of the semantics a strategy legitimately has where it is not the
one-device result ("documented" cells): the test trains the emulation on one device and
compares the strategy's run with it, so a documented cell still checks exact numbers.

- Batch statistics per group of rows (BatchNormalization per replica or per micro-batch):
  `GroupBatchNormalization` normalizes each group of the batch with that group's moments and
  updates the moving statistics with the mean of the listed groups' moments, update after
  update.
- Dropout masks drawn per replica or per micro-batch: `ChunkDropout`.
- PipeDream-2BW's delayed updates (schedule "2bw"): `DelayedUpdates`, a callback.
- An optimizer built before the first step (as every strategy builds it):
  `built_first_emulation`.
- Periodic averaging (`sync_every`, column "dp2_local"): `local_sgd_emulation`, N models
  each trained on its replica's part of every batch, their weights averaged every n steps.
"""

import dataclasses
import functools

import keras
import numpy as np

import harness


@keras.saving.register_keras_serializable("tfpar_conformance")
class GroupBatchNormalization(keras.layers.BatchNormalization):
    """BatchNormalization whose training batch is normalized per group of rows.

    groups: lists of row indices that partition a batch; updates: one list of group indices per
    update of the moving statistics, in order; each update uses the mean of those groups'
    moments (a mean of per-group means and of per-group variances).
    """

    def __init__(self, groups, updates, **kwargs):
        super().__init__(**kwargs)
        self.groups = [list(g) for g in groups]
        self.updates = [list(u) for u in updates]

    def call(self, inputs, training=None, mask=None):
        if not training:
            return super().call(inputs, training=False, mask=mask)
        ops = keras.ops
        order = [i for g in self.groups for i in g]
        inverse = np.argsort(order)
        outputs, moments = [], []
        for group in self.groups:
            rows = ops.take(inputs, np.asarray(group, "int32"), axis=0)
            mean, variance = ops.moments(rows, axes=[0])
            moments.append((mean, variance))
            outputs.append((rows - mean) * ops.rsqrt(variance + self.epsilon) * self.gamma
                           + self.beta)
        for update in self.updates:
            mean = sum(moments[i][0] for i in update) / len(update)
            variance = sum(moments[i][1] for i in update) / len(update)
            self.moving_mean.assign(self.moving_mean * self.momentum
                                    + mean * (1.0 - self.momentum))
            self.moving_variance.assign(self.moving_variance * self.momentum
                                        + variance * (1.0 - self.momentum))
        return ops.take(ops.concatenate(outputs, axis=0), inverse.astype("int32"), axis=0)

    def get_config(self):
        return {**super().get_config(), "groups": self.groups, "updates": self.updates}


def batchnorm_groups(replicas, micro, batch=harness.BATCH, synchronized=False):
    """Row groups and moving-statistics updates of BatchNorm with `replicas` replicas of
    `micro` micro-batches each.

    Groups are replica-major: (replica r, micro-batch j) is group r x M + j. Without
    synchronization each group is normalized with its own statistics, and each micro-batch index
    makes one update with the mean over replicas of that micro-batch's statistics (data
    parallel: one update per step, the replicas' mean). Synchronized: micro-batch j of every
    replica forms one group (data parallel: the whole batch).
    """
    per_replica = batch // replicas
    size = per_replica // micro
    if synchronized:
        groups = [[r * per_replica + j * size + i for r in range(replicas) for i in range(size)]
                  for j in range(micro)]
        return groups, [[j] for j in range(micro)]
    groups = [list(range(i * size, (i + 1) * size)) for i in range(replicas * micro)]
    return groups, [[r * micro + j for r in range(replicas)] for j in range(micro)]


def batchnorm_emulation(feature, replicas, micro):
    synchronized = feature.name == "batchnorm_synchronized"
    groups, updates = batchnorm_groups(replicas, micro, synchronized=synchronized)

    def build():
        model = feature.build()
        layers = [GroupBatchNormalization(groups, updates, name=l.name)
                  if isinstance(l, keras.layers.BatchNormalization) else l for l in model.layers]
        return keras.Sequential([keras.Input(model.input_shape[1:])] + layers)

    return dataclasses.replace(feature, build=build)


@keras.saving.register_keras_serializable("tfpar_conformance")
class ChunkDropout(keras.layers.Dropout):
    """Dropout with one mask per chunk of rows, the batch being `replicas` x `micro` chunks
    (replica-major): each step draws `micro` seeds in turn, and chunk (replica r, micro-batch j)
    uses seed j, so every replica repeats the masks of replica 0."""

    def __init__(self, replicas, micro, **kwargs):
        super().__init__(**kwargs)
        self.replicas, self.micro = replicas, micro

    def call(self, inputs, training=False):
        import tensorflow as tf

        if not training or self.rate == 0:
            return inputs
        pieces = tf.split(inputs, self.replicas * self.micro, axis=0)
        seeds = [self.seed_generator.next() for _ in range(self.micro)]
        return tf.concat([tf.nn.experimental.stateless_dropout(p, rate=self.rate,
                                                               seed=seeds[i % self.micro])
                          for i, p in enumerate(pieces)], axis=0)

    def get_config(self):
        return {**super().get_config(), "replicas": self.replicas, "micro": self.micro}


def dropout_emulation(feature, replicas, micro):
    def build():
        model = feature.build()
        layers = [ChunkDropout(replicas, micro, rate=l.rate, seed=l.seed, name=l.name)
                  if isinstance(l, keras.layers.Dropout) else l for l in model.layers]
        return keras.Sequential([keras.Input(model.input_shape[1:])] + layers)

    return dataclasses.replace(feature, build=build)


class DelayedUpdates(keras.callbacks.Callback):
    """PipeDream-2BW's rule on one device: each step's gradient is computed on the weights
    before the previous update and applied to the current ones (in a fit that runs eagerly:
    `_delayed` compiles so).

    Before a step the model takes the older weights; when the step's optimizer applies its
    gradient, the current weights are put back first, so the update reads and changes the
    current ones (weight decay, LAMB's trust ratio, Adafactor's relative step, moving averages
    too). The older weights count while the optimizer's `iterations` is the value they were
    saved at (else: the current ones: after a skipped or accumulated step)."""

    def __init__(self):
        super().__init__()
        self._older, self._saved_at = None, None

    def on_train_begin(self, logs=None):
        optimizer = self.model.optimizer
        if getattr(optimizer, "_delayed_by", None) is not self:
            keras_apply = optimizer.apply

            def apply(gradients, variables=None):
                for w, value in zip(self.model.trainable_weights, self._current):
                    w.assign(value)
                return keras_apply(gradients, variables)

            optimizer.apply, optimizer._delayed_by = apply, self

    def on_train_batch_begin(self, batch, logs=None):
        weights = self.model.trainable_weights
        self._current = [w.numpy() for w in weights]
        valid = self._saved_at == int(self.model.optimizer.iterations.numpy())
        for w, value in zip(weights, self._older if valid else self._current):
            w.assign(value)

    def on_train_batch_end(self, batch, logs=None):
        self._older = self._current
        self._saved_at = int(self.model.optimizer.iterations.numpy())


class OptimizerBuiltFirst(keras.callbacks.Callback):
    """Builds the model's optimizer before fit's first step (if it is not built yet)."""

    def on_train_begin(self, logs=None):
        if not self.model.optimizer.built:
            self.model.optimizer.build(self.model.trainable_variables)


def built_first_emulation(feature, replicas, micro):
    """`feature` on one device with its optimizer built before the first step, as
    tf.distribute strategies and keras.distribution build it. State an optimizer's `build`
    sets then is set once: on one device Keras builds it while the first step is traced and
    records that assignment into the step, which repeats it every step (ScheduleFreeAdamW's
    momentum, set to a copy of the weights: measured 0.69 off after one epoch)."""
    callbacks = {"callbacks": [OptimizerBuiltFirst()]}
    return dataclasses.replace(feature, fit_kwargs={**feature.fit_kwargs, **callbacks})


def _metric_counts(model):
    """{name: count} of `model`'s compiled mean metrics (what they counted since reset)."""
    found = {}
    for metric in model.metrics:
        for inner in [metric] + list(getattr(metric, "metrics", [])):
            if inner.name != "loss" and hasattr(inner, "count"):
                found[inner.name] = float(inner.count.numpy())
    return found


def _skipped_on_all(copies, before):
    """A step a LossScaleOptimizer skipped on one copy (its scale fell) is skipped on all:
    the others take back their weights and state from `before` (per copy: the weights, the
    optimizer's variables, then the scale) and the skipping copy's loss-scale state (the
    replicas decide together, as one device skips a batch part of which overflowed)."""
    if not isinstance(copies[0].optimizer, keras.optimizers.LossScaleOptimizer):
        return
    fell = [float(c.optimizer.dynamic_scale.numpy()) < before[i][-1]
            for i, c in enumerate(copies)]
    if not any(fell):
        return
    skipper = copies[fell.index(True)].optimizer
    for i, c in enumerate(copies):
        if fell[i]:
            continue
        for variable, value in zip(c.weights + c.optimizer.variables, before[i]):
            variable.assign(value)
        for mine, theirs in ((c.optimizer.dynamic_scale, skipper.dynamic_scale),
                             (c.optimizer.step_counter, skipper.step_counter)):
            mine.assign(theirs)


def local_sgd_emulation(feature, replicas, every):
    """`feature` trained as `sync_every=every` trains it on `replicas` replicas, on one
    device: `replicas` copies of the model (the same initial weights, each its own optimizer)
    each take replica r's part of every global batch (rows r x B/N to (r + 1) x B/N) with
    `train_on_batch`; after every `every` steps, and at the end, each copy's trainable
    weights are set to the copies' mean (with `use_ema`, at the end each copy first takes
    its own moving averages, as the end of fit does). A masked loss's part is N x that
    part's share of the global batch's unmasked steps (weighted so); a loss-scale overflow on one copy
    skips the step on all (`_skipped_on_all`). History: per epoch, the mean of the
    copies' batch logs (metrics weighted by what they counted: the unmasked steps)."""

    def loop(model, strategy, feature, data):
        copies = [model]
        for _ in range(replicas - 1):
            copy = feature.build()
            copy.compile(**feature.compile())
            copy.set_weights(model.get_weights())
            copies.append(copy)
        for c in copies:  # (Built now, so that a step's state can be put back.)
            c.optimizer.build(c.trainable_variables)
        weights = data.sample_weight if data.fit_sample_weight is None \
            else data.fit_sample_weight
        batch, count = feature.batch_size, len(data.y)
        part = batch // replicas
        masked = feature.name.startswith("masked_")
        assert batch % replicas == 0 and count % batch == 0, "equal parts only"

        def average():
            means = [np.mean([c.trainable_weights[i].numpy() for c in copies], axis=0)
                     for i in range(len(model.trainable_weights))]
            for c in copies:
                for variable, mean in zip(c.trainable_weights, means):
                    variable.assign(mean)

        history, steps = {}, 0
        for _ in range(feature.epochs):
            logs, counts = [], []
            for start in range(0, count, batch):
                before = [[v.numpy() for v in c.weights + c.optimizer.variables]
                          + [float(getattr(c.optimizer, "dynamic_scale", np.nan))]
                          for c in copies]
                for r, c in enumerate(copies):
                    rows = slice(start + r * part, start + (r + 1) * part)
                    weight = None if weights is None else weights[rows]
                    if masked:  # N x its part of the global masked mean: N x count / total.
                        tokens = np.count_nonzero(data.x[start:start + batch])
                        factor = replicas * np.count_nonzero(data.x[rows]) / tokens
                        weight = np.full(data.y[rows].shape, factor, "float32")
                    c.reset_metrics()  # (Keras before 3.11 does not in train_on_batch.)
                    logs.append(c.train_on_batch(data.x[rows], data.y[rows],
                                                 sample_weight=weight, return_dict=True))
                    # What each metric counted, to weight it. (`metrics=` take no sample
                    # weights: the factor above is the loss's alone.)
                    counts.append(_metric_counts(c))
                _skipped_on_all(copies, before)
                steps += 1
                if steps % every == 0:
                    average()
            for key in logs[0]:
                # (A metric's mean over what its copies counted; the loss's over batches.)
                shares = [c.get(key, 1.0) if key != "loss" else 1.0 for c in counts]
                history.setdefault(key, []).append(
                    np.average([log[key] for log in logs], weights=shares))
        for c in copies:  # (What fit does at its end: each copy takes its own averages.)
            if c.optimizer.use_ema:
                c.optimizer.finalize_variable_values(c.trainable_variables)
        average()
        return history

    return dataclasses.replace(feature, loop=loop)


def emulated(feature, sid):
    """The one-device run of the emulation of documented cell (feature, sid), and the parts of
    a Result it compares."""
    if sid == "2bw":
        return _delayed(feature), ("weights", "history", "evaluate", "predict")
    if sid == "dp2_local":
        return _local_sgd(feature), ("weights", "history", "evaluate", "predict")
    parts = EMULATIONS[feature][1]
    return _emulated(feature, harness.REPLICAS[sid], harness.MICRO_BATCHES[sid]), parts


@functools.lru_cache(maxsize=None)
def _delayed(feature):
    spec = harness.FEATURES[feature]
    callbacks = {"callbacks": [DelayedUpdates()]}

    def eagerly(compile_arguments):
        return None if compile_arguments is None else (
            lambda: {**compile_arguments(), "run_eagerly": True})

    return harness.run(None, dataclasses.replace(
        spec, fit_kwargs={**spec.fit_kwargs, **callbacks}, compile=eagerly(spec.compile),
        recompile=eagerly(spec.recompile)))


@functools.lru_cache(maxsize=None)
def _local_sgd(feature):
    spec = harness.FEATURES[feature]
    return harness.run(None, local_sgd_emulation(spec, harness.REPLICAS["dp2_local"], 2))


@functools.lru_cache(maxsize=None)
def _emulated(feature, replicas, micro):
    emulate, _ = EMULATIONS[feature]
    return harness.run(None, emulate(harness.FEATURES[feature], replicas, micro))


# A documented cell's check: which emulation (feature, replicas, micro-batches per replica ->
# Feature), and which parts of the Result it compares.
EMULATIONS = {
    "batchnorm": (batchnorm_emulation, ("weights", "history", "evaluate", "predict")),
    "batchnorm_synchronized": (batchnorm_emulation, ("weights", "history", "evaluate", "predict")),
    "dropout_seeded": (dropout_emulation, ("weights", "history", "evaluate", "predict")),
    "jit_compile_batchnorm": (batchnorm_emulation, ("weights", "history", "evaluate",
                                                    "predict")),
    "jit_compile_dropout": (dropout_emulation, ("weights", "history", "evaluate", "predict")),
    "opt_ScheduleFreeAdamW": (built_first_emulation, ("weights", "history")),
}
