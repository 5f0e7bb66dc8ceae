"""Layouts on a device mesh (tfpar.plan.layouts): pure Python, no TensorFlow."""

import doctest
import itertools

import numpy as np
import pytest

from tfpar.plan import layouts
from tfpar.plan.layouts import COLUMN, REPLICATED, ROW, Mesh


def test_docstring_examples_run():
    result = doctest.testmod(layouts)
    assert result.attempted and not result.failed


@pytest.mark.parametrize("shape", [(4,), (2, 2), (2, 3), (3, 1, 2)])
def test_groups_along_an_axis_partition_the_mesh_and_vary_only_that_axis(shape):
    mesh = Mesh(shape, [f"a{i}" for i in range(len(shape))])
    # Row-major numbering, as numpy's.
    grid = np.arange(mesh.size).reshape(shape)
    for index in range(mesh.size):
        assert grid[mesh.coordinates(index)] == index == mesh.index(mesh.coordinates(index))
    for a, name in enumerate(mesh.axis_names):
        groups = mesh.groups(name)
        assert sorted(itertools.chain(*groups)) == list(range(mesh.size))
        assert len(groups) == mesh.size // shape[a]
        for group in groups:
            coordinates = [mesh.coordinates(i) for i in group]
            assert [c[a] for c in coordinates] == list(range(shape[a]))
            others = {c[:a] + c[a + 1:] for c in coordinates}
            assert len(others) == 1


@pytest.mark.parametrize("axes", [(None, "model"), ("model", None), ("batch", "model"),
                                  ("model", "batch"), (None, None)])
def test_shards_tile_the_tensor_once_per_replica_of_the_piece(axes):
    """Every element is held by exactly (devices / pieces) devices: the pieces tile the
    tensor, and each piece is repeated along the mesh axes the layout does not use."""
    mesh = Mesh((2, 3), ("batch", "model"))
    shape = (6, 6)
    layouts.check_layout(mesh, axes, shape)
    held = np.zeros(shape, int)
    for index in range(mesh.size):
        (r0, r1), (c0, c1) = layouts.shard_slices(mesh, axes, shape, index)
        assert (r1 - r0, c1 - c0) == layouts.shard_shape(mesh, axes, shape)
        held[r0:r1, c0:c1] += 1
    pieces = np.prod([mesh.axis_size(a) for a in axes if a is not None] or [1])
    assert (held == mesh.size // pieces).all()


@pytest.mark.parametrize("axes,shape,message", [
    ((None,), (4, 4), "names 1 dimensions; its shape"),
    (("model", "model"), (4, 4), "same mesh axis"),
    ((None, "heads"), (4, 4), "no axis 'heads'; its axes are \\['batch', 'model'\\]"),
    ((None, "model"), (4, 5), "size 5\\) does not split into 2 equal parts"),
])
def test_a_layout_that_does_not_fit_says_what_to_change(axes, shape, message):
    with pytest.raises(ValueError, match=message):
        layouts.check_layout(Mesh((1, 2), ("batch", "model")), axes, shape, "dense/kernel")


@pytest.mark.parametrize("shape,names", [((2,), ("a", "b")), ((0,), ("a",)),
                                         ((2, 2), ("a", "a")), ((), ())])
def test_a_bad_mesh_is_refused(shape, names):
    with pytest.raises(ValueError, match="mesh|Mesh"):
        Mesh(shape, names)


@pytest.mark.parametrize("equation,axes,expected", [
    # Dense.
    ("...i,io->...o", (None, "model"), (COLUMN, "model", 1)),
    ("...i,io->...o", ("model", None), (ROW, "model", None)),
    # EinsumDense of a query projection (heads split) and of an attention output.
    ("abc,cde->abde", (None, "model", None), (COLUMN, "model", 2)),
    ("abcd,cde->abe", ("model", None, None), (ROW, "model", None)),
    ("abc,cd->abd", (None, None), (REPLICATED, None, None)),
    # A dimension both kept and indexed by the inputs (batched kernel): gathered.
    ("abc,acd->abd", ("model", None, None), None),
])
def test_einsum_split_reads_the_mode_off_the_equation(equation, axes, expected):
    assert layouts.einsum_split(equation, axes) == expected


@pytest.mark.parametrize("equation,axes", [("ab,bc->ac", ("model", None)),
                                           ("ab,bc->ac", (None, "model"))])
def test_split_einsum_computed_piecewise_equals_the_whole(equation, axes):
    """What the modes promise, in numpy: a column split gives each device its slice of
    the output; a row split gives partial sums that add up to the output."""
    rng = np.random.default_rng(0)
    x, kernel = rng.normal(size=(3, 4)), rng.normal(size=(4, 6))
    mesh = Mesh((2,), ("model",))
    mode, _, dim = layouts.einsum_split(equation, axes)
    whole = np.einsum(equation, x, kernel)
    pieces = []
    for index in range(mesh.size):
        (r0, r1), (c0, c1) = layouts.shard_slices(mesh, axes, kernel.shape, index)
        local_x = x[:, r0:r1]  # A row split's input is split like the kernel's rows.
        pieces.append(np.einsum(equation, local_x, kernel[r0:r1, c0:c1]))
    if mode == COLUMN:
        np.testing.assert_allclose(np.concatenate(pieces, axis=dim), whole)
    else:
        np.testing.assert_allclose(sum(pieces), whole)


def test_megatron_bytes_follow_the_ring_formula():
    # 2 all-reduces (forward g, backward f) of tokens x hidden, each 2(M-1)/M of it sent.
    for m in (1, 2, 4, 8):
        got = layouts.megatron_mlp_bytes(tokens=64, hidden=32, model_parallel=m, dtype_bytes=2)
        assert got == 2 * 2 * (m - 1) / m * 64 * 32 * 2
