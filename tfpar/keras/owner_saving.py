"""Keras' sharded weights format written by the owners of the state, in parallel.

Under ZeRO across workers, `model.save_weights("<dir>/<name>.weights.json",
max_shard_size=...)`, called on every worker with the same path, writes Keras' own sharded
format: each worker writes the variables it owns (the strategy's `_tfpar_owner_checkpoint`
plan says which) into shard files of its own (`<name>_<n>.weights.h5`, n modulo the number
of workers: the worker), and
the chief writes the weight map (`<name>.weights.json`) once every worker's files are
written: the map's presence means the checkpoint is whole. Nothing is gathered, nothing
written twice. `model.load_weights` reads it, and so does plain Keras on one device
(Keras >= 3.11, which reads a layer's variables from several files). Loaded under ZeRO
across workers (any worker count or stage wrote it), each worker reads only the values it
keeps: a weight held by another worker's replica (stage 3) is not read from disk
(`read_by_owners`).

    >>> # On every worker, the same path, on a filesystem every worker writes to:
    >>> # model.save_weights("/shared/run/model.weights.json", max_shard_size=2)  # GB
"""

import contextlib
import functools
import json
import math
import os
import pathlib

from tfpar.contract import hooks_of
from tfpar.errors import ClusterError
from tfpar.keras import internals

# The first Keras release whose sharded reader takes a variable group from several files
# (a weight map entry that lists files).
READS_SPLIT_GROUPS = "3.11.0"
_SUFFIX = ".weights.json"


def _plan(model, max_shard_size):
    if max_shard_size is None:
        return None
    # (A stock strategy's hooks are the contract's defaults: no plan.)
    hook = hooks_of(getattr(model, "distribute_strategy", None))._tfpar_owner_checkpoint
    return hook() if hook is not None else None


def _nbytes(value):
    import tensorflow as tf

    return math.prod(int(d) for d in value.shape) * tf.as_dtype(value.dtype).size


class _ShardFiles:
    """The shard files of writer `writer` of `writers`, filled in order up to `max_bytes`
    each (a value larger than that gets a file of its own); its k-th file is
    `<stem>_<k * writers + writer>.weights.h5`, so that the first (Keras' reader opens
    `<stem>_00000` first) is the chief's. Every worker counts every writer's files alike,
    from the values' shapes: the chief's map names files others wrote."""

    def __init__(self, stem, writer, writers, max_bytes):
        self._stem, self._writer, self._writers = stem, writer, writers
        self._max, self._k, self._used = max_bytes, 0, 0

    def place(self, size):
        if self._used and self._used + size > self._max:
            self._k, self._used = self._k + 1, 0
        self._used += size
        return self.name(self._k)

    def name(self, k):
        return f"{self._stem}_{k * self._writers + self._writer:05}.weights.h5"


@functools.lru_cache(maxsize=None)
def _store_class():
    """A subclass of Keras' sharded store, only so that Keras' walk of a model's state
    (`_save_state`, which checks the store's class) takes it; it keeps none of its parent's
    state and writes each file through Keras' `H5IOStore`."""
    sharded = internals.symbol("keras.src.saving.saving_lib.ShardedH5IOStore")
    h5_store = internals.symbol("keras.src.saving.saving_lib.H5IOStore")

    @internals.overrides
    class OwnersStore(sharded):
        def __init__(self, path, max_bytes, plan):  # noqa: super().__init__ opens a file.
            self.path = pathlib.Path(path)
            self._plan = plan
            stem = self.path.name[:-len(_SUFFIX)]
            self._shards = [_ShardFiles(stem, w, plan.writers, max_bytes)
                            for w in range(plan.writers)]
            self._entry = ("", None)
            self._open = None  # (file name, its H5IOStore): this worker's file being written
            self._groups_made = set()  # (file name, path)
            self.weight_map = {}
            self.total_size = 0
            self.files = []  # this worker's, in order

        def __bool__(self):  # (Keras' walk skips a false store; the parent asks its file.)
            return True

        def make(self, path, metadata=None):
            self._entry = (path, metadata)
            return self

        def __setitem__(self, key, value):
            path, metadata = self._entry
            writer = self._plan.writer_of(value)
            size = _nbytes(value)
            name = self._shards[writer].place(size)
            names = self.weight_map.setdefault(f"/{path}/vars" if path else "/vars", [])
            if name not in names:
                names.append(name)
            self.total_size += size
            if writer != self._plan.me:
                return
            store = self._file(name)
            if (name, path) not in self._groups_made:
                store.make(path, metadata=metadata)
                self._groups_made.add((name, path))
            store[key] = self._plan.local_value(value)

        def _file(self, name):
            if self._open is None or self._open[0] != name:
                self.close()
                self._open = (name, h5_store(self.path.with_name(name), mode="w"))
                self.files.append(name)
            return self._open[1]

        def close(self):
            if self._open is not None:
                self._open[1].close()
                self._open = None

        def finish(self):
            """Closes this worker's last file; the chief makes its first, which Keras'
            reader opens whatever it reads, even when the chief wrote nothing."""
            self.close()
            if self._plan.me == 0 and self.first_file not in self.files:
                h5_store(self.path.with_name(self.first_file), mode="w").close()
                self.files.append(self.first_file)

        @property
        def first_file(self):
            return self._shards[0].name(0)

        def sharding_config(self):
            """The weight map, as Keras writes it (one file: its name; several: a list)."""
            return {"metadata": {"total_size": self.total_size},
                    "weight_map": {k: v[0] if len(v) == 1 else v
                                   for k, v in self.weight_map.items()}}

    return OwnersStore


def _check_keras_reads_split_groups():
    import keras

    if internals.release(keras.version()) < internals.release(READS_SPLIT_GROUPS):
        raise ValueError(
            f"Sharded weights written by their owners (save_weights('*.weights.json', "
            f"max_shard_size=...) under ZeRO across workers) need Keras >= "
            f"{READS_SPLIT_GROUPS} to be read (a layer's variables may be in several "
            f"files); this is Keras {keras.version()}. Save to a '.weights.h5' file instead "
            f"(gathered on the chief), or upgrade Keras.")


def _commit(path, config):
    """Writes the weight map whole or not at all."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(config, f, indent=4)
    os.replace(partial, path)


def save(model, filepath, max_shard_size, plan, objects_to_skip=None):
    """Writes this worker's share of `model`'s weights (and on the chief the map)."""
    path = str(filepath)
    if not path.endswith(_SUFFIX):
        raise ValueError(f"Sharded weights go to a file named '*{_SUFFIX}' (with "
                         f"max_shard_size). Received: {path}")
    if "://" in path:  # (gs://, s3://, hdfs://: h5 files are written locally.)
        raise ValueError(
            f"Sharded weights written by their owners go to a filesystem path every worker "
            f"writes to (each writes its own files): {path} is remote. Mount it, or save "
            f"to a '.weights.h5' file.")
    _check_keras_reads_split_groups()
    plan.agree(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    store = _store_class()(path, float(max_shard_size) * 1024 ** 3, plan)
    save_state = internals.symbol("keras.src.saving.saving_lib._save_state")
    try:
        save_state(model, weights_store=store, assets_store=None, inner_path="",
                   visited_saveables={id(o) for o in objects_to_skip or ()})
    finally:
        store.close()
    store.finish()
    written = plan.done(store.files)
    if plan.me == 0:
        named = {name for names in store.weight_map.values() for name in names}
        named.add(store.first_file)  # (Made by the chief if it wrote nothing there.)
        made = {name for files in written.values() for name in files}
        if named != made:  # Workers counted sizes differently: no map, no checkpoint.
            raise ClusterError(f"The workers wrote shard files {sorted(made)}, but the weight "
                               f"map names {sorted(named)}: the checkpoint is not written.")
        _commit(path, store.sharding_config())


def is_owners_store(store):
    return isinstance(store, _store_class())


def written_by_owners(save_weights_only):
    """saving_lib.save_weights_only: a sharded save (`max_shard_size`) of a model whose
    strategy has an owner plan (ZeRO across workers) is written by the owners (`save`)."""

    @functools.wraps(save_weights_only)
    def wrapper(model, filepath, max_shard_size=None, *args, **kwargs):
        plan = _plan(model, max_shard_size)
        if plan is None:
            return save_weights_only(model, filepath, max_shard_size, *args, **kwargs)
        skip = kwargs.get("objects_to_skip", args[0] if args else None)
        return save(model, filepath, max_shard_size, plan, skip)

    return wrapper


class _Unread:
    """A value of a sharded checkpoint that is read from its file when it is converted
    (to a tensor or a NumPy array), through Keras' own reader; `shape` and `dtype` come
    from the file's metadata. A stand-in of a weight another worker holds keeps nothing
    of what it is given (`_keeping_nothing`), so its value is never read."""

    def __init__(self, store, path, key):
        self._store, self._path, self._key = store, path, key

    def read(self):
        return self._store.read(self._path, self._key)

    def __array__(self, dtype=None, copy=None):
        value = self.read()
        return value if dtype is None else value.astype(dtype)

    @functools.cached_property
    def _dataset_shape_and_dtype(self):
        return self._store.described(self._path, self._key)

    @property
    def shape(self):
        return self._dataset_shape_and_dtype[0]

    @property
    def dtype(self):
        return self._dataset_shape_and_dtype[1]


@functools.lru_cache(maxsize=None)
def _reader_class():
    """Keras' sharded reader whose items are `_Unread`: a value is read only when a layer
    or optimizer converts it."""
    import h5py
    import tensorflow as tf

    sharded = internals.symbol("keras.src.saving.saving_lib.ShardedH5IOStore")
    tf.register_tensor_conversion_function(
        _Unread, lambda value, dtype=None, name=None, as_ref=False:
        tf.convert_to_tensor(value.read(), dtype=dtype, name=name))

    class LazyReader(sharded):
        def get(self, path):
            self.entry_path = path
            return super().get(path)

        def __getitem__(self, key):
            return _Unread(self, self.entry_path, key)

        def read(self, path, key):
            """The value of `key` in `path`'s group, by Keras' reader (which switches
            files); the store is left at the entry it was at."""
            here = self.entry_path
            self.get(path)
            try:
                return super().__getitem__(key)
            finally:
                self.get(here)

        def described(self, path, key):
            """(shape, dtype) of `key` in `path`'s group, from the files' metadata only."""
            group = f"/{path}/vars" if path else "/vars"
            names = self.sharding_config["weight_map"].get(group) or []
            for name in [names] if isinstance(names, str) else names:
                with h5py.File(self.path.with_name(name), "r") as f:
                    link = f.get(f"{group}/{key}", getlink=True)
                    if isinstance(link, h5py.HardLink):
                        dataset = f[f"{group}/{key}"]
                        if isinstance(dataset, h5py.Dataset):
                            dtype = dataset.attrs.get("dtype", dataset.dtype)
                            return tuple(dataset.shape), str(dtype)
            raise KeyError(f"Key '{key}' not found in any of the shards: {names}")

    return LazyReader


@contextlib.contextmanager
def _keeping_nothing(variables):
    """`variables` (stand-ins of weights other workers hold) take no value: their
    `assign` checks the value's shape only, so that the value is never read."""

    def assign(variable, value):
        if tuple(value.shape) != tuple(variable.shape):
            raise ValueError(f"The checkpoint's value for {variable.path} has shape "
                             f"{tuple(value.shape)}; the variable's is "
                             f"{tuple(variable.shape)}.")

    # (Set on the instances for the load and always taken back, so not in `hooks`' ledger
    # of lasting patches: hooks imports the modules that import this one.)
    for variable in variables:
        object.__setattr__(variable, "assign", functools.partial(assign, variable))
    try:
        yield
    finally:
        for variable in variables:
            object.__delattr__(variable, "assign")


def load(model, filepath, held_elsewhere, skip_mismatch=False, objects_to_skip=None):
    """Loads Keras' sharded weights at `filepath` into `model`, reading from disk only the
    values this worker keeps (`held_elsewhere(variable)`: a weight another worker
    holds). Keras' own walk (`_load_state`) does the rest, as in `load_weights_only`."""
    load_state = internals.symbol("keras.src.saving.saving_lib._load_state")
    raise_failure = internals.symbol("keras.src.saving.saving_lib._raise_loading_failure")
    if not model.built:
        raise ValueError("You are loading weights into a model that has not yet been "
                         "built. Build it first (call it on some data, or model.build()).")
    store = _reader_class()(filepath, mode="r")
    failed, errors = set(), {}
    remote = [v for v in model.weights if held_elsewhere(v)]
    try:
        with _keeping_nothing(remote):
            load_state(model, weights_store=store, assets_store=None, inner_path="",
                       skip_mismatch=skip_mismatch,
                       visited_saveables={id(o) for o in objects_to_skip or ()},
                       failed_saveables=failed, error_msgs=errors)
    finally:
        store.close()
    if failed:
        raise_failure(errors, warn_only=skip_mismatch)


def read_by_owners(load_weights_only):
    """saving_lib.load_weights_only: Keras' sharded weights ('*.weights.json') loaded into
    a model whose strategy holds some weights on other workers (ZeRO-3 across workers)
    are read only where they are kept (`load`)."""

    @functools.wraps(load_weights_only)
    def wrapper(model, filepath, skip_mismatch=False, objects_to_skip=None):
        held_elsewhere = hooks_of(
            getattr(model, "distribute_strategy", None))._tfpar_held_elsewhere
        if held_elsewhere is None or not str(filepath).endswith(_SUFFIX) \
                or "://" in str(filepath):
            return load_weights_only(model, filepath, skip_mismatch=skip_mismatch,
                                     objects_to_skip=objects_to_skip)
        return load(model, filepath, held_elsewhere, skip_mismatch, objects_to_skip)

    return wrapper
