"""`tfpar.MeshStrategy`: Keras' distribution API on TensorFlow as a strategy scope."""

import contextlib

from tfpar.distribute.mesh import mesh_runtime as mesh_lib
from tfpar.keras import keras_distribution as keras_mesh


def use_keras_distribution():
    """Makes `keras.distribution` (DeviceMesh, LayoutMap, DataParallel, ModelParallel,
    set_distribution, distribute_tensor) work on the TensorFlow backend: Keras' side in
    the seam (`tfpar.keras.keras_distribution`), on DTensor (`tfpar.distribute.mesh.mesh_runtime`), a `DataParallel`
    trained by `tfpar.DataParallelStrategy`. Idempotent.

    Examples:
      >>> import keras, tfpar
      >>> tfpar.use_keras_distribution()
      >>> mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"],
      ...                                      keras.distribution.list_devices()[:2])
      >>> layout_map = keras.distribution.LayoutMap(mesh)
      >>> layout_map[".*dense.*kernel"] = (None, "model")
      >>> keras.distribution.set_distribution(
      ...     keras.distribution.ModelParallel(layout_map=layout_map))
      >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4)])
      >>> [tuple(p.shape) for p in tfpar.distribute.mesh.mesh_runtime.pieces(model.weights[0])]
      [(2, 2), (2, 2)]
      >>> keras.distribution.set_distribution(None)
    """
    from tfpar.distribute.data_parallel.data_parallel_strategy import DataParallelStrategy

    keras_mesh.install(mesh_lib, DataParallelStrategy)


class MeshStrategy:
    """Keras' distribution API (`keras.distribution`) on TensorFlow, as a strategy scope.

    Variables whose path matches a `layout_map` key are split over the mesh axes it
    names, each device holding its piece (tensor parallelism: a `Dense` kernel split by
    output columns computes without communication, by input rows with one all-reduce);
    each batch is split along `batch_dim_name` (data parallelism; gradients of a variable
    are reduced over that axis only). Equivalent to
    `keras.distribution.set_distribution(ModelParallel(layout_map=...))`
    after `tfpar.use_keras_distribution()`; for data parallelism use
    `keras.distribution.DataParallel` or `tfpar.DataParallelStrategy`. Not a
    `tf.distribute.Strategy`: `model.fit` is how it trains.

    Args:
      mesh: a `keras.distribution.DeviceMesh`.
      layout_map: a `keras.distribution.LayoutMap` (regex keys over variable paths), or
        None: every variable replicated.
      batch_dim_name: the mesh axis of data parallelism (default: the first).

    Examples:
      >>> import keras, numpy as np, tfpar
      >>> mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"),
      ...                                      keras.distribution.list_devices()[:2])
      >>> layout_map = keras.distribution.LayoutMap(mesh)
      >>> layout_map["dense.*kernel"] = (None, "model")
      >>> strategy = tfpar.MeshStrategy(mesh, layout_map)
      >>> with strategy.scope():
      ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8)])
      ...     model.compile("sgd", "mse")
      >>> _ = model.fit(np.ones((8, 4)), np.ones((8, 8)), batch_size=4, verbose=0)
      >>> strategy.num_replicas_in_sync
      1
    """

    def __init__(self, mesh, layout_map=None, batch_dim_name=None):
        use_keras_distribution()
        self.distribution = keras_mesh.model_parallel(mesh, layout_map, batch_dim_name)
        self.runtime = mesh_lib.runtime_of(mesh)

    @property
    def num_replicas_in_sync(self):
        """Copies of the model working on different parts of a batch (the data axis)."""
        return self.runtime.plan.axis_size(self.distribution.batch_dim_name)

    @contextlib.contextmanager
    def scope(self):
        """Models created (and compiled) in the scope live on the mesh."""
        with self.distribution.scope():
            yield self

    def sharding_report(self, model):
        """Per variable: layout, shard shape, devices and bytes; per layer: sharded or
        gathered; the bytes each device holds."""
        return mesh_lib.sharding_report(model, keras_mesh.layer_modes(model))

    def __repr__(self):
        plan = self.runtime.plan
        return f"MeshStrategy(mesh={dict(zip(plan.axis_names, plan.shape))})"
