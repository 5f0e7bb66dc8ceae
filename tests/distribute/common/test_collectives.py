"""tfpar.collectives against NumPy on 2 and 4 replicas."""

import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar import collectives
from tfpar.errors import ReplicaContextError

from conftest import cpus

SHAPE = (4, 3)


def _inputs(n):
    """Replica i holds a distinct, non-symmetric array."""
    rng = np.random.default_rng(n)
    return rng.normal(size=(n,) + SHAPE).astype("float32")


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}replicas")
def run_collective(request):
    n = request.param
    strategy = tfpar.DataParallelStrategy(cpus(n))
    values = _inputs(n)

    def run(fn):
        @tf.function
        def step():
            def replica_fn():
                ctx = tf.distribute.get_replica_context()
                mine = tf.gather(tf.constant(values), ctx.replica_id_in_sync_group)
                return fn(mine)
            return strategy.run(replica_fn)
        return [t.numpy() for t in strategy.experimental_local_results(step())]

    return n, values, run


@pytest.mark.parametrize("op,np_op", [("sum", np.sum), ("mean", np.mean),
                                      ("max", np.max), ("min", np.min)])
def test_all_reduce(run_collective, op, np_op):
    n, values, run = run_collective
    for got in run(lambda v: collectives.all_reduce(v, op=op)):
        np.testing.assert_allclose(got, np_op(values, axis=0), rtol=1e-6, atol=1e-6)


def test_broadcast(run_collective):
    n, values, run = run_collective
    root = n - 1
    for got in run(lambda v: collectives.broadcast(v, root=root)):
        np.testing.assert_array_equal(got, values[root])


def test_reduce_to_root(run_collective):
    n, values, run = run_collective
    results = run(lambda v: collectives.reduce(v, op="sum", root=1))
    for i, got in enumerate(results):
        want = values.sum(axis=0) if i == 1 else values[i]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("axis", [0, 1])
def test_all_gather(run_collective, axis):
    n, values, run = run_collective
    for got in run(lambda v: collectives.all_gather(v, axis=axis)):
        np.testing.assert_array_equal(got, np.concatenate(list(values), axis=axis))


def test_reduce_scatter(run_collective):
    n, values, run = run_collective
    data = np.tile(values, (1, n, 1))  # dim 0 becomes 4n: divisible by n
    chunk = data.shape[1] // n

    def fn(v):
        return collectives.reduce_scatter(tf.tile(v, [n, 1]), op="sum", axis=0)

    for i, got in enumerate(run(fn)):
        np.testing.assert_allclose(got, data.sum(axis=0)[i * chunk:(i + 1) * chunk], rtol=1e-6)


def test_reduce_scatter_needs_divisible_dim():
    strategy = tfpar.DataParallelStrategy(cpus(4))
    with pytest.raises(ValueError, match="multiple of 4"):
        strategy.run(tf.function(lambda: collectives.reduce_scatter(tf.ones([3]))))


def test_bad_arguments():
    strategy = tfpar.DataParallelStrategy(cpus(2))
    with pytest.raises(ValueError, match="Unknown reduction op 'prod'"):
        strategy.run(lambda: collectives.all_reduce(tf.ones([2]), op="prod"))
    with pytest.raises(ValueError, match=r"root must be a replica index in \[0, 2\)"):
        strategy.run(lambda: collectives.broadcast(tf.ones([2]), root=2))
    with pytest.raises(ReplicaContextError, match="inside strategy.run"):
        with strategy.scope():
            collectives.all_reduce(tf.ones([2]))
