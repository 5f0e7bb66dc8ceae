"""Keras' look-ahead iterator over arrays, made when it is first read (tfpar's strategies).

At the end of each epoch Keras' epoch iterator makes the next epoch's iterator at once
(`EpochIterator._enumerate_iterator`); with `steps_per_epoch=None` (the default) the next
epoch makes a fresh one instead, and evaluate and predict have no next epoch, so that
iterator is dropped unread. Under a strategy it is a distributed iterator: TensorFlow's
MultiDeviceIterator traces 6 functions per device to make one (0.22 s on 2 CPUs, more on 4;
measured): 4 of the 8 that a fit of 2 epochs, evaluate and predict made on 2 replicas.

For data Keras batches itself from arrays (its ArrayDataAdapter: a dataset that nobody else
holds and that this epoch iterator alone reads), that iterator is made when an epoch first
reads it, so one that nobody reads is never made. A dataset of the user's own keeps Keras'
timing: making an iterator of a shuffled dataset takes a seed from the dataset's seed
generator, which a later `fit` on the same dataset would see.
"""

from tfpar.contract import hooks_of
from tfpar.keras import internals


class _Pending:
    """An iterator of `dataset` not made yet: `made()` makes it (once)."""

    def __init__(self, dataset):
        self._dataset = dataset
        self._iterator = None

    def made(self):
        if self._iterator is None:
            self._iterator = iter(self._dataset)
        return self._iterator

    # (An iterator, as `iter()` requires; a step function is given `made()` instead.)
    def __iter__(self):
        return self

    def __next__(self):
        return next(self.made())


class _MadeWhenRead:
    """`iter()` of it gives a `_Pending` in place of a distributed iterator."""

    def __init__(self, dataset):
        self._dataset = dataset

    def __iter__(self):
        return _Pending(self._dataset)


def _made_when_read(keras_get_iterator):
    """TFEpochIterator._get_iterator: arrays under a tfpar strategy, made when read."""
    array_adapter = internals.symbol(
        "keras.src.trainers.data_adapters.array_data_adapter.ArrayDataAdapter")

    def _get_iterator(self):
        dataset = keras_get_iterator(self)
        strategy = internals.attr(self, "_distribute_strategy")
        if (hooks_of(strategy)._tfpar_mirrored
                and isinstance(self.data_adapter, array_adapter)):
            return _MadeWhenRead(dataset)
        return dataset

    return _get_iterator


def _made_before_yielded(keras_enumerate_iterator):
    """EpochIterator._enumerate_iterator on TensorFlow: what it yields is a made iterator
    (the trainer's step function takes a distributed iterator, nothing else)."""

    def _enumerate_iterator(self):
        for *head, iterator in keras_enumerate_iterator(self):
            if isinstance(iterator, _Pending):
                made = iterator.made()
                # Keras yields its current iterator again each step of the epoch.
                if internals.attr(self, "_current_iterator") is iterator:
                    internals.set_attr(self, "_current_iterator", made)
                iterator = made
            yield (*head, iterator)

    return _enumerate_iterator


def patches():
    """(owner, attribute, wrap) for `hooks._wrap_once`."""
    epoch_iterator = internals.symbol("keras.src.backend.tensorflow.trainer.TFEpochIterator")
    return [(epoch_iterator, "_get_iterator", _made_when_read),
            (epoch_iterator, "_enumerate_iterator", _made_before_yielded)]
