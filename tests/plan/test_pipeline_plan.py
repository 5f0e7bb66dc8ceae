"""Pipeline planning without TensorFlow: stage cuts, batch splits, trace files."""

import json
import subprocess
import sys

import pytest

from tfpar.errors import BatchSizeError, PlacementError
from tfpar.plan.stages import check_micro_batches, crossing_tensors, stage_ranges


def test_plan_modules_do_not_import_tensorflow():
    code = ("import sys, tfpar.plan.stages, tfpar.viz.pipeline_trace; "
            "print('tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "False"


def test_crossing_tensors_of_a_chain_and_a_residual_block():
    # x -> a -> b -> c: one tensor at each cut.
    assert crossing_tensors([["x"], ["a"], ["b"]], [["a"], ["b"], ["c"]], ["x"], ["c"]) == [
        ("a",), ("b",)]
    # x -> a; b = f(a); j = a + b; d = g(j): a and b both cross between b and j.
    inputs = [["x"], ["a"], ["a", "b"], ["j"]]
    outputs = [["a"], ["b"], ["j"], ["d"]]
    assert crossing_tensors(inputs, outputs, ["x"], ["d"]) == [("a",), ("a", "b"), ("j",)]
    # A graph input read late crosses every cut before its reader.
    assert crossing_tensors([["x"], ["a", "y"]], [["a"], ["b"]], ["x", "y"], ["b"]) == [
        ("y", "a")]


@pytest.mark.parametrize("costs,k,cuts,expected", [
    ([1] * 6, 3, None, [(0, 2), (2, 4), (4, 6)]),
    ([5, 1, 1, 1, 1, 1], 2, None, [(0, 1), (1, 6)]),
    ([1, 1, 1, 1], 2, [1, 3], [(0, 3), (3, 4)]),  # no cut at 2
    ([0, 0, 4, 0], 2, None, [(0, 3), (3, 4)]),  # zero-cost layers join the group before
    ([1, 2, 3], 1, None, [(0, 3)]),
])
def test_stage_ranges_balance_over_allowed_cuts(costs, k, cuts, expected):
    assert stage_ranges(costs, k, cuts) == expected


def test_stage_ranges_follow_boundaries_and_reject_bad_ones():
    assert stage_ranges([1] * 5, 3, boundaries=[1, 4]) == [(0, 1), (1, 4), (4, 5)]
    names = ["layer 'a'", "layer 'b'", "layer 'c'", "layer 'd'"]
    with pytest.raises(PlacementError, match="A stage cannot start at layer 'c'"):
        stage_ranges([1] * 4, 2, cuts=[1, 3], boundaries=[2], names=names)
    with pytest.raises(PlacementError, match="1 StageBoundary marker make 2 stages, but the "
                                             "strategy runs 3 stages"):
        stage_ranges([1] * 4, 3, boundaries=[2])
    with pytest.raises(PlacementError, match="Cannot cut 3 layers into 4 pipeline stages"):
        stage_ranges([1] * 3, 4)
    with pytest.raises(PlacementError, match=r"only 1 such place \(before layer 'c'\)\. Use at "
                                             r"most 2 stages"):
        stage_ranges([1] * 4, 3, cuts=[2], names=names)
    with pytest.raises(PlacementError, match="num_stages must be an integer >= 1"):
        stage_ranges([1], 0)


def test_micro_batch_split_checks():
    assert check_micro_batches(32, 8) == 4
    assert check_micro_batches(32, 4, num_replicas=2) == 4
    with pytest.raises(BatchSizeError, match=r"A batch of 30 examples does not split evenly into "
                                             r"8 micro-batches \(8 equal parts\)\. Use a batch "
                                             r"size that is a multiple of 8, such as 24 or 32"):
        check_micro_batches(30, 8)
    with pytest.raises(BatchSizeError, match="such as 8;"):
        check_micro_batches(3, 4, num_replicas=2)


def test_trace_files_from_spans(tmp_path):
    from PIL import Image

    from tfpar.viz.pipeline_trace import (
        action_of_op, action_spans, draw_timeline, write_chrome_trace)

    assert action_of_op("pipeline_r1/0F2/dense/MatMul") == (1, "0F2")
    assert action_of_op("gradient_tape/pipeline_r0_1/1F3/dense/MatMul") == (0, "1B3")
    assert action_of_op("pipeline_r0/1B3/dense/MatMul") == (0, "1B3")  # a remat rerun
    assert action_of_op("sgd/update/AssignSub") is None
    ops = [("pipeline_r0/0F0/d/MatMul", "MatMul", 1.0, 1.2, "t"),
           ("pipeline_r0/0F0/d/ReadVariableOp", "ReadVariableOp", 0.0, 0.1, "t"),
           ("pipeline_r0/1F0/d/MatMul", "MatMul", 1.2, 1.5, "t"),
           ("gradient_tape/pipeline_r0/1F0/d/MatMul", "MatMul", 1.5, 2.0, "t"),
           ("pipeline_r1/0F0/d/MatMul", "MatMul", 1.0, 1.1, "t")]
    spans = action_spans(ops, num_stages=2)
    assert spans == [("0F0", 0, 1.0, 1.2), ("0F0", 2, 1.0, 1.1), ("1F0", 1, 1.2, 1.5),
                     ("1B0", 1, 1.5, 2.0)]
    rows = ["r0 stage 0", "r0 stage 1", "r1 stage 0", "r1 stage 1"]
    events = write_chrome_trace(str(tmp_path / "t.json"), spans, rows, {"title": "x"})
    with open(tmp_path / "t.json") as f:
        assert json.load(f)["traceEvents"] == events
    assert events[4] == {"name": "0F0", "cat": "pipeline", "ph": "X", "pid": 0, "tid": 0,
                         "ts": 0.0, "dur": 200000.0, "args": {"device": "r0 stage 0"}}
    draw_timeline(str(tmp_path / "t.png"), spans, rows, "a step")
    with Image.open(tmp_path / "t.png") as image:
        assert image.size[0] == 1400
