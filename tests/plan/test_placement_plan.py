"""Layer placement and stage cutting: pure Python, no TensorFlow needed."""

import itertools
import pathlib
import random
import subprocess
import sys

import pytest

from tfpar.errors import PlacementError
from tfpar.plan.placement import (
    COSTS, LayerCost, balanced_placement, check_placement, cost_of, device_totals,
    estimate_layer_bytes, format_bytes, format_report, imbalance, optimizer_slots,
    partition, split_at_boundaries)


def brute_force_max(costs, num_parts):
    """The smallest possible largest group sum, trying every set of cut positions."""
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), num_parts - 1):
        edges = (0,) + cuts + (len(costs),)
        worst = max(sum(costs[a:b]) for a, b in zip(edges, edges[1:]))
        best = worst if best is None else min(best, worst)
    return best


def group_sums(costs, ranges):
    return [sum(costs[a:b]) for a, b in ranges]


def layers_with_bytes(sizes, params=None):
    params = params or [0] * len(sizes)
    return [LayerCost(f"layer_{i}", p, s, 0, 0) for i, (s, p) in enumerate(zip(sizes, params))]


@pytest.mark.parametrize("costs,parts,expected", [
    ([1, 1, 1, 1], 2, [(0, 2), (2, 4)]),
    ([5, 1, 1, 1, 1, 1], 2, [(0, 1), (1, 6)]),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, [(0, 5), (5, 7), (7, 9)]),
    ([7], 1, [(0, 1)]),
    ([0, 0, 0], 2, [(0, 2), (2, 3)]),
])
def test_partition_hand_checked(costs, parts, expected):
    assert partition(costs, parts) == expected


def test_partition_1_to_9_max_is_17():
    costs = list(range(1, 10))
    assert group_sums(costs, partition(costs, 3)) == [15, 13, 17]


def test_partition_one_item_per_part():
    assert partition([4, 0, 2.5], 3) == [(0, 1), (1, 2), (2, 3)]


def test_partition_is_optimal_contiguous_and_non_empty():
    rng = random.Random(1234)
    for _ in range(400):
        n = rng.randint(1, 9)
        costs = [rng.choice([0, rng.randint(0, 20), rng.random() * 10]) for _ in range(n)]
        parts = rng.randint(1, n)
        ranges = partition(costs, parts)
        assert len(ranges) == parts
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a < b for a, b in ranges)
        assert all(prev[1] == nxt[0] for prev, nxt in zip(ranges, ranges[1:]))
        assert max(group_sums(costs, ranges)) == pytest.approx(brute_force_max(costs, parts))
        assert partition(costs, parts) == ranges  # Deterministic.


def test_partition_large_is_fast_and_optimal_by_bound():
    costs = [random.Random(i).randint(1, 1000) for i in range(300)]
    ranges = partition(costs, 8)
    # Not brute-forceable; at least no worse than the total mean plus the largest item.
    assert max(group_sums(costs, ranges)) <= sum(costs) / 8 + max(costs)


def test_partition_errors():
    with pytest.raises(PlacementError, match=r"Cannot split 3 layers into 4 parts.*at most 3"):
        partition([1, 2, 3], 4)
    with pytest.raises(PlacementError, match="num_parts must be an integer >= 1. Received: 0"):
        partition([1, 2, 3], 0)
    with pytest.raises(PlacementError, match=r"non-negative.*-1 at index 1"):
        partition([1, -1, 3], 2)
    with pytest.raises(PlacementError, match="non-negative"):
        partition([1, float("nan")], 1)


def test_split_at_boundaries():
    assert split_at_boundaries(5, [2, 4]) == [(0, 2), (2, 4), (4, 5)]
    assert split_at_boundaries(3, []) == [(0, 3)]
    assert split_at_boundaries(3, (1, 2)) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("boundaries,match", [
    ([3, 2], "sorted and unique"),
    ([2, 2], "sorted and unique"),
    ([0], r"between 1 and 4 for 5 layers. Received: \[0\]"),
    ([2, 5], r"Received: \[5\]"),
    ([1.5], "between 1 and 4"),
])
def test_split_at_boundaries_invalid(boundaries, match):
    with pytest.raises(PlacementError, match=match):
        split_at_boundaries(5, boundaries)


@pytest.mark.parametrize("num_devices", [2, 4])
def test_balanced_placement_equal_layers(num_devices):
    layers = layers_with_bytes([100] * 8)
    devices = [f"/gpu:{i}" for i in range(num_devices)]
    placement = balanced_placement(layers, devices)
    per_device = 8 // num_devices
    assert placement == {f"layer_{i}": devices[i // per_device] for i in range(8)}
    totals = device_totals(layers, placement, devices)
    assert [t.bytes for t in totals.values()] == [100 * per_device] * num_devices
    assert imbalance(totals) == 0.0


def test_balanced_placement_uneven_matches_brute_force():
    sizes = [3, 1, 4, 1, 5, 9, 2, 6]
    devices = ["a", "b", "c"]
    placement = balanced_placement(layers_with_bytes(sizes), devices)
    totals = device_totals(layers_with_bytes(sizes), placement, devices)
    assert [t.bytes for t in totals.values()] == [14, 11, 6]
    best = brute_force_max(sizes, 3)
    assert best == 14
    assert imbalance(totals) == pytest.approx(best / (sum(sizes) / 3) - 1)


def test_balanced_placement_within_10_percent_when_layers_allow():
    sizes = [30, 10, 20, 20, 10, 30, 25, 15, 20, 22, 5, 35]  # Nearly splits in 4 at 60.
    placement = balanced_placement(layers_with_bytes(sizes), ["d0", "d1", "d2", "d3"])
    totals = device_totals(layers_with_bytes(sizes), placement)
    assert max(t.bytes for t in totals.values()) == brute_force_max(sizes, 4) == 62
    assert imbalance(totals) == pytest.approx(62 / 60.5 - 1)
    assert imbalance(totals) <= 0.10


def test_zero_cost_layers_stay_contiguous_with_neighbours():
    params = [0, 10, 0, 10, 0, 0, 10, 0]
    layers = layers_with_bytes([1] * 8, params)
    devices = ["d0", "d1", "d2"]
    placement = balanced_placement(layers, devices, by="params")
    order = [placement[layer.name] for layer in layers]
    assert order == ["d0", "d0", "d0", "d1", "d1", "d1", "d2", "d2"]
    assert [t.params for t in device_totals(layers, placement, devices).values()] == [10] * 3


def test_balance_by_time():
    layers = [LayerCost(f"l{i}", 0, 0, 0, 0, time=t) for i, t in enumerate([0.1, 0.1, 0.2])]
    assert balanced_placement(layers, ["a", "b"], by="time") == {"l0": "a", "l1": "a", "l2": "b"}
    untimed = layers_with_bytes([1, 1])
    with pytest.raises(PlacementError, match="every LayerCost.time is 0"):
        balanced_placement(untimed, ["a", "b"], by="time")


def test_balanced_placement_errors():
    with pytest.raises(PlacementError, match="Cannot place 2 layers on 3 devices.*devices"):
        balanced_placement(layers_with_bytes([1, 1]), ["a", "b", "c"])
    with pytest.raises(PlacementError, match="Layer names must be unique. Repeated: x"):
        balanced_placement([LayerCost("x", 0, 1, 0, 0)] * 2, ["a"])
    with pytest.raises(PlacementError, match="Devices must be unique. Repeated: a"):
        balanced_placement(layers_with_bytes([1, 1]), ["a", "a"])
    with pytest.raises(PlacementError, match="Unknown cost 'flops'"):
        balanced_placement(layers_with_bytes([1, 1]), ["a"], by="flops")


def test_cost_of():
    layer = LayerCost("d", params=10, weight_bytes=40, optimizer_bytes=80, activation_bytes=8,
                      time=0.5)
    assert layer.total_bytes == 128
    assert [cost_of(layer, by) for by in COSTS] == [128, 10, 0.5]


@pytest.mark.parametrize("name,kwargs,expected", [
    ("sgd", {}, 0), ("SGD", {"momentum": 0.9}, 1), ("adam", {}, 2), ("Adam", {"amsgrad": True}, 3),
    ("adamw", {}, 2), ("nadam", {}, 2), ("adamax", {}, 2), ("rmsprop", {}, 1),
    ("RMSprop", {"centered": True}, 2), ("rmsprop", {"momentum": 0.9, "centered": True}, 3),
    ("adagrad", {}, 1), ("adadelta", {}, 2), ("ftrl", {}, 2), ("lion", {}, 1),
])
def test_optimizer_slots(name, kwargs, expected):
    assert optimizer_slots(name, **kwargs) == expected


def test_unknown_optimizer_lists_known():
    with pytest.raises(PlacementError, match="Unknown optimizer 'lamb'.*adadelta, adagrad, adam"):
        optimizer_slots("lamb")


def test_estimate_dense_1024_adam():
    params = 1024 * 1024 + 1024  # Kernel and bias.
    weights, optimizer, activations = estimate_layer_bytes(
        params, 4, optimizer_slots("adam"), output_elements_per_example=1024, batch_size=32)
    assert (weights, optimizer, activations) == (4_198_400, 8_396_800, 131_072)


def test_check_placement_returns_model_order():
    assert check_placement({"b": "d1", "a": "d0"}, ["a", "b"], ["d0", "d1"]) == {
        "a": "d0", "b": "d1"}
    assert list(check_placement({"b": "d1", "a": "d0"}, ["a", "b"], ["d0", "d1"])) == ["a", "b"]


def test_check_placement_errors():
    names, devices = ["dense", "dense_1", "output"], ["/gpu:0", "/gpu:1"]
    with pytest.raises(PlacementError, match="'dense_2', which is not in the model. "
                                             "Did you mean 'dense_1' or 'dense'"):
        check_placement({"dense_2": "/gpu:0"}, names, devices)
    with pytest.raises(PlacementError, match=r"'output' is placed on '/gpu:7'.*/gpu:0, /gpu:1"):
        check_placement({"dense": "/gpu:0", "dense_1": "/gpu:0", "output": "/gpu:7"},
                        names, devices)
    with pytest.raises(PlacementError, match="2 of 3 are not placed: dense_1, output"):
        check_placement({"dense": "/gpu:0"}, names, devices)
    with pytest.raises(PlacementError, match="Layer names must be unique. Repeated: dense"):
        check_placement({"dense": "/gpu:0"}, ["dense", "dense"], devices)


@pytest.mark.parametrize("n,expected", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536 * 1024, "1.5 MiB"),
    (3 * 1024 ** 3, "3.0 GiB"), (2 * 1024 ** 4, "2.0 TiB")])
def test_format_bytes(n, expected):
    assert format_bytes(n) == expected


def test_format_report():
    layers = [LayerCost("embed", 1000, 4000, 8000, 2048),
              LayerCost("hidden", 500, 2000, 4000, 1024),
              LayerCost("head", 10, 40, 80, 0)]
    devices = ["/gpu:0", "/gpu:1", "/gpu:2"]
    placement = {"embed": "/gpu:0", "hidden": "/gpu:1", "head": "/gpu:1"}
    report = format_report(layers, placement, devices)
    for word in ["embed", "hidden", "head", "/gpu:0", "/gpu:1", "/gpu:2", "1,000",
                 "13.7 KiB", "2.0 KiB", "7.0 KiB", "layer", "activations", "share"]:
        assert word in report, word
    summary = report.split("Per device")[1]
    shares = [float(line.split()[-1].rstrip("%")) for line in summary.splitlines()
              if line.startswith("/gpu:")]
    assert len(shares) == 3 and shares[2] == 0.0
    assert sum(shares) == pytest.approx(100.0, abs=0.2)
    assert shares[0] == pytest.approx(100 * 14048 / 21192, abs=0.05)


def test_does_not_import_tensorflow():
    subprocess.run(
        [sys.executable, "-c",
         "import tfpar.plan.placement, sys; assert 'tensorflow' not in sys.modules; "
         "assert 'keras' not in sys.modules"],
        check=True, cwd=pathlib.Path(__file__).resolve().parents[2])
