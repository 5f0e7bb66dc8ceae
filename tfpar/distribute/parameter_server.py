"""Parameter-server training on a TF_CONFIG cluster (TensorFlow glue).

The chief runs the program. Variables live on the ps tasks (split over several
with `variable_partitioner`). Each training call is a closure that TensorFlow's
`ClusterCoordinator` runs on whichever worker is free; a closure lost with its
worker is run again elsewhere. tfpar adds what Keras 3 dropped: `model.fit`,
`evaluate` and `predict` (see `tfpar.keras.parameter_server`), exact step counts, clear errors for
bad clusters, and a synchronous mode.

Modes:
  "async": every worker applies its own gradients to the ps variables, without
    waiting for the others (Hogwild-style; the default).
  "sync": each step's batch is split over the workers; each worker stores its
    gradients on the ps, where they are averaged and applied once: one device on
    the combined batch, as in the classic parameter-server design.
"""

import tensorflow as tf

from tfpar.keras import hooks as keras_hooks
from tfpar.keras import internals
from tfpar.cluster.probe import unreachable_tasks
from tfpar.cluster.tf_config import check_parameter_server_cluster
from tfpar.distribute.cluster import cluster_config
from tfpar.distribute.ps_sync import ASYNC, MODES
from tfpar.errors import ClusterError



class ParameterServerStrategy(tf.distribute.experimental.ParameterServerStrategy):
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
    """

    _tfpar_parameter_server = True

    def __init__(self, cluster_resolver=None, variable_partitioner=None, mode=ASYNC,
                 connect_timeout_seconds=60.0):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}. "
                             f"Received: mode={mode!r}")
        config = cluster_config(cluster_resolver)
        check_parameter_server_cluster(config)
        missing = unreachable_tasks(config.cluster, ("worker", "ps"), connect_timeout_seconds)
        if missing:
            raise ClusterError(
                f"Cannot reach {', '.join(missing)} after {connect_timeout_seconds:g}s. Start "
                f"`python -m tfpar.server` for each worker and ps task with its TF_CONFIG "
                f"(tfpar launch --workers N --ps K does this), and check the addresses.")
        self.mode = mode
        self.cluster_config = config
        super().__init__(cluster_resolver or tf.distribute.cluster_resolver.TFConfigClusterResolver(),
                         variable_partitioner=variable_partitioner)
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(self)
        self._step_functions = {}
        keras_hooks.install_parameter_server_training()

    @property
    def num_workers(self):
        return self.cluster_config.num_workers - 1  # the chief does not run steps

    def __repr__(self):
        return (f"tfpar.ParameterServerStrategy(mode={self.mode!r}, workers={self.num_workers}, "
                f"ps={self.cluster_config.num_ps})")

    # -- scheduling -------------------------------------------------------------

    def per_worker_iterator(self, dataset):
        """An iterator on every worker over its own copy of `dataset`.

        `dataset` is a `tf.data.Dataset`, or a function returning one that is traced
        and built on each worker (so the input pipeline runs there).
        """
        with self.ps_failures_explained():
            return iter(self.coordinator.create_per_worker_dataset(dataset))

    def schedule_steps(self, step_fn, iterator, num_steps):
        """Schedules `num_steps` calls of `step_fn(next(iterator))` as one closure."""
        steps = self._step_function(step_fn, "iterator")
        with self.ps_failures_explained():
            return self.coordinator.schedule(steps, args=(iterator, tf.constant(num_steps)))

    def schedule_on(self, step_fn, *args):
        """Schedules `step_fn(*args)` on a free worker; `args` are sent from the chief."""
        run = self._step_function(step_fn, "args")
        with self.ps_failures_explained():
            return self.coordinator.schedule(run, args=args)

    def join(self):
        """Waits for every scheduled closure; a lost ps raises ClusterError."""
        with self.ps_failures_explained():
            self.coordinator.join()

    def _step_function(self, step_fn, kind):
        key = (step_fn, kind)
        if key not in self._step_functions:
            if kind == "iterator":
                @tf.function
                def steps(iterator, num_steps):
                    for _ in tf.range(num_steps):
                        self.run(step_fn, args=(next(iterator),))
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


class _PSFailure:
    """Turns the coordinator's ps failures into a ClusterError that says what to do."""

    def __init__(self, config):
        self._config = config

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if error is None or not isinstance(error, tf.errors.OpError):
            return False
        # The coordinator says PSUnavailableError; the chief's own reads of a lost ps
        # fail with various errors that name the ps job or its address.
        text = str(error)
        unavailable = internals.symbol(
            "tensorflow.python.distribute.coordinator.cluster_coordinator.PSUnavailableError")
        is_ps = (isinstance(error, unavailable) or "/job:ps" in text
                 or any(address in text for address in self._config.cluster["ps"]))
        if not is_ps:
            return False
        ps = ", ".join(f"ps:{i} ({a})" for i, a in enumerate(self._config.cluster["ps"]))
        raise ClusterError(
            f"A parameter server stopped responding ({ps}): the variables it held are gone, "
            f"so training cannot go on. Restart the cluster; with a checkpoint directory "
            f"(--model_dir, or keras.callbacks.BackupAndRestore) the rerun resumes from the "
            f"last checkpoint.") from error
