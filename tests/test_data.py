"""tfpar.data: the built-in dataset, tfds loading from disk, sharding per replica and worker."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

import tfpar
from tfpar.errors import BatchSizeError


def test_spirals_balanced_and_deterministic():
    x, y = tfpar.data.spirals(num_examples=300, num_classes=3, seed=4)
    assert x.shape == (300, 2) and x.dtype == np.float32
    assert np.bincount(y).tolist() == [100, 100, 100]
    np.testing.assert_array_equal(x, tfpar.data.spirals(num_examples=300, num_classes=3, seed=4)[0])
    assert not np.array_equal(x, tfpar.data.spirals(num_examples=300, num_classes=3, seed=5)[0])


def test_spirals_need_a_nonlinear_model():
    # A linear classifier (least squares on one-hot labels) stays far from 90%.
    x, y = tfpar.data.spirals(num_examples=3000)
    features = np.hstack([x, np.ones((len(x), 1))])
    weights, *_ = np.linalg.lstsq(features, np.eye(3)[y], rcond=None)
    assert (np.argmax(features @ weights, 1) == y).mean() < 0.7


def test_load_builtin():
    source = tfpar.data.load("spirals", "test", num_examples=30)
    assert (source.num_classes, source.input_shape, source.num_examples) == (3, (2,), 30)
    with pytest.raises(ValueError, match="splits 'train' and 'test'"):
        tfpar.data.load("spirals", "validation")


class TinyDigits(tfds.core.GeneratorBasedBuilder):
    """A tfds dataset the tests build on disk: 4x4 uint8 images, 5 classes."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(4, 4, 1)),
                "label": tfds.features.ClassLabel(num_classes=5),
            }),
            supervised_keys=("image", "label"))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(40, 0), "test": self._generate_examples(10, 1)}

    def _generate_examples(self, n, seed):
        rng = np.random.default_rng(seed)
        for i in range(n):
            image = rng.integers(0, 255, (4, 4, 1), dtype=np.uint8)
            image[0, 0, 0] = i  # makes every example identifiable
            yield i, {"image": image, "label": i % 5}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("tfds")
    TinyDigits(data_dir=str(data_dir)).download_and_prepare()
    return str(data_dir)


def test_load_tfds_from_data_dir(tiny_dir):
    source = tfpar.data.load("tiny_digits", "train", data_dir=tiny_dir)
    assert (source.num_classes, source.input_shape, source.num_examples) == (5, (4, 4, 1), 40)
    examples = list(source.dataset.as_numpy_iterator())
    assert len(examples) == 40
    assert sorted(int(image[0, 0, 0]) for image, _ in examples) == list(range(40))
    assert all(label == image[0, 0, 0] % 5 for image, label in examples)


def test_unprepared_tfds_dataset_says_what_to_do(tmp_path):
    with pytest.raises(ValueError, match=r"'tiny_digits' is not prepared in data_dir=.*tfds build"):
        tfpar.data.load("tiny_digits", data_dir=str(tmp_path))


def test_unknown_dataset():
    with pytest.raises(ValueError, match="Unknown dataset 'no_such_dataset_xyz'"):
        tfpar.data.load("no_such_dataset_xyz", data_dir="/nonexistent")


def test_dataset_fn_shards_per_worker_with_global_batch():
    examples = tf.data.Dataset.range(48)
    fn = tfpar.data.dataset_fn(examples, global_batch_size=12)
    seen = []
    # 2 workers (input pipelines), 4 replicas in all: 3 examples per replica batch.
    for worker in range(2):
        context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=worker,
                                             num_replicas_in_sync=4)
        batches = list(fn(context).as_numpy_iterator())
        assert all(len(b) == 3 for b in batches)
        seen.append(np.concatenate(batches))
    assert set(seen[0]).isdisjoint(seen[1])
    assert sorted(np.concatenate(seen).tolist()) == list(range(48))


def test_dataset_fn_rejects_small_global_batch():
    fn = tfpar.data.dataset_fn(tf.data.Dataset.range(8), global_batch_size=2)
    with pytest.raises(BatchSizeError, match=r"\(2\) is smaller than the number of replicas \(4\)"):
        fn(tf.distribute.InputContext(1, 0, 4))


def test_distribute_splits_global_batch_over_replicas():
    strategy = tfpar.DataParallelStrategy(["/cpu:0", "/cpu:1"])
    dataset = tfpar.data.distribute(strategy, tf.data.Dataset.range(8), global_batch_size=4)
    first = next(iter(dataset))
    parts = [t.numpy().tolist() for t in strategy.experimental_local_results(first)]
    assert [len(p) for p in parts] == [2, 2]
    assert sorted(parts[0] + parts[1]) == [0, 1, 2, 3]
