"""Parameter-server training on a TF_CONFIG cluster (TensorFlow glue).

The chief runs the program. Variables live on the ps tasks (split over several
with `variable_partitioner`). Each training call is a closure that TensorFlow's
`ClusterCoordinator` runs on whichever worker is free; a closure lost with its
worker is run again elsewhere. tfpar adds what Keras 3 dropped: `model.fit`,
`evaluate` and `predict` (`ps_loops`), state updates that lose
nothing (`tfpar.keras.ps_state`), a shard of the data per worker or a tf.data service
pass per epoch, bounded waits for lost workers, clear errors for bad clusters, and a
synchronous mode.

Modes:
  "async": every worker applies its own gradients to the ps variables, without
    waiting for the others (Hogwild-style; the default).
  "sync": each step's batch is split over the workers; each worker stores its
    share of the gradients on the ps, where they are summed and applied once: one
    device on the combined batch, as in the classic parameter-server design.
"""

import functools
import os
import re
import threading
import time
import uuid

import tensorflow as tf

from tfpar.cluster.data_service import DATA_SERVICE_ENV
from tfpar.cluster.probe import answers, listening, require_reachable
from tfpar.cluster.tf_config import check_parameter_server_cluster
from tfpar.contract import StrategyHooks
from tfpar.data import dataset_from_function
from tfpar.distribute.common.cluster_config import cluster_config
from tfpar.distribute.parameter_server import ps_loops
from tfpar.distribute.parameter_server.ps_sync import ASYNC, MODES, SYNC
from tfpar.errors import ClusterError
from tfpar.keras import hooks as keras_hooks
from tfpar.keras import tf_coordinator



class ParameterServerStrategy(StrategyHooks, tf.distribute.experimental.ParameterServerStrategy):
    """Parameter-server training whose Keras `fit`/`evaluate`/`predict` work.

    Run the program on the chief of a cluster with workers and ps tasks, which
    `tfpar launch` starts for you:

        tfpar launch --workers 2 --ps 1 -- python train.py

        # train.py
        strategy = tfpar.ParameterServerStrategy()
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        model.fit(dataset, epochs=3, steps_per_epoch=100)

    Args:
      cluster_resolver: where the cluster is; by default TF_CONFIG.
      variable_partitioner: splits large variables over the ps tasks, e.g.
        `tf.distribute.experimental.partitioners.MinSizePartitioner(max_shards=2)`.
      mode: "async" (default) or "sync" (see the module docstring).
      connect_timeout_seconds: how long workers and ps tasks get to start listening
        before the strategy gives up with a clear error.
      worker_timeout_seconds: how long a wait for workers (the end of an epoch, an
        evaluate) goes on while no worker is reachable; then it fails with a
        `ClusterError` naming the lost workers. TensorFlow itself waits an hour for
        a worker to come back. Restarted workers (`tfpar launch --max_restarts N`)
        rejoin within this time.
    """

    _tfpar_parameter_server = True

    def __init__(self, cluster_resolver=None, variable_partitioner=None, mode=ASYNC,
                 connect_timeout_seconds=60.0, worker_timeout_seconds=300.0,
                 data_service="auto"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}. "
                             f"Received: mode={mode!r}")
        if not isinstance(worker_timeout_seconds, (int, float)) or worker_timeout_seconds <= 0:
            raise ValueError(f"worker_timeout_seconds must be a number > 0. Received: "
                             f"{worker_timeout_seconds!r}")
        self.worker_timeout_seconds = float(worker_timeout_seconds)
        if data_service == "auto":
            data_service = os.environ.get(DATA_SERVICE_ENV) or None
        if data_service is not None and not (isinstance(data_service, str) and "://" in data_service):
            raise ValueError(f"data_service must be a tf.data service address like "
                             f"'grpc://127.0.0.1:5050', 'auto' or None. Received: {data_service!r}")
        self.data_service = data_service
        config = cluster_config(cluster_resolver)
        check_parameter_server_cluster(config)
        require_reachable(config.cluster, ("worker", "ps"), connect_timeout_seconds,
                          "Start `python -m tfpar.cluster.server` for each worker and ps task with its "
                          "TF_CONFIG (tfpar launch --workers N --ps K does this)")
        self.mode = mode
        self.cluster_config = config
        super().__init__(cluster_resolver or tf.distribute.cluster_resolver.TFConfigClusterResolver(),
                         variable_partitioner=variable_partitioner)
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(self)
        self._step_functions = {}
        self._steps_run = None
        keras_hooks.install_parameter_server_training()
        keras_hooks.install_crash_safe_backups()
        if mode == SYNC:  # Parts of a batch: losses divided by the whole batch's counts.
            keras_hooks.install_exact_replicas()

    @property
    def num_workers(self):
        return len(self.cluster_config.cluster["worker"])  # The chief does not run steps.

    # Asked by the Keras seam for the model's fit, evaluate and predict.
    def _tfpar_run_loop(self, name, model, *args, **kwargs):
        return ps_loops.LOOPS[name](model, *args, **kwargs)

    def __repr__(self):
        return (f"tfpar.ParameterServerStrategy(mode={self.mode!r}, workers={self.num_workers}, "
                f"ps={self.cluster_config.num_ps})")

    # -- scheduling -------------------------------------------------------------

    def per_worker_iterator(self, dataset, repeat=False):
        """An iterator on every worker over its own part of `dataset`.

        `dataset` is a `tf.data.Dataset`, split by element over the workers (worker k
        reads elements k, k + W, ...; each reads all of it when it has fewer elements
        than there are workers), or a function `fn(input_context)` returning the
        dataset a worker reads: `input_context.input_pipeline_id` is the worker's index
        (shard or seed by it, as with `distribute_datasets_from_function`). The input
        pipeline runs on the workers; a restarted worker builds its iterator again.
        `repeat=True` repeats each worker's part without end.
        """
        workers = tf_coordinator.workers(self.coordinator)
        make = _per_worker_datasets(dataset, len(workers), repeat, self.data_service)
        iterators = []
        with self.ps_failures_explained():
            for worker in workers:
                make_one = tf.function(functools.partial(make, worker.worker_index))
                make_one = make_one.get_concrete_function()
                iterator = worker.create_resource(lambda make_one=make_one: iter(make_one()))
                # The step functions are traced with the iterator as an argument.
                tf_coordinator.set_element_spec(
                    iterator, make_one.structured_outputs.element_spec)
                iterators.append(iterator)
        return tf_coordinator.per_worker_iterator(iterators)

    def schedule_steps(self, step_fn, iterator, num_steps):
        """Schedules `num_steps` calls of `step_fn(next(iterator))` as one closure (fewer if
        the data runs out); `steps_run` counts the steps it ran."""
        steps = self._step_function(step_fn, "iterator")
        with self.ps_failures_explained():
            return self.coordinator.schedule(steps, args=(iterator, tf.constant(num_steps)))

    def schedule_steps_on(self, worker, step_fn, iterator, num_steps):
        """As `schedule_steps`, on worker `worker` (an index) and its own iterator only.

        `join` does not wait for it: `fetch` its value. A worker lost (or found lost)
        makes that fetch raise `tf.errors.CancelledError`, which the coordinator does not
        retry elsewhere: what the worker's iterator held is gone with it."""
        steps = self._step_function(step_fn, "iterator")
        # The coordinator pins only resource closures to a worker (its own queue, which
        # that worker serves first); one is rerun on recovery while its value is kept.
        target = tf_coordinator.worker(self.coordinator, worker)
        with self.ps_failures_explained():
            return target.create_resource(steps, args=(iterator, tf.constant(num_steps)))

    def schedule_on(self, step_fn, *args):
        """Schedules `step_fn(*args)` on a free worker; `args` are sent from the chief."""
        run = self._step_function(step_fn, "args")
        with self.ps_failures_explained():
            return self.coordinator.schedule(run, args=args)

    @property
    def steps_run(self):
        """Steps the closures of `schedule_steps` ran, counted on the ps (a count returned
        by a closure would be copied from its worker, which may be gone by then). Made at
        the first use, so that it does not shift where the model's variables are placed."""
        if self._steps_run is None:
            with self.scope():
                self._steps_run = tf.Variable(0, dtype=tf.int64, trainable=False,
                                              name="tfpar_steps_run")
        return self._steps_run

    def join(self):
        """Waits for every scheduled closure; a lost ps, or no worker for
        `worker_timeout_seconds`, raises ClusterError."""
        self.wait(self.coordinator.join)

    def fetch(self, remote_value):
        """The value of a scheduled closure, waited for as `join` waits."""
        return self.wait(remote_value.fetch)

    def wait(self, blocking_call):
        """`blocking_call()`, given up with a ClusterError when no worker is reachable for
        `worker_timeout_seconds` (TensorFlow would wait an hour for one to come back)."""
        outcome = {}

        def call():
            try:
                outcome["value"] = blocking_call()
            except BaseException as error:  # Raised again in the caller's thread.
                outcome["error"] = error

        waiter = threading.Thread(target=call, daemon=True)
        waiter.start()
        workers = self.cluster_config.cluster["worker"]
        last_seen = time.monotonic()
        while True:
            waiter.join(_HEALTH_POLL_SECONDS)
            if not waiter.is_alive():
                break
            if any(listening(address) for address in workers):
                last_seen = time.monotonic()
            elif time.monotonic() - last_seen > self.worker_timeout_seconds:
                lost = ", ".join(f"worker:{i} ({a})" for i, a in enumerate(workers))
                raise ClusterError(
                    f"No worker has been reachable for {self.worker_timeout_seconds:g}s "
                    f"(lost: {lost}), so the scheduled steps cannot run. Restart the workers "
                    f"(tfpar launch --max_restarts N restarts them for you) or rerun with a "
                    f"checkpoint directory to resume; worker_timeout_seconds sets this wait.")
        if "error" in outcome:
            with self.ps_failures_explained():
                raise outcome["error"]
        return outcome.get("value")

    def _step_function(self, step_fn, kind):
        key = (step_fn, kind)
        if key not in self._step_functions:
            if kind == "iterator":
                steps_run = self.steps_run  # Made here, not while the steps are traced.

                @tf.function
                def steps(iterator, num_steps):
                    # A pass handed out by a tf.data service ends for one worker while
                    # others still have its last batches: that worker's steps then end.
                    done = tf.constant(0)
                    element = iterator.get_next_as_optional()
                    while done < num_steps and element.has_value():
                        self.run(step_fn, args=(element.get_value(),))
                        done += 1
                        if done < num_steps:
                            element = iterator.get_next_as_optional()
                    steps_run.assign_add(tf.cast(done, tf.int64))
                fn = steps
            else:
                @tf.function
                def run(*args):
                    return self.run(step_fn, args=args)
                fn = run
            self._step_functions[key] = fn
        return self._step_functions[key]

    def ps_failures_explained(self):
        """A context in which a lost ps raises ClusterError, which says what to do."""
        return _PSFailure(self.cluster_config)


_HEALTH_POLL_SECONDS = 1.0


def _per_worker_datasets(dataset, num_workers, repeat, data_service=None):
    """`make(worker)`: the dataset `worker` reads (see `per_worker_iterator`)."""
    if data_service:
        if not isinstance(dataset, tf.data.Dataset):
            dataset = dataset_from_function(dataset, tf.distribute.InputContext())
        source = dataset.repeat() if repeat else dataset
        # Registered once; every worker joins the same job, which hands out each element
        # to exactly one of them ("distributed_epoch").
        dataset_id = tf.data.experimental.service.register_dataset(data_service, source)
        job_name = f"tfpar-{uuid.uuid4().hex}"
        return lambda worker: tf.data.experimental.service.from_dataset_id(
            "distributed_epoch", data_service, dataset_id, element_spec=source.element_spec,
            job_name=job_name)
    if isinstance(dataset, tf.data.Dataset):
        # Made on the chief, it reaches the workers as its serialized graph.
        graph = tf_coordinator.serialize_dataset(dataset)
        spec = dataset.element_spec
        size = int(dataset.cardinality())
        split = size < 0 or size >= num_workers  # Infinite or unknown sizes split too.

        def part(worker):
            whole = tf_coordinator.deserialize_dataset(graph, spec)
            return whole.shard(num_workers, worker) if split else whole
    elif callable(dataset):
        def part(worker):
            return dataset_from_function(dataset, tf.distribute.InputContext(
                num_input_pipelines=num_workers, input_pipeline_id=worker))
    else:
        raise TypeError(f"per_worker_iterator takes a tf.data.Dataset or a function of an "
                        f"InputContext returning one. Received: {type(dataset).__name__}")
    return (lambda worker: part(worker).repeat()) if repeat else part


class _PSFailure:
    """Turns the loss of a ps into a ClusterError that says what to do. Any other error
    passes as itself: a step that fails on a worker (a user's shape error) comes back
    through the ps that ran part of it, so its text names the ps while the ps is fine."""

    def __init__(self, config):
        self._config = config

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if error is None or not isinstance(error, tf.errors.OpError):
            return False
        lost = self._lost_ps(error)
        if not lost:
            return False
        ps = ", ".join(f"ps:{i} ({self._config.cluster['ps'][i]})" for i in lost)
        raise ClusterError(
            f"A parameter server stopped responding ({ps}): the variables it held are gone, "
            f"so training cannot go on. Restart the cluster; with a checkpoint directory "
            f"(--model_dir, or keras.callbacks.BackupAndRestore) the rerun resumes from the "
            f"last checkpoint.") from error

    def _lost_ps(self, error):
        """The indices of the ps tasks `error` shows lost; empty when none is."""
        addresses = self._config.cluster["ps"]
        text = str(error)
        # The coordinator's own reading (an unavailable or restarted ps); the chief's own
        # reads of a lost ps fail with other errors, which name the ps job or its address.
        said_lost = tf_coordinator.is_ps_failure(error)
        if not (said_lost or "/job:ps" in text or any(a in text for a in addresses)):
            return []
        # Asked directly: a ps that is gone refuses, a stopped one stays silent.
        lost = [i for i, address in enumerate(addresses) if answers(address) != "answers"]
        if lost or not said_lost:
            return lost
        # All answer, yet TensorFlow reads a lost ps: one restarted, without its variables.
        named = sorted({int(i) for i in re.findall(r"/job:ps/replica:0/task:(\d+)", text)})
        return [i for i in named if i < len(addresses)] or list(range(len(addresses)))
