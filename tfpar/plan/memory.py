"""Memory per device before anything is built (the advisor that picks a layout from it
is `tfpar.plan.advisor`).

Pure Python. A model is described by its number of parameters, or better by the
size (elements) of each trainable variable in model order, or by its layers
(`LayerCost`: parameters and the activation bytes each keeps). Per device, training
holds weights, gradients, optimizer state (`optimizer_slots` copies of each
variable), the activations kept for the backward pass, and the optimizer update's
temporaries: (slots + 1) x the largest variable the device updates (measured on TF 2.21
for one 25M-value variable: beyond the state held, a Keras Adam step peaked at the
gradient and 3 copies of the variable, SGD with momentum at the gradient and 2; plain
SGD's 0.3 copy is not counted: no slots, no update term).

ZeRO shards whole variables: each has one owner replica (`sharding.owners`). With
P parameters, owned(r) those of replica r, L the largest variable, d bytes per value
and s slots:

    stage   weights     gradients   optimizer     gather buffer   update
    0       d*P         d*P         d*s*P         -               d*(s+1)*L
    1       d*P         d*P         d*s*owned(r)  -               d*(s+1)*min(L, owned(r))
    2       d*P         d*owned(r)  d*s*owned(r)  -               d*(s+1)*min(L, owned(r))
    3       d*owned(r)  d*owned(r)  d*s*owned(r)  d*L             d*(s+1)*min(L, owned(r))

With Adam (s=2), fp32 (d=4) and owned(r) = P/N the first three columns are 16,
8 + 8/N, 4 + 12/N and 16/N bytes per parameter (the paper's figures); the update adds
4 x 3 = 12 bytes per value of the largest variable a replica updates (0 when s = 0).
A pipeline (or model-parallel) device holds the state of its stage's variables and
updates them (the update's temporaries: its stage's largest variable); every kind keeps
its activations (ZeRO does not shard them; stages split a total evenly, or hold their
own layers' when layers are given). Under tensor parallelism (T) each variable of a
stage is divided over T devices.
"""

import collections.abc
import dataclasses
import functools
import math
import numbers

from tfpar.contract import hooks_of
from tfpar.plan import sharding
from tfpar.plan.placement import (LayerCost, _table, balanced_placement,
                                  format_bytes)
from tfpar.plan import placement

KINDS = ("data", "sharded", "pipeline", "model")
_SPLIT_KINDS = ("pipeline", "model")  # Cut the model into stages instead of replicating it.


def _count(name, value, minimum=0):
    """`value` as an int if it is a whole number >= `minimum` (1.3e9 is), else a ValueError."""
    whole = isinstance(value, numbers.Integral) or (
        isinstance(value, numbers.Real) and float(value).is_integer())
    if isinstance(value, bool) or not whole or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}. Received: {name}={value!r}")
    return int(value)


def _even(total, parts):
    """`total` split into `parts` whole numbers that differ by at most one."""
    return [total // parts + (r < total % parts) for r in range(parts)]


@dataclasses.dataclass(frozen=True)
class _Variables:
    total: int
    largest: int
    sizes: tuple = None  # None: only the total is known, taken as evenly divisible.
    # Per unit (a layer given as a LayerCost): the bytes its output keeps for the backward
    # pass at one model copy's batch. None: only `activation_bytes` in total is known.
    activations: tuple = None
    # Per unit: True where a tensor-parallel layout leaves it whole (it then runs on the
    # first device of its stage's group). None: every unit is split.
    whole: tuple = None

    @property
    def activation_total(self):
        return sum(self.activations) if self.activations else 0

    def per_owner(self, num_replicas):
        """Parameters owned by each replica under ZeRO."""
        if self.sizes is None:
            return _even(self.total, num_replicas)
        owner_of = sharding.owners(self.sizes, num_replicas)
        return sharding.shard_sizes(self.sizes, owner_of, num_replicas)

    def _stage_of(self, num_stages):
        layers = [LayerCost(str(i), size, 0, 0, 0) for i, size in enumerate(self.sizes)]
        stage_of = balanced_placement(layers, list(range(num_stages)), by="params")
        return [stage_of[str(i)] for i in range(len(self.sizes))]

    def per_stage(self, num_stages):
        """Parameters of each of `num_stages` contiguous, balanced stages."""
        return [stage.total for stage in self.stages(num_stages)]

    @functools.lru_cache(maxsize=64)  # The advisor asks for the same cuts again and again.
    def stages(self, num_stages):
        """The variables of each of `num_stages` contiguous, balanced stages (cut by
        parameters, as PipelineStrategy's default), each a `_Variables`."""
        if self.sizes is None:
            return [_Variables(p, min(p, self.largest)) for p in _even(self.total, num_stages)]
        stage_of = self._stage_of(num_stages)
        units = [[i for i, s in enumerate(stage_of) if s == stage] for stage in range(num_stages)]
        return [_Variables(sum(self.sizes[i] for i in u), max(self.sizes[i] for i in u),
                           tuple(self.sizes[i] for i in u),
                           tuple(self.activations[i] for i in u) if self.activations else None,
                           tuple(self.whole[i] for i in u) if self.whole else None)
                for u in units]

    def split(self, tensor_parallel):
        """What each of `tensor_parallel` devices holds (a list, one per rank): each split
        variable divided over them (rounded up), as a LayoutMap's column or row split does;
        a unit the layout leaves `whole` only on rank 0, as PipelineStrategy runs it.
        Activations stay whole (counted on every device of the group: Megatron splits only
        those inside a column-then-row pair, so this is on the safe side)."""
        t = tensor_parallel
        if t == 1:
            return [self]
        if self.sizes is None:
            return [_Variables(-(-self.total // t), -(-self.largest // t))] * t
        whole = self.whole or (False,) * len(self.sizes)
        ranks = []
        for rank in range(t):
            sizes = tuple(size if kept and rank == 0 else 0 if kept else -(-size // t)
                          for size, kept in zip(self.sizes, whole))
            ranks.append(_Variables(sum(sizes), max(sizes), sizes, self.activations))
        return ranks


def _variables(spec, largest_variable=None):
    """Normalizes a model description: a total, per-variable sizes, per-layer `LayerCost`s
    (their params and activation_bytes), or a built Keras model."""
    if hasattr(spec, "trainable_weights"):  # A Keras model, read without importing Keras.
        spec = [math.prod(w.shape) for w in spec.trainable_weights]
        if not spec:
            raise ValueError("The model has no trainable weights: build it first (give it a "
                             "keras.Input or call it on a batch).")
    if isinstance(spec, numbers.Real):
        total = _count("num_params", spec, 1)
        largest = _count("largest_variable", largest_variable or 0)
        if largest > total:
            raise ValueError(f"largest_variable ({largest}) cannot exceed the number of "
                             f"parameters ({total}).")
        return _Variables(total, largest)
    if isinstance(spec, (str, bytes)) or not isinstance(spec, collections.abc.Iterable):
        raise TypeError(
            f"Describe the model by its number of parameters, the number of elements of each "
            f"variable (a list of ints), its layers (a list of tfpar.plan.placement.LayerCost) "
            f"or a built Keras model. Received: {spec!r}")
    if largest_variable is not None:
        raise ValueError("largest_variable is for a model given by its total only: the list "
                         "of variable sizes already says which is largest. Drop it.")
    spec = list(spec)
    layers = [isinstance(unit, LayerCost) for unit in spec]
    activations = None
    if any(layers):
        if not all(layers):
            raise TypeError("Describe the model by variable sizes or by LayerCost layers, "
                            "not a mix of both.")
        activations = tuple(_count(f"layers[{i}].activation_bytes", layer.activation_bytes)
                            for i, layer in enumerate(spec))
        whole = tuple(not layer.tensor_split for layer in spec)
        spec = [layer.params for layer in spec]
    sizes = tuple(_count(f"sizes[{i}]", size) for i, size in enumerate(spec))
    if not sum(sizes):
        raise ValueError(f"The model needs at least one parameter. Received sizes: {list(sizes)}")
    return _Variables(sum(sizes), max(sizes), sizes, activations,
                      whole if activations is not None and any(whole) else None)


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """How training is spread: `kind` is one of `KINDS`, `shard` a ZeRO stage's name.
    `optimizer_slots` (s): state copies per variable (Adam 2, SGD with momentum 1, SGD
    0); updating a variable also holds s + 1 temporaries of its size, counted for the
    largest variable a device updates (none when s = 0). `dtype_bytes`: bytes per value.

    For "pipeline" and "model", `num_devices` counts the stages of one model copy;
    a pipeline has `num_replicas` copies, and with `shard` each stage's state is divided
    over the stage's `num_replicas` devices as ZeRO divides it over replicas (DeepSpeed's
    pipeline with ZeRO).
    `activation_bytes` is what one copy of the whole model keeps for the backward
    pass at its batch (per replica for data parallelism). `reshard_after_forward`
    (stage 3): a layer's gathered weights are freed after its forward pass and gathered
    again for its backward, so one variable is gathered at a time; False keeps every
    gathered weight from the forward to the backward pass. `gradient_window_bytes`
    (stages 1-2 across workers on CPUs): each gradient goes to its owner as the backward
    pass makes it, which waits once this many bytes are in flight, so a replica holds
    about that and two of the largest variable's gradients instead of the stage's share
    (0: the stage's share). `input_bytes` is one batch of inputs and targets of one model
    copy (per replica for data parallelism); the device that takes them (every replica,
    a split model's first device) holds `input_copies` such batches at once: measured
    on CPU workers, 4 (the batch in use, the one arriving, two prefetched), the
    default. `tensor_parallel` (T, kind "pipeline"; num_devices=1 for none): each stage's
    variables split over T devices of one host (Megatron's tensor parallelism), the
    stage's activations and inputs whole on each; R x K x T devices in all.

    >>> MemoryConfig("sharded", 8, shard="gradients").stage
    2
    """

    kind: str
    num_devices: int
    shard: str = None
    optimizer_slots: int = 2
    dtype_bytes: int = 4
    activation_bytes: int = 0
    reshard_after_forward: bool = True
    gradient_window_bytes: int = 0
    num_replicas: int = 1
    input_bytes: int = 0
    input_copies: int = 4
    tensor_parallel: int = 1

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(map(repr, KINDS))}. "
                             f"Received: kind={self.kind!r}")
        for name, minimum in (("num_devices", 1), ("optimizer_slots", 0), ("dtype_bytes", 1),
                              ("activation_bytes", 0), ("gradient_window_bytes", 0),
                              ("num_replicas", 1), ("input_bytes", 0), ("input_copies", 0),
                              ("tensor_parallel", 1)):
            object.__setattr__(self, name, _count(name, getattr(self, name), minimum))
        stage = sharding.check_shard(self.shard)
        if self.kind == "model" and stage:
            raise ValueError(
                f"shard={self.shard!r} shards the state of replicas; kind='model' is one copy "
                f"of the model split over devices. Use kind='sharded', kind='pipeline' with "
                f"num_replicas (each stage's state sharded over its replicas), or shard=None.")
        if self.num_replicas > 1 and self.kind != "pipeline":
            raise ValueError(
                f"num_replicas counts the copies of a pipeline; for kind={self.kind!r} the "
                f"replicas are num_devices. Received: num_replicas={self.num_replicas}")
        if self.tensor_parallel > 1 and self.kind != "pipeline":
            raise ValueError(
                f"tensor_parallel splits each stage of a pipeline over devices; use "
                f"kind='pipeline' (num_devices=1 for tensor parallelism without a pipeline). "
                f"Received: kind={self.kind!r}, tensor_parallel={self.tensor_parallel}")
        if self.kind == "sharded" and not stage:
            raise ValueError("kind='sharded' needs shard='optimizer', 'gradients' or "
                             "'parameters'. For no sharding use kind='data'.")

    @property
    def stage(self):
        """The ZeRO stage, 0 when nothing is sharded."""
        return sharding.STAGES[self.shard]

    def strategy(self, num_replicas=1):
        """The tfpar strategy this config describes, as code.

        >>> MemoryConfig("pipeline", 4).strategy(num_replicas=2)
        'PipelineStrategy(num_stages=4, num_replicas=2)'
        >>> MemoryConfig("pipeline", 2, shard="optimizer", num_replicas=2).strategy()
        "PipelineStrategy(num_stages=2, num_replicas=2, shard='optimizer')"
        >>> MemoryConfig("pipeline", 2, tensor_parallel=4).strategy()
        'PipelineStrategy(num_stages=2, num_replicas=1, tensor_parallel=4)'
        """
        if self.kind == "pipeline":
            shard = f", shard={self.shard!r}" if self.shard else ""
            tensor = (f", tensor_parallel={self.tensor_parallel}"
                      if self.tensor_parallel > 1 else "")
            return (f"PipelineStrategy(num_stages={self.num_devices}, "
                    f"num_replicas={max(num_replicas, self.num_replicas)}{tensor}{shard})")
        if self.kind == "model":
            return "ModelParallelStrategy()"
        return f"DataParallelStrategy({f'shard={self.shard!r}' if self.shard else ''})"


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Bytes one device holds for training; `total` is their sum, its peak: the state,
    activations and inputs held across the step, plus what only part of the step holds
    (the gather buffer, the optimizer update's temporaries).

    >>> DeviceMemory(weights=400, gradients=400, optimizer=800, activations=100).total
    1700
    >>> DeviceMemory(400, 400, 800, 100, update=4 * 3 * 60).total  # Adam, largest 60
    2420
    """

    weights: int
    gradients: int
    optimizer: int
    activations: int
    gather_buffer: int = 0  # ZeRO stage 3: a variable gathered from its owner to be used.
    inputs: int = 0  # Batches of input data held at once.
    # The optimizer update's temporaries: (slots + 1) x the largest variable it updates,
    # beside that variable's gradient (measured on TF 2.21 for one 25M-value variable:
    # Adam 3x, SGD with momentum 2x, plain SGD 0.3x), none without slots.
    update: int = 0

    @property
    def total(self):
        return (self.weights + self.gradients + self.optimizer + self.activations
                + self.gather_buffer + self.inputs + self.update)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-device memory of one config; `devices` are replicas, or stages in order (a
    pipeline's replicas one after another: replica r's stage s at r * K + s).

    Four variables of 250, Adam: 16 bytes per parameter of state, and the update's
    temporaries of the largest variable, 4 x 3 x 250.

    >>> e = estimate_memory([250] * 4, MemoryConfig("data", 2))
    >>> e.peak, e.devices[0].update, (e.peak - e.devices[0].update) / e.num_params
    (19000, 3000, 16.0)
    """

    config: MemoryConfig
    num_params: int
    devices: tuple

    @property
    def peak(self):
        """Bytes on the fullest device: the one that must fit."""
        return max(d.total for d in self.devices)

    def format(self):
        """A plain-text table of each device's bytes."""
        rows = [[i] + [format_bytes(b) for b in (d.weights, d.gradients, d.optimizer,
                                                 d.activations, d.gather_buffer, d.inputs,
                                                 d.update, d.total)]
                for i, d in enumerate(self.devices)]
        return "\n".join(
            [f"{self.config.strategy()}: {self.num_params:,} parameters, peak "
             f"{format_bytes(self.peak)} per device ({self.peak / self.num_params:.2f} B/param)"]
            + _table(["device", "weights", "gradients", "optimizer", "activations", "gather",
                      "inputs", "update", "total"], rows)) + "\n"


def _device(config, weights, gradients, optimizer, activations, gathered=0, inputs=True,
            largest=0):
    """Bytes of a device holding these numbers of values (and the input batches if
    `inputs`) that updates variables of at most `largest` values."""
    d, slots = config.dtype_bytes, config.optimizer_slots
    return DeviceMemory(d * weights, d * gradients, d * slots * optimizer,
                        activations, d * gathered,
                        config.input_bytes * config.input_copies if inputs else 0,
                        d * (slots + 1) * largest if slots else 0)


def _gathered(variables, config, owned):
    """Values a stage-3 replica holds gathered from other owners at once."""
    if config.stage != 3:
        return 0
    return variables.largest if config.reshard_after_forward else variables.total - owned


def _gradients(variables, config, owned):
    """Gradient values a replica holds at once under data parallelism or ZeRO."""
    share = variables.total if config.stage < 2 else owned
    if not config.gradient_window_bytes or config.stage not in (1, 2):
        return share
    in_flight = -(-config.gradient_window_bytes // config.dtype_bytes) + 2 * variables.largest
    return min(share, in_flight)


def _replicas(variables, config, num_replicas, activations, inputs=True):
    """Each of `num_replicas` replicas holding `variables` (ZeRO-sharded over them under
    `config.shard`), `activations` bytes and, if `inputs`, the input batches. Without ZeRO
    every replica updates every variable; under ZeRO only those it owns, so the largest it
    updates is at most `owned` values."""
    full, stage = variables.total, config.stage
    return [_device(config, full if stage < 3 else owned,
                    _gradients(variables, config, owned), full if stage < 1 else owned,
                    activations, _gathered(variables, config, owned), inputs,
                    variables.largest if stage < 1 else min(variables.largest, owned))
            for owned in variables.per_owner(num_replicas)]


def _estimate(variables, config):
    if config.kind in _SPLIT_KINDS:
        # Device (replica r, stage s, tensor rank t) at (r * K + s) * T + t, as
        # PipelineStrategy.stage_devices (T = 1 without tensor parallelism).
        t = config.tensor_parallel
        # columns[s][rank][r]: stage s's tensor-parallel rank `rank` in replica r.
        columns = [[_replicas(held, config, config.num_replicas, a + stage.activation_total,
                              inputs=s == 0) for held in stage.split(t)]
                   for s, (stage, a) in enumerate(zip(
                       variables.stages(config.num_devices),
                       _even(config.activation_bytes, config.num_devices)))]
        devices = [column[rank][r] for r in range(config.num_replicas) for column in columns
                   for rank in range(t)]
    else:
        devices = _replicas(variables, config, config.num_devices,
                            config.activation_bytes + variables.activation_total)
    return MemoryEstimate(config, variables.total, tuple(devices))


def estimate_memory(model_or_spec, strategy_or_config, largest_variable=None):
    """Returns the `MemoryEstimate` of training a model under a `MemoryConfig`.

    Args:
      model_or_spec: the number of parameters; the number of elements of each trainable
        variable, in model order (exact ZeRO owners and stage cuts); or a built Keras model.
      strategy_or_config: a `MemoryConfig`, or a tfpar strategy (then the slots are those
        of the model's compiled optimizer).
      largest_variable: with a number of parameters only, the elements of the largest
        variable (ZeRO stage 3 gathers it; the optimizer update's temporaries are its
        size); unknown counts as 0.

    Each device's total counts its weights, gradients, optimizer state, activations,
    input batches, gather buffer and the optimizer update's temporaries (`DeviceMemory`).
    Eight equal variables, Adam, 4 replicas, ZeRO stage 1: 8 + 8/4 bytes per parameter,
    and the update of a 100-value variable, 4 x (2 + 1) x 100 bytes.

    >>> config = MemoryConfig("sharded", 4, shard="optimizer")
    >>> device = estimate_memory([100] * 8, config).devices[0]
    >>> (device.total - device.update) / 800, device.update
    (10.0, 1200)
    """
    config = strategy_or_config
    describe = hooks_of(config)._tfpar_memory_config  # A tfpar strategy.
    if describe is not None:
        config = describe(optimizer_slots=compiled_optimizer_slots(model_or_spec))
    if not isinstance(config, MemoryConfig):
        raise TypeError(
            f"Pass a tfpar strategy or a MemoryConfig, e.g. MemoryConfig('sharded', "
            f"num_devices=8, shard='optimizer'). Received: {strategy_or_config!r}")
    return _estimate(_variables(model_or_spec, largest_variable), config)


def compiled_optimizer_slots(model):
    """The state copies per variable of a compiled Keras model's optimizer; 2 (Adam's)
    when there is none."""
    optimizer = getattr(model, "optimizer", None)
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # Loss scaling adds none.
    if optimizer is None:
        return 2
    return placement.optimizer_slots(
        type(optimizer).__name__, momentum=getattr(optimizer, "momentum", 0),
        centered=getattr(optimizer, "centered", False),
        amsgrad=getattr(optimizer, "amsgrad", False))
