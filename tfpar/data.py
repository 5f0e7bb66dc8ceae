"""Input data: the built-in spirals dataset, tfds loading, and per-replica sharding.

    import tfpar
    strategy = tfpar.DataParallelStrategy()
    source = tfpar.data.load("spirals")
    train = tfpar.data.distribute(strategy, source.dataset, global_batch_size=64)
"""

import dataclasses
import math

import numpy as np

from tfpar.plan.batching import check_global_batch

BUILTIN = "spirals"


@dataclasses.dataclass(frozen=True)
class Source:
    """A loaded split: unbatched (features, label) examples and what a model needs to know."""

    dataset: object  # tf.data.Dataset of unbatched (features, label)
    num_classes: int
    input_shape: tuple
    num_examples: int


def spirals(num_examples=6000, num_classes=3, noise=0.04, turns=1.0, seed=0):
    """The classic interleaved-spirals classification problem, generated locally.

    Each class is one arm of a spiral in the plane; points are spread along the
    arm with Gaussian noise. Needs a non-linear model: a linear one stays near
    1/num_classes accuracy.

    Returns:
      (x, y): float32 [num_examples, 2] and int32 [num_examples], classes balanced
      and interleaved (example i has class i % num_classes).
    """
    if num_classes < 2 or num_examples < num_classes:
        raise ValueError(
            f"spirals needs num_classes >= 2 and num_examples >= num_classes. "
            f"Received: num_examples={num_examples}, num_classes={num_classes}")
    rng = np.random.default_rng(seed)
    y = np.arange(num_examples) % num_classes
    radius = rng.uniform(0.05, 1.0, num_examples)
    angle = (2 * math.pi * y / num_classes) + radius * turns * 2 * math.pi
    x = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1)
    x += rng.normal(0.0, noise, x.shape)
    return x.astype(np.float32), y.astype(np.int32)


def load(name=BUILTIN, split="train", data_dir=None, num_examples=6000, seed=0):
    """Loads a dataset split as a `Source`.

    "spirals" is generated in memory ("train" and "test" use different seeds).
    Any other name is a tfds dataset read from `data_dir` with tfds' own
    reader; it must already be prepared there (this loader never downloads).
    """
    import tensorflow as tf

    if name == BUILTIN:
        split_seed = {"train": seed, "test": seed + 1}.get(split)
        if split_seed is None:
            raise ValueError(f"The {BUILTIN} dataset has splits 'train' and 'test'. Received: {split!r}")
        x, y = spirals(num_examples=num_examples, seed=split_seed)
        input_shape, num_classes = describe(BUILTIN)
        return Source(tf.data.Dataset.from_tensor_slices((x, y)), num_classes, input_shape,
                      len(x))
    return _load_tfds(name, split, data_dir)


def describe(name=BUILTIN, data_dir=None):
    """`(input_shape, num_classes)` of a dataset, read without loading its examples (for
    planning memory before TensorFlow places anything)."""
    if name == BUILTIN:
        return (2,), 3
    return _shape_and_classes(_tfds_builder(name, data_dir).info)


def _shape_and_classes(info):
    features, label = info.supervised_keys
    return tuple(info.features[features].shape), int(info.features[label].num_classes)


def _tfds_builder(name, data_dir):
    import tensorflow_datasets as tfds

    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as error:  # tfds raises several types for unknown names
        raise ValueError(
            f"Unknown dataset {name!r}: it is neither {BUILTIN!r} nor a tfds dataset "
            f"({error}).") from error
    if not builder.is_prepared():
        raise ValueError(
            f"The tfds dataset {name!r} is not prepared in data_dir={data_dir!r}. tfpar "
            f"does not download: prepare it there first (`tfds build {name} "
            f"--data_dir=DIR` on a machine with network) or use --dataset={BUILTIN}.")
    return builder


def _load_tfds(name, split, data_dir):
    builder = _tfds_builder(name, data_dir)
    info = builder.info
    dataset = builder.as_dataset(split=split, as_supervised=True, shuffle_files=False)
    input_shape, num_classes = _shape_and_classes(info)
    return Source(dataset=dataset, num_classes=num_classes, input_shape=input_shape,
                  num_examples=int(info.splits[split].num_examples))


def dataset_fn(dataset, global_batch_size, shuffle_buffer=0, seed=0, drop_remainder=False):
    """Returns `fn(input_context)` for `strategy.distribute_datasets_from_function`.

    Each input pipeline (one per worker) reads its own shard of `dataset` and
    batches it to the per-replica batch size, so replicas together see batches
    of `global_batch_size`.
    """

    def fn(input_context):
        check_global_batch(global_batch_size, input_context.num_replicas_in_sync)
        per_replica = input_context.get_per_replica_batch_size(global_batch_size)
        shard = dataset
        if input_context.num_input_pipelines > 1:
            shard = shard.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        if shuffle_buffer:
            shard = shard.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
        return shard.batch(per_replica, drop_remainder=drop_remainder).prefetch(2)

    return fn


def distribute(strategy, dataset, global_batch_size, shuffle_buffer=0, seed=0,
               drop_remainder=False):
    """Shards and batches unbatched examples for `strategy`; usable in `model.fit`."""
    return strategy.distribute_datasets_from_function(
        dataset_fn(dataset, global_batch_size, shuffle_buffer, seed, drop_remainder))


def dataset_from_function(dataset_fn, input_context):
    """`dataset_fn(input_context)`, which must be a `tf.data.Dataset` (a clear error if not)."""
    import tensorflow as tf

    dataset = dataset_fn(input_context)
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"A dataset function must return a tf.data.Dataset. "
                        f"Received: {type(dataset).__name__}")
    return dataset
