"""One-device models of the semantics a strategy legitimately has where it is not the
one-device result ("documented" cells): the test trains the emulation on one device and
compares the strategy's run with it, so a documented cell still checks exact numbers.

- Batch statistics per group of rows (BatchNormalization per replica or per micro-batch):
  `GroupBatchNormalization` normalizes each group of the batch with that group's moments and
  updates the moving statistics with the mean of the listed groups' moments, update after
  update.
- Dropout masks drawn per replica or per micro-batch: `ChunkDropout`.
- PipeDream-2BW's delayed updates (schedule "2bw"): `DelayedUpdates`, a callback.
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
    before the previous update and applied to the current ones.

    Before a step the model takes the older weights; after it, the optimizer's change to them
    is moved onto the current weights (Adam's and SGD's updates do not depend on the weights'
    values, so this is their update of the current weights). The older weights count while
    the optimizer's `iterations` is the value they were saved at (else: the current ones)."""

    def __init__(self):
        super().__init__()
        self._older, self._saved_at = None, None

    def on_train_batch_begin(self, batch, logs=None):
        weights = self.model.trainable_weights
        self._current = [w.numpy() for w in weights]
        valid = self._saved_at == int(self.model.optimizer.iterations.numpy())
        self._used = self._older if valid else self._current
        for w, value in zip(weights, self._used):
            w.assign(value)

    def on_train_batch_end(self, batch, logs=None):
        for w, used, current in zip(self.model.trainable_weights, self._used, self._current):
            w.assign(current + (w.numpy() - used))
        self._older = self._current
        self._saved_at = int(self.model.optimizer.iterations.numpy())


def emulated(feature, sid):
    """The one-device run of the emulation of documented cell (feature, sid), and the parts of
    a Result it compares."""
    if sid == "2bw":
        return _delayed(feature), ("weights", "history", "evaluate", "predict")
    parts = EMULATIONS[feature][1]
    return _emulated(feature, harness.REPLICAS[sid], harness.MICRO_BATCHES[sid]), parts


@functools.lru_cache(maxsize=None)
def _delayed(feature):
    spec = harness.FEATURES[feature]
    callbacks = {"callbacks": [DelayedUpdates()]}
    return harness.run(None, dataclasses.replace(spec, fit_kwargs={**spec.fit_kwargs,
                                                                   **callbacks}))


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
}
