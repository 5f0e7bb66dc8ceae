"""Placing layers on devices and cutting models into stages. Pure Python.

Layers are described as `LayerCost` records in model order. Groups of layers are
given as `(start, stop)` ranges over that order: `stop` is exclusive, as in
`layers[start:stop]`, and the ranges are contiguous and cover every layer.
"""

import dataclasses
import difflib

from tfpar.errors import PlacementError


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """What one layer costs: parameters, bytes held for training and (optionally) time."""

    name: str
    params: int
    weight_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # Its output kept for the backward pass, at the planned batch.
    time: float = 0.0  # Measured seconds per step; 0.0 when not measured.
    # False: a tensor-parallel layout map leaves it whole (on its stage's first device).
    tensor_split: bool = True

    @property
    def total_bytes(self):
        return self.weight_bytes + self.optimizer_bytes + self.activation_bytes


# Per-variable slot copies each Keras 3 optimizer keeps (see each optimizer's `build`).
_SLOTS = {"sgd": 0, "adam": 2, "adamw": 2, "nadam": 2, "adamax": 2, "rmsprop": 1,
          "adagrad": 1, "adadelta": 2, "ftrl": 2, "lion": 1}


def optimizer_slots(optimizer_name, momentum=0.0, centered=False, amsgrad=False):
    """Returns how many copies of each variable a Keras optimizer keeps as state.

    >>> optimizer_slots("Adam"), optimizer_slots("sgd"), optimizer_slots("sgd", momentum=0.9)
    (2, 0, 1)
    """
    name = str(optimizer_name).lower()
    if name not in _SLOTS:
        raise PlacementError(
            f"Unknown optimizer {optimizer_name!r}: cannot estimate its state. Known "
            f"optimizers: {', '.join(sorted(_SLOTS))}. Pass optimizer_bytes yourself "
            f"for others.")
    slots = _SLOTS[name]
    if name in ("sgd", "rmsprop") and momentum:
        slots += 1
    if name == "rmsprop" and centered:
        slots += 1
    if name in ("adam", "adamw") and amsgrad:
        slots += 1
    return slots


def estimate_layer_bytes(params, dtype_bytes, optimizer_slots,
                         output_elements_per_example, batch_size):
    """Returns `(weight_bytes, optimizer_bytes, activation_bytes)` for one layer.

    Optimizer slots have the dtype of their variable. Only the layer's output is
    counted as activation memory; temporaries inside the layer are not.

    >>> estimate_layer_bytes(1000, 4, 2, 10, 32)
    (4000, 8000, 1280)
    """
    weight_bytes = params * dtype_bytes
    return (weight_bytes, weight_bytes * optimizer_slots,
            output_elements_per_example * batch_size * dtype_bytes)


COSTS = ("bytes", "params", "time")


def cost_of(layer, by):
    """Returns the number balanced when placing `layer`: one of `COSTS`."""
    if by == "bytes":
        return layer.total_bytes
    if by == "params":
        return layer.params
    if by == "time":
        return layer.time
    raise PlacementError(
        f"Unknown cost {by!r}. Balance by one of: {', '.join(repr(c) for c in COSTS)}.")


def _prefix_sums(costs):
    sums = [0]
    for i, c in enumerate(costs):
        if not c >= 0:  # Also rejects NaN.
            raise PlacementError(
                f"Costs must be non-negative numbers. Received {c!r} at index {i}.")
        sums.append(sums[-1] + c)
    return sums


def _greedy_ranges(sums, limit, num_parts):
    """Fills each group as far as `limit` allows, leaving a layer for every later group."""
    n = len(sums) - 1
    ranges, start = [], 0
    for part in range(num_parts):
        stop = start + 1
        last_stop = n - (num_parts - part - 1)  # Later groups need one layer each.
        while stop < last_stop and sums[stop + 1] - sums[start] <= limit:
            stop += 1
        if part == num_parts - 1:
            stop = n
        ranges.append((start, stop))
        start = stop
    return ranges


def partition(costs, num_parts):
    """Splits `costs` into `num_parts` contiguous, non-empty groups with the smallest
    possible largest sum. Returns `(start, stop)` ranges.

    Among optimal splits it returns the one whose earlier groups are largest, so
    zero-cost items join the group before them, and the result is deterministic.

    >>> partition([1, 2, 3, 4, 5, 6, 7, 8, 9], 3)
    [(0, 5), (5, 7), (7, 9)]
    """
    n = len(costs)
    if not isinstance(num_parts, int) or num_parts < 1:
        raise PlacementError(f"num_parts must be an integer >= 1. Received: {num_parts!r}")
    if num_parts > n:
        raise PlacementError(
            f"Cannot split {n} layers into {num_parts} parts: each part needs at least "
            f"one layer. Use at most {n} devices/stages.")
    sums = _prefix_sums(costs)

    def parts_needed(limit):
        count, start = 1, 0
        for i in range(1, n + 1):
            if sums[i] - sums[start] > limit:
                count, start = count + 1, i - 1
        return count

    # The optimum is the sum of some group, so binary search over all group sums
    # (n is at most a few hundred). The smallest must cover the largest single item.
    largest = max(sums[i + 1] - sums[i] for i in range(n))
    candidates = sorted({sums[b] - sums[a] for a in range(n) for b in range(a + 1, n + 1)
                         if sums[b] - sums[a] >= largest})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if parts_needed(candidates[mid]) <= num_parts:
            hi = mid
        else:
            lo = mid + 1
    return _greedy_ranges(sums, candidates[lo], num_parts)


def split_at_boundaries(num_layers, boundaries):
    """Returns `(start, stop)` ranges for groups starting at each of `boundaries`.

    >>> split_at_boundaries(5, [2, 4])
    [(0, 2), (2, 4), (4, 5)]
    """
    boundaries = list(boundaries)
    if sorted(set(boundaries)) != boundaries:
        raise PlacementError(
            f"Stage boundaries must be sorted and unique. Received: {boundaries}")
    bad = [b for b in boundaries if not isinstance(b, int) or not 1 <= b <= num_layers - 1]
    if bad:
        raise PlacementError(
            f"A stage boundary is the index of the first layer of a new stage, so it must "
            f"be between 1 and {num_layers - 1} for {num_layers} layers. Received: {bad}")
    starts = [0] + boundaries
    return list(zip(starts, starts[1:] + [num_layers]))


def _unique(names, what):
    seen, dups = set(), []
    for name in names:
        if name in seen and name not in dups:
            dups.append(name)
        seen.add(name)
    if dups:
        raise PlacementError(f"{what} must be unique. Repeated: {', '.join(map(str, dups))}")


def balanced_placement(layers, devices, by="bytes"):
    """Places contiguous groups of `layers` (`LayerCost`, model order) on `devices`
    so that the costliest device costs as little as possible.

    >>> layers = [LayerCost(n, 0, 10, 0, 0) for n in "abc"]
    >>> balanced_placement(layers, ["gpu:0", "gpu:1"])
    {'a': 'gpu:0', 'b': 'gpu:0', 'c': 'gpu:1'}
    """
    devices = list(devices)
    _unique([layer.name for layer in layers], "Layer names")
    _unique(devices, "Devices")
    if not devices or len(devices) > len(layers):
        raise PlacementError(
            f"Cannot place {len(layers)} layers on {len(devices)} devices: each device "
            f"needs at least one layer. Use between 1 and {len(layers)} devices.")
    costs = [cost_of(layer, by) for layer in layers]
    if by == "time" and not any(costs):
        raise PlacementError(
            "by='time' needs measured layer times, but every LayerCost.time is 0. "
            "Measure them first or use by='bytes'.")
    return {layer.name: device
            for (start, stop), device in zip(partition(costs, len(devices)), devices)
            for layer in layers[start:stop]}


def check_placement(placement, layer_names, devices):
    """Validates a user's `{layer name: device}` dict and returns it in model order.

    Every layer must be placed: a forgotten layer is an error, not a silent default.
    """
    layer_names, devices = list(layer_names), list(devices)
    _unique(layer_names, "Layer names")
    for name, device in placement.items():
        if name not in layer_names:
            close = difflib.get_close_matches(str(name), [str(n) for n in layer_names])
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise PlacementError(
                f"The placement names layer {name!r}, which is not in the model.{hint} "
                f"Layers: {', '.join(map(str, layer_names))}")
        if device not in devices:
            raise PlacementError(
                f"Layer {name!r} is placed on {device!r}, which is not one of the "
                f"strategy's devices: {', '.join(map(str, devices))}.")
    missing = [name for name in layer_names if name not in placement]
    if missing:
        raise PlacementError(
            f"Every layer needs a device, but {len(missing)} of {len(layer_names)} are "
            f"not placed: {', '.join(map(str, missing))}. Add them to the placement.")
    return {name: placement[name] for name in layer_names}


@dataclasses.dataclass(frozen=True)
class DeviceTotal:
    """What one device holds: how many layers, their parameters and their bytes."""

    layers: int = 0
    params: int = 0
    bytes: int = 0


def device_totals(layers, placement, devices=None):
    """Returns `{device: DeviceTotal}` in `devices` order (default: first use)."""
    totals = {device: DeviceTotal() for device in devices or ()}
    for layer in layers:
        t = totals.get(placement[layer.name], DeviceTotal())
        totals[placement[layer.name]] = DeviceTotal(
            t.layers + 1, t.params + layer.params, t.bytes + layer.total_bytes)
    return totals


def imbalance(totals):
    """Returns how far the busiest device is above the mean, in bytes: 0.0 is even.

    >>> imbalance({"a": DeviceTotal(1, 0, 30), "b": DeviceTotal(1, 0, 10)})
    0.5
    """
    sizes = [t.bytes for t in totals.values()]
    mean = sum(sizes) / len(sizes) if sizes else 0
    return max(sizes) / mean - 1 if mean else 0.0


def format_bytes(n):
    """Returns `n` bytes in binary units. `format_bytes(1536 * 1024)` is `'1.5 MiB'`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _table(header, rows):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]

    def line(row):  # Names left-aligned, numbers right-aligned.
        return "  ".join(str(c).ljust(w) if h in ("layer", "device") else str(c).rjust(w)
                         for h, c, w in zip(header, row, widths)).rstrip()

    return [line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]


def format_report(layers, placement, devices):
    """Returns a plain-text table of each layer's device and bytes, then per-device totals."""
    rows = [[l.name, placement[l.name], f"{l.params:,}", format_bytes(l.weight_bytes),
             format_bytes(l.optimizer_bytes), format_bytes(l.activation_bytes),
             format_bytes(l.total_bytes)] for l in layers]
    totals = device_totals(layers, placement, devices)
    grand = sum(t.bytes for t in totals.values())
    summary = [[d, t.layers, f"{t.params:,}", format_bytes(t.bytes),
                f"{100 * t.bytes / grand if grand else 0:.1f}%"] for d, t in totals.items()]
    return "\n".join(
        _table(["layer", "device", "params", "weights", "optimizer", "activations", "total"],
               rows)
        + ["", f"Per device (imbalance {100 * imbalance(totals):.1f}% above even):"]
        + _table(["device", "layers", "params", "total", "share"], summary)) + "\n"
