"""Model parallelism by layer placement: each layer lives and runs on one device.

How it works:

- *Forward and backward on the layer's device.* Each placed layer's `call` is
  wrapped with `placed_call` (tfpar/distribute/common/placed_call.py): the forward runs
  under `tf.device`, inside a `tf.custom_gradient` whose gradient is built under
  the same `tf.device`. So placement holds for `model.fit` and for a user's own
  `GradientTape` loop, in a `tf.function` or eagerly.
- *When placement is applied.* The strategy places a model created under its
  scope once, just before it first runs: Keras' own symbolic build in
  `fit`/`evaluate`/`predict`, or the first call in a custom loop (tfpar's Keras seam
  gives the strategy that moment, `keras_hooks.install_model_call_hook`); earlier
  if one of its variables is read or written first (weights loaded, a checkpoint
  restored); or when `strategy.placement_report(model)` asks. A plan balanced by
  memory needs the whole built model (every layer's shape), and Sequential and
  functional models create their layers' variables at construction, before the
  model exists as a whole, so the plan cannot be made earlier in general. An
  unbuilt model is built from the shapes of its first call, running nothing.
- *Variables are born on their device* (`tfpar.distribute.common.layer_placement`). A
  layer whose device is known when it is built (a placement dict or callable,
  `tfpar.layers.OnDevice`) creates its variables there. Otherwise
  (`placement="balanced"`, or a `memory_limit`, which is checked before anything
  is allocated) its variables are made as Keras makes them when it builds a model
  from shapes: shape and dtype, no storage. The plan is made from those shapes, and
  each variable gets its storage on its device when the model is placed; a layer's
  random state (Dropout's seed) waits the same way. So no variable of the model is
  created on a device of the strategy and moved away. `balance_by="time"` must run
  the layers: their variables are created on a CPU the strategy does not use (the
  host CPU when the strategy's devices are GPUs), timed there, then moved once to
  their device; with no such CPU it is refused. Optimizer state is created next to
  its variable (state built before the model was placed follows its variable), and
  optimizer updates run on the variable's device. Metrics and the optimizer's own
  scalars live on the first device.
- *Saving.* Nothing of the placement is saved: `model.save`, `save_weights` and
  `tf.train.Checkpoint` write plain Keras models and variables, which load
  anywhere, with or without this strategy.

What is placed: the model's layers in model order, where nested models
(Sequential, functional or subclassed) are replaced by their own layers,
recursively. Any other layer is placed whole, with its sub-layers (a custom
block stays on one device). `InputLayer`s are skipped. `tfpar.layers.OnDevice`
layers keep the device they name and are left out of the plan. Work that a
subclassed model does in its own `call` between layers, weights it creates itself,
the loss and metrics run on the first device. The order of a subclassed model's
layers is the order its attributes were set, which should follow the call order
for "balanced" to cut the model into contiguous groups. Placement wraps each layer's
`call` on the instance; layers quantized by Keras run `quantized_call` instead and
are not placed.

Combinations with data parallelism:

- `ModelParallelStrategy` is a single-replica strategy: the global batch runs
  through the split model; it cannot be nested in `DataParallelStrategy` (TF
  allows one strategy scope at a time).
- `tfpar.layers.OnDevice` works in any model, including under
  `DataParallelStrategy`, where every replica then runs that layer on the one
  named device (its mirrored variables are read there). Numerically this is still
  data-parallel training; use it to keep a layer off the replicas' devices.
- Replicas of a split model (data parallelism over groups of devices) come with
  the pipeline strategy, whose stages run through the same `placed_call`.
"""

import dataclasses
import math
import threading
import types
import weakref

import tensorflow as tf

from tfpar import devices as devices_lib
from tfpar.distribute.common import layer_timing
from tfpar.distribute.common import placed_call as placement_lib
from tfpar.distribute.common.layer_placement import PlacingStrategy, claim_model, mark_placed
from tfpar.errors import PlacementError
from tfpar.keras import hooks as keras_hooks
from tfpar.keras import internals
from tfpar.keras import models
from tfpar.keras import tf_runtime
from tfpar.keras import variable_birth
from tfpar.keras import xla_calls
from tfpar.plan import placement as plan

_DEFAULT_SLOTS = 2  # Adam's, when nothing says which optimizer will train the model.


class ModelParallelStrategy(PlacingStrategy, tf.distribute.OneDeviceStrategy):
    """Splits a Keras model by layers over devices: each layer lives and runs on one.

    Under its scope each layer of a Keras model (Sequential, functional, or
    subclassed with sub-layers) gets a device, at the latest when the model first
    runs; its variables are created there (never first on another device of the
    strategy), its optimizer state lives there and its forward and backward run
    there. Activations flow from device to device. The strategy runs one replica;
    the loss, metrics and input pipeline live on the first device. See the module
    docstring for what is placed and when.

    Args:
      devices: device names. None: all GPUs, or all logical CPUs without GPUs.
      placement: "balanced" (contiguous groups of layers, about equal cost per
        device), a dict `{layer name: device}` naming every layer (devices may stay
        unused), or a callable `layer -> device`.
      balance_by: for "balanced", the cost to even out: "bytes" (weights,
        optimizer state and output activations at `batch_size`), "params", or
        "time" (each layer's forward and backward measured on a CPU that is not
        one of `devices`; refused when there is none).
      batch_size: batch size assumed for activation bytes and timing.
      optimizer: optimizer name (e.g. "adam", "sgd") or number of state copies
        per weight, for the estimate when the model is not compiled. The
        compiled optimizer, when there is one, takes precedence. Default: Adam.
      memory_limit: bytes available per device, or None. The plan is checked
        before any variable of the model gets storage: one that puts more
        estimated bytes on a device raises `PlacementError`, with the numbers.

    Examples:
      >>> import keras, numpy as np, tfpar
      >>> strategy = tfpar.ModelParallelStrategy(["/cpu:0", "/cpu:1"])
      >>> with strategy.scope():
      ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
      ...                               keras.layers.Dense(3)])
      ...     model.compile("adam", "mse")
      >>> _ = model.fit(np.zeros((8, 4)), np.zeros((8, 3)), verbose=0)
      >>> print(strategy.placement_report())  # doctest: +SKIP
    """

    def __init__(self, devices=None, placement="balanced", balance_by="bytes", batch_size=32,
                 optimizer=None, memory_limit=None):
        resolved = devices_lib.resolve_devices(devices)
        given = [devices] if isinstance(devices, str) else (
            list(devices) if devices is not None else devices_lib.default_devices())
        self._display = dict(zip(resolved, given))
        self._placement = _check_placement_arg(placement)
        if balance_by not in plan.COSTS:
            raise PlacementError(
                f"balance_by must be one of {', '.join(map(repr, plan.COSTS))}. "
                f"Received: balance_by={balance_by!r}")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise PlacementError(f"batch_size must be an integer >= 1. Received: {batch_size!r}")
        if memory_limit is not None and not (
                isinstance(memory_limit, (int, float)) and memory_limit > 0):
            raise PlacementError(
                f"memory_limit must be a number of bytes > 0, or None. Received: {memory_limit!r}")
        self._balance_by = balance_by
        self._batch_size = batch_size
        self._slots_hint = _check_optimizer_hint(optimizer)
        self._memory_limit = memory_limit
        self._timing_device = _timing_device(resolved, self._placement, balance_by)
        self._default_home = (resolved[0],)  # Metrics and the optimizer's own variables.
        self._lock = threading.RLock()
        self._reports = {}  # id(model) -> PlacementReport, in placement order
        extended = _ModelParallelExtended(self, resolved)
        super(tf.distribute.OneDeviceStrategy, self).__init__(extended)
        keras_hooks.install_variable_births()
        keras_hooks.install_model_call_hook()
        keras_hooks.install_exact_replicas()
        keras_hooks.install_crash_safe_backups()

    def __repr__(self):
        placement = self._placement if isinstance(self._placement, str) else type(
            self._placement).__name__
        return (f"ModelParallelStrategy(devices={list(self._display.values())}, "
                f"placement={placement!r})")

    # jit_compile=True: each placed layer's call compiled by XLA on its device
    # (`tfpar.keras.xla_calls`), the transfers between devices outside XLA.
    _tfpar_xla_unit = "layer"

    @property
    def devices(self):
        """The devices layers are placed on, canonical names."""
        return tuple(self._display)

    def placement_report(self, model=None):
        """Returns where each layer lives and what each device holds (`PlacementReport`).

        `str(report)` is a plain-text table. `model`: a model created under this
        strategy's scope; it is placed now if it was not yet (it must be built).
        Default: the model placed last.
        """
        if model is not None:
            self._place(model)
            return self._reports[id(model)]
        if not self._reports:
            raise PlacementError(
                "No model has been placed by this strategy yet. Models are placed when "
                "they first run (fit, evaluate, predict or a call); pass the model to "
                "placement_report(model) to place it now.")
        return list(self._reports.values())[-1]

    def _known_home(self, layer):
        """The device of `layer`'s variables if known before its model is placed, else None
        (see `tfpar.distribute.common.layer_placement`)."""
        placed = getattr(layer, "_tfpar_device", None)
        if placed is not None:
            return (placed,)
        # A plan that needs the whole model, or one whose memory is checked first.
        if self._placement == "balanced" or self._memory_limit is not None:
            return None
        from tfpar.layers.on_device import OnDevice

        if isinstance(layer, OnDevice):
            return (layer.pinned_device,) if layer.pinned_device else None
        try:
            device = (self._placement.get(layer.name) if isinstance(self._placement, dict)
                      else self._placement(layer))
            device = placement_lib.canonical_device(device)
        except Exception:  # pylint: disable=broad-except
            return None  # Not placeable yet: the plan reports why, naming the layer.
        return (device,) if device in self.devices else None

    def _place(self, model):
        with self._lock:
            if not claim_model(self, model, id(model) in self._reports,
                               "its layers' sizes are unknown"):
                return
            units = models.placement_units(model)
            if not units:
                raise PlacementError(f"Model {model.name!r} has no layers to place.")
            from tfpar.layers.on_device import OnDevice

            free = [u for u in units if not isinstance(u, OnDevice)]
            pinned = {u.name: placement_lib.canonical_device(u.device) for u in units
                      if isinstance(u, OnDevice)}
            timing = self._balance_by == "time" and self._placement == "balanced"
            if timing:  # Layers run to be timed: their variables need storage, off the devices.
                with tf.init_scope(), self._creating_variables():
                    for unit in free:
                        for variable in unit.variables:
                            if variable_birth.has_no_storage(variable):
                                placement_lib.move_variable(variable, self._timing_device)
            costs = _layer_costs(units, self._optimizer_slots(model), self._batch_size,
                                 timing_device=self._timing_device if timing else None)
            free_costs = [c for c in costs if c.name not in pinned]
            if isinstance(self._placement, dict):
                clash = sorted(set(self._placement) & set(pinned))
                if clash:
                    raise PlacementError(
                        f"The placement names {', '.join(map(repr, clash))}, which "
                        f"tfpar.layers.OnDevice already pins to a device. Leave them out of "
                        f"the placement dict.")
            device_of = {**self._plan(free, free_costs), **pinned}
            report = PlacementReport(
                tuple(costs), {n: self._name(d) for n, d in device_of.items()},
                tuple(self._name(d) for d in self.devices))
            self._check_memory(report)
            # Each variable gets its storage on its device, or moves there (from the timing
            # device, or a model built before this strategy placed it).
            # id(old tf.Variable) -> (it, its new device). Holding the old copies
            # keeps their ids unique until optimizer state has followed them.
            moved, seen = {}, set()
            with tf.init_scope(), self._creating_variables():
                for unit in free:
                    for variable in unit.variables:
                        if id(variable) in seen:
                            continue  # Shared by an earlier layer: it stays there.
                        seen.add(id(variable))
                        old = models.storage(variable)
                        if placement_lib.move_variable(
                                variable, device_of[unit.name]):
                            moved[id(old)] = (old, device_of[unit.name])
                    _wrap_call(unit, device_of[unit.name])
                self.extended._move_optimizer_state(getattr(model, "optimizer", None), moved)
            mark_placed(self, model)
            self._reports[id(model)] = report

    def _plan(self, units, costs):
        """{layer name: canonical device} for the layers the strategy places."""
        names = [u.name for u in units]
        if not units:
            return {}
        if self._placement == "balanced":
            return plan.balanced_placement(costs, self.devices, by=self._balance_by)
        if isinstance(self._placement, dict):
            return plan.check_placement(
                {name: self._canonical(device, name) for name, device in self._placement.items()},
                names, self.devices)
        device_of = {}
        for unit in units:
            try:
                device = self._placement(unit)
            except Exception as error:  # The user's function: report which layer.
                raise PlacementError(
                    f"The placement function failed for layer {unit.name!r} "
                    f"({type(unit).__name__}): {error}") from error
            device_of[unit.name] = self._canonical(device, unit.name)
        return plan.check_placement(device_of, names, self.devices)

    def _canonical(self, device, layer_name):
        if not isinstance(device, str) or not device:
            raise PlacementError(
                f"Layer {layer_name!r} cannot be placed: its device must be a device name "
                f"such as '/cpu:1', one of {', '.join(self._display.values())}. "
                f"Received: {device!r}")
        try:
            canonical = placement_lib.canonical_device(device)
        except (ValueError, TypeError) as error:
            raise PlacementError(
                f"Layer {layer_name!r} is placed on malformed device {device!r}: use a name "
                f"like '/cpu:0' or '/gpu:1'.") from error
        if canonical not in self.devices:
            raise PlacementError(
                f"Layer {layer_name!r} is placed on {device!r}, which is not one of the "
                f"strategy's devices: {', '.join(self._display.values())}. Add it to "
                f"ModelParallelStrategy(devices=...) or place the layer elsewhere.")
        return canonical

    def _name(self, canonical):
        return self._display.get(canonical, canonical)

    def _optimizer_slots(self, model):
        optimizer = getattr(model, "optimizer", None)
        optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer
        if optimizer is not None:
            try:
                return plan.optimizer_slots(
                    type(optimizer).__name__, momentum=_number(optimizer, "momentum"),
                    centered=bool(getattr(optimizer, "centered", False)),
                    amsgrad=bool(getattr(optimizer, "amsgrad", False)))
            except PlacementError:
                pass  # A custom optimizer: fall back to the hint.
        return _DEFAULT_SLOTS if self._slots_hint is None else self._slots_hint

    def _check_memory(self, report):
        """Raises if the plan puts more estimated bytes on a device than memory_limit (run
        before any variable of the model has storage on the strategy's devices)."""
        if self._memory_limit is None:
            return
        limit = plan.format_bytes(self._memory_limit)
        alone = [layer for layer in report.layers if layer.total_bytes > self._memory_limit]
        if alone:
            raise PlacementError(
                "No placement fits memory_limit=" + limit + ": "
                + ", ".join(f"layer {layer.name!r} alone needs "
                            f"{plan.format_bytes(layer.total_bytes)} (weights "
                            f"{plan.format_bytes(layer.weight_bytes)}, optimizer state "
                            f"{plan.format_bytes(layer.optimizer_bytes)}, activations "
                            f"{plan.format_bytes(layer.activation_bytes)})" for layer in alone)
                + f", and a layer lives on one device. Use a smaller batch_size (now "
                f"{self._batch_size}), an optimizer that keeps less state, or smaller layers."
                f"\n{report}")
        over = {d: t.bytes for d, t in report.totals.items() if t.bytes > self._memory_limit}
        if over:
            total = sum(t.bytes for t in report.totals.values())
            raise PlacementError(
                f"The placement needs more than memory_limit="
                f"{plan.format_bytes(self._memory_limit)} on "
                + ", ".join(f"{d} ({plan.format_bytes(b)})" for d, b in over.items())
                + f". The model needs {plan.format_bytes(total)} in all, at least "
                f"{math.ceil(total / self._memory_limit)} devices' worth. Use more devices, a "
                f"smaller batch_size, or a placement that evens out the bytes "
                f"(placement='balanced', balance_by='bytes').\n{report}")


@dataclasses.dataclass(frozen=True)
class PlacementReport:
    """Where each layer lives and the estimated bytes each device holds.

    `layers` are `LayerCost` records in model order, `placement` maps layer names
    to devices. `str(report)` is a plain-text table.
    """

    layers: tuple
    placement: dict
    devices: tuple

    @property
    def totals(self):
        """{device: DeviceTotal(layers, params, bytes)}."""
        return plan.device_totals(self.layers, self.placement, self.devices)

    @property
    def imbalance(self):
        """How far the fullest device is above an even split: 0.1 is 10%."""
        return plan.imbalance(self.totals)

    def __str__(self):
        return plan.format_report(self.layers, self.placement, self.devices)


@internals.overrides
class _ModelParallelExtended(tf_runtime.one_device_extended()):
    """One replica on the first device; variables on the device of their layer."""

    def __init__(self, container_strategy, devices):
        super().__init__(container_strategy, devices[0])
        # id(tf.Variable of an optimizer slot) -> weak refs to it and to the variable
        # it was colocated with, so that placing a model can move the slot too.
        self._colocated, self._colocated_alive = {}, 0

    def _create_variable(self, next_creator, **kwargs):
        colocate_with = kwargs.get("colocate_with")
        if colocate_with is None:
            kwargs.pop("colocate_with", None)
            home = variable_birth.current_variable_home()  # Where tfpar says it is born.
            with tf.device(home[0] if home else tf_runtime.one_device(self)):
                return next_creator(**kwargs)
        variable = super()._create_variable(next_creator, **kwargs)
        if isinstance(colocate_with, tf.Variable):
            if len(self._colocated) >= 2 * self._colocated_alive + 1024:  # Forget the dead.
                self._colocated = {k: v for k, v in self._colocated.items() if v[0]()}
                self._colocated_alive = len(self._colocated)
            # Weak: a moved variable's old copy must be freed.
            self._colocated[id(variable)] = (weakref.ref(variable), weakref.ref(colocate_with))
        return variable

    def _update(self, var, fn, args, kwargs, group):
        # Optimizer updates run where the variable lives, not on the first device.
        with tf.device(var.device), tf_runtime.update_context(tf_runtime.one_device(self)):
            result = fn(var, *args, **kwargs)
            return result if group else tf.nest.map_structure(
                lambda value: tf_runtime.local_results(self, value), result)

    def _move_optimizer_state(self, optimizer, moved):
        """Moves optimizer state already built for moved variables next to them."""
        if optimizer is None or not moved:
            return
        for variable in getattr(optimizer, "variables", ()):
            value = models.storage(variable)
            slot, colocated = self._colocated.get(id(value), (lambda: None, lambda: None))
            if slot() is value and colocated() is not None and id(colocated()) in moved:
                placement_lib.move_variable(variable, moved[id(colocated())][1])


def _wrap_call(layer, device):
    """Makes `layer.call` run through `placed_call` on `device` (re-wrapping is fine)."""
    original = layer.__dict__.get("_tfpar_original_call") or layer.call
    # Bound methods, not closures: a deep copy of the layer then calls its own copy.
    # object.__setattr__: Keras would track these attributes as layer state.
    object.__setattr__(layer, "_tfpar_original_call", original)
    object.__setattr__(layer, "_tfpar_device", device)
    keras_hooks.patch_object(layer, "call", types.MethodType(_placed_layer_call, layer))


def _placed_layer_call(layer, *args, **kwargs):
    call = layer._tfpar_original_call
    if xla_calls.compiling_layers():  # jit_compile=True: the layer compiled where it runs.
        original = call

        def call(*args, **kwargs):
            return xla_calls.layer_call(layer, original, args, kwargs)
    return placement_lib.placed_call(call, layer._tfpar_device, *args, **kwargs)


def _layer_costs(layers, slots, batch_size, timing_device=None):
    costs = []
    for layer in layers:
        weights = layer.weights
        trainable = {id(w) for w in layer.trainable_weights}
        params = sum(_size(w) for w in weights)
        weight_bytes = sum(_size(w) * _dtype_bytes(w.dtype) for w in weights)
        slot_bytes = slots * sum(_size(w) * _dtype_bytes(w.dtype) for w in weights
                                 if id(w) in trainable)
        activation_bytes = models.output_elements(layer) * batch_size * _dtype_bytes(
            layer.compute_dtype)
        seconds = (layer_timing.layer_seconds(layer, batch_size, timing_device)
                   if timing_device else 0.0)
        costs.append(plan.LayerCost(layer.name, params, weight_bytes, slot_bytes,
                                    activation_bytes, seconds))
    return costs


def _size(variable):
    return int(math.prod(int(d) for d in variable.shape))


def _dtype_bytes(dtype):
    return tf.as_dtype(dtype).size


def _timing_device(devices, placement, balance_by):
    """Where balance_by='time' runs the layers: a CPU that is none of the strategy's
    devices (a device of the strategy would hold variables that later move away)."""
    if balance_by != "time" or placement != "balanced":
        return None
    return layer_timing.timing_device(devices, "balance_by='bytes' or 'params'")


def _number(obj, name):
    value = getattr(obj, name, 0.0)
    try:
        return float(value or 0.0)
    except (TypeError, ValueError):
        return 0.0


def _check_placement_arg(placement):
    if placement == "balanced" or callable(placement):
        return placement
    if isinstance(placement, dict):
        return dict(placement)
    raise PlacementError(
        f"placement must be 'balanced', a dict {{layer name: device}} or a callable "
        f"layer -> device. Received: {placement!r}")


def _check_optimizer_hint(optimizer):
    if optimizer is None:
        return None
    if isinstance(optimizer, int) and not isinstance(optimizer, bool) and optimizer >= 0:
        return optimizer
    if isinstance(optimizer, str):
        return plan.optimizer_slots(optimizer)
    raise PlacementError(
        f"optimizer must be an optimizer name such as 'adam' or a number of state copies "
        f"per weight. Received: {optimizer!r}")

