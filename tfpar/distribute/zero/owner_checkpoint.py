"""Who writes what when a sharded model is saved across workers, and when they are done.

Under ZeRO across workers (`DataParallelStrategy(shard=...)` with several TF_CONFIG
workers), `model.save_weights("<dir>/<name>.weights.json", max_shard_size=...)` on every
worker writes Keras' sharded weights format in parallel: each worker writes the state it
owns (its optimizer-state shards, under stage 3 its weights; under stages 1-2 each weight
is written by the owner of its state) to shard files of its own, the chief also what no
replica owns (step counters, non-trainable variables) and the weight map. Nothing is
gathered and nothing written twice. The Keras seam's store (`tfpar.keras.owner_saving`)
asks this plan; workers agree on the path and meet when every file is written through the
cluster's coordination service (no collective, nothing traced). A load reads only what
each worker keeps (`held_elsewhere`).
"""

import json

import tensorflow as tf

from tfpar.distribute.common import rendezvous
from tfpar.errors import ClusterError
from tfpar.keras import models


def _storage(value):
    """The tf.Variable holding a Keras variable's value; None for any other value."""
    storage = models.tf_variable(value)
    return storage if isinstance(storage, tf.Variable) else None


def held_elsewhere(owners):
    """Whether a Keras variable is a stand-in of a weight held on another worker (by
    `owners`, a ZeRO-3 strategy's `ShardOwners`), as a function; None when no weight is."""
    remote = owners.remote
    if not remote:
        return None
    return lambda value: id(_storage(value)) in remote


class OwnerCheckpoint:
    """What one worker of `strategy` writes: `me` of `writers` (workers, the chief 0),
    `writer_of(keras_variable)`, `local_value(keras_variable)`; `agree(path)` before and
    `done(path)` after writing, on every worker."""

    def __init__(self, strategy, peers, timeout_seconds, save_index):
        devices, first = strategy.extended._zero_local_replicas()
        self._per_worker = len(devices)
        self.me = first // self._per_worker
        self.writers = strategy.num_replicas_in_sync // self._per_worker
        self._owners = strategy._tfpar_shard_owners
        self._peers = peers
        self._timeout = timeout_seconds
        self._key = f"owner_checkpoint/{save_index}"

    def _owner(self, storage):
        """The replica owning `storage` (optimizer state: its variable's owner; a stage-3
        weight, a weight whose state has an owner), or None."""
        if storage is None:
            return None
        return self._owners.owner_if_known(self._owners.slots.get(id(storage), storage))

    def writer_of(self, value):
        """The worker that writes `value`: the worker of the replica owning it, else the
        chief (0)."""
        owner = self._owner(_storage(value))
        return 0 if owner is None else owner // self._per_worker

    def local_value(self, value):
        """This worker's own copy of `value` when it is state with an owner (read where it
        is, never fetched: under stage 3 Keras' conversion would fetch it from its
        owner); any other value as it is, for Keras to convert as it always does."""
        storage = _storage(value)
        if self._owner(storage) is None:
            return value
        return storage.read_value().numpy()

    def agree(self, path):
        """Raises ClusterError unless every worker saves to the same `path` (each writes
        its files beside the others'; the chief's map names them all)."""
        theirs = dict(rendezvous.exchange(
            self._peers, f"{self._key}/path", path, self._timeout,
            lambda peer: f"{peer} did not start saving the sharded weights within "
                         f"{self._timeout:g}s: every worker must call save_weights together."))
        differ = {peer: p for peer, p in theirs.items() if p != path}
        if differ:
            raise ClusterError(
                f"Sharded weights are written by every worker into one checkpoint, but the "
                f"workers gave different paths ({self._peers.me}: {path}; "
                f"{', '.join(f'{k}: {v}' for k, v in sorted(differ.items()))}). Pass the "
                f"same path on every worker, on a filesystem they all write to: each "
                f"writes only the files of the state it owns.")

    def done(self, files):
        """Waits until every worker has written its files (`files`: this worker's file
        names); returns every worker's, by task name."""
        written = dict(rendezvous.exchange(
            self._peers, f"{self._key}/done", json.dumps(files), self._timeout,
            lambda peer: f"{peer} did not finish writing its shard of the weights within "
                         f"{self._timeout:g}s: the checkpoint is incomplete (its weight "
                         f"map was not written)."))
        return {self._peers.me: files, **{k: json.loads(v) for k, v in written.items()}}
