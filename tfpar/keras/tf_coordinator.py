"""TensorFlow's parameter-server `ClusterCoordinator` as `tfpar.ParameterServerStrategy`
uses it: its workers in task order, per-worker iterators, a chief's dataset sent to the
workers, its reading of an error as a lost parameter server.

Every private is read or written through `internals` (listed in its manifest, failing
closed with the versions named); the runtime (`tfpar.distribute`) calls these functions
instead of naming a private.
"""

from tfpar.keras import internals


def workers(coordinator):
    """The coordinator's workers (each with `worker_index` and `create_resource`), in task
    order."""
    found = internals.attr(coordinator, "_cluster").workers
    internals.check([w.worker_index for w in found] == list(range(len(found))),
                    "the coordinator's workers, in task order")
    return found


def worker(coordinator, index):
    """The coordinator's worker of task `index`."""
    target = internals.attr(coordinator, "_cluster").workers[index]
    internals.check(target.worker_index == index, "the coordinator's workers, in task order")
    return target


def set_element_spec(iterator, spec):
    """Gives a per-worker iterator (a resource `RemoteValue`) the type spec of a
    `tf.data` iterator over elements of `spec`: step functions are traced with it."""
    import tensorflow as tf

    internals.set_attr(iterator, "_type_spec", tf.data.IteratorSpec(spec))


def per_worker_iterator(iterators):
    """One distributed iterator of the workers' own iterators (one per worker)."""
    return internals.symbol(
        "tensorflow.python.distribute.coordinator.values.PerWorkerDistributedIterator")(
            tuple(iterators))


def serialize_dataset(dataset):
    """A chief's `tf.data.Dataset` as its graph, to rebuild on each worker."""
    return internals.symbol(
        "tensorflow.python.distribute.coordinator.values.serialize_dataset_to_graph")(dataset)


def deserialize_dataset(graph, element_spec):
    """The dataset of a graph made by `serialize_dataset`."""
    return internals.symbol(
        "tensorflow.python.distribute.coordinator.values.deserialize_dataset_from_graph")(
            graph, element_spec)


def is_ps_failure(error):
    """Whether TensorFlow's coordinator reads `error` as a lost parameter server."""
    return internals.symbol(
        "tensorflow.python.distribute.coordinator.cluster_coordinator._is_ps_failure")(error)
