"""The advisor: data x pipe x model degrees (and a ZeRO stage) that fit the devices' memory
with the least communication. Pure Python.

Every layout of N devices as R (data) x K (pipeline stages) x T (tensor parallel) is
estimated with `memory.estimate_memory`'s own arithmetic (per device: weights, gradients,
optimizer state, activations, inputs, the gather buffer and the optimizer update's
temporaries), and the first whose fullest device fits in this order is chosen
(Megatron-LM's and DeepSpeed's order of preference):

1. data parallelism (a full copy per device: one all-reduce of the gradients);
2. ZeRO stage 1, then 2 (the same traffic as the all-reduce, less memory);
3. on one host, ZeRO stage 3 (1.5x the traffic), then pipelines of K = 2, 3, ... stages
   over R = N / K replicas, each with ZeRO stage 0, 1, 2 over its replicas (fewer stages:
   a smaller bubble), then pipelines with ZeRO stage 3; across hosts the pipelines come
   before ZeRO stage 3 (stages cross hosts with one activation per micro-batch; stage 3
   gathers every weight over the hosts' links);
4. only when none of those fits (a layer whose state and update are too big for one
   stage): tensor parallelism over T = 2, 4, ... devices of one host (T divides the
   devices per host: its all-reduces run at every layer pair), with as few stages as fit.

Devices are numbered (r * K + s) * T + t: a tensor-parallel group is T consecutive
devices, inside one host. Tensor parallelism without a pipeline is named as a one-stage
`PipelineStrategy(num_stages=1, tensor_parallel=T)`.
"""

import dataclasses
import itertools
import math

from tfpar.plan import communication, sharding
from tfpar.plan.memory import MemoryConfig, MemoryEstimate, _count, _estimate, _variables
from tfpar.plan.placement import format_bytes


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes the busiest device sends per step along each axis (`communication`'s formulas);
    None where the layer outputs are unknown."""

    data: float
    pipe: float
    model: float

    @property
    def total(self):
        return self.data + (self.pipe or 0) + (self.model or 0)


@dataclasses.dataclass(frozen=True)
class Option:
    """One layout: its strategy, degrees, memory per device, traffic and whether it fits.

    Examples:
        >>> [(o.name, o.bytes_per_device, o.fits) for o in advise(1000, 4, 5000).options[2:4]]
        [('ZeRO stage 2', 7000, False), ('ZeRO stage 3', 4000, True)]
    """

    name: str  # "data parallel", "ZeRO stage 2", "pipeline, 4 stages"
    strategy: str
    stage: int  # The ZeRO stage (0: none) of data parallelism; None with pipe or model > 1.
    degree: int  # Replicas sharing the state (data parallel, ZeRO), or pipeline stages.
    estimate: MemoryEstimate
    fits: bool
    data: int = 1
    pipe: int = 1
    model: int = 1
    zero: int = 0
    traffic: Traffic = None

    @property
    def bytes_per_device(self):
        return self.estimate.peak

    @property
    def config(self):
        """The `MemoryConfig` estimated (`estimate_memory(model, option.config)`)."""
        return self.estimate.config

    @property
    def degrees(self):
        return f"{self.data} x {self.pipe} x {self.model}"


@dataclasses.dataclass(frozen=True)
class Advice:
    """The layout chosen (None: nothing fits) as data x pipe x model degrees and a ZeRO
    stage, the layouts considered in order of preference (`candidates`), the single
    strategies among them (`options`: data parallel, ZeRO 1-3, the pipeline), and why.

    >>> a = advise(1000, 4, 10_000)
    >>> a.strategy, a.stage, a.degree, [o.bytes_per_device for o in a.options]
    ("DataParallelStrategy(shard='optimizer')", 1, 4, [16000, 10000, 7000, 4000, 8000])
    >>> a.data, a.pipe, a.model, a.zero
    (4, 1, 1, 1)
    """

    budget: int
    options: tuple
    chosen: Option = None
    notes: tuple = ()
    candidates: tuple = ()
    hosts: int = 1
    # The state of the largest variable (or layer) and its update's temporaries: what a
    # device holding it whole needs for it alone.
    largest_layer_bytes: int = 0

    def _of_chosen(self, name):
        return getattr(self.chosen, name) if self.chosen else None

    strategy = property(lambda self: self._of_chosen("strategy"))
    stage = property(lambda self: self._of_chosen("stage"))
    degree = property(lambda self: self._of_chosen("degree"))
    data = property(lambda self: self._of_chosen("data"))
    pipe = property(lambda self: self._of_chosen("pipe"))
    model = property(lambda self: self._of_chosen("model"))
    zero = property(lambda self: self._of_chosen("zero"))

    @property
    def closest(self):
        """The layout needing the least memory per device (when nothing fits, the smallest
        shortfall)."""
        return min(self.candidates, key=lambda o: o.bytes_per_device)

    @property
    def shortfall(self):
        """Bytes per device missing for the closest layout (0 when one fits)."""
        return 0 if self.chosen else self.closest.bytes_per_device - self.budget

    def explain(self):
        """The layouts tried in order against the budget (up to the chosen one), and why."""
        first = self.candidates[0].estimate
        c = first.config
        num_devices = first.config.num_devices
        lines = [f"{first.num_params:,} parameters, {c.dtype_bytes} B per value, "
                 f"{_plural(c.optimizer_slots, 'optimizer slot')}, activations "
                 f"{format_bytes(c.activation_bytes + _layer_activations(first))} per model "
                 f"copy; {_plural(num_devices, 'device')} of {format_bytes(self.budget)} on "
                 f"{_plural(self.hosts, 'host')} (data x pipe x model, bytes per device, "
                 f"bytes sent per step by the busiest device):"]
        shown = (self.candidates[:self.candidates.index(self.chosen) + 1] if self.chosen
                 else self.candidates)
        widths = [max(len(getattr(o, name)) for o in shown)
                  for name in ("name", "strategy", "degrees")]
        for o in shown:
            verdict = ("fits" if o.fits else
                       f"over by {format_bytes(o.bytes_per_device - self.budget)}")
            lines.append(f"  {o.name:<{widths[0]}}  {o.strategy:<{widths[1]}}  "
                         f"{o.degrees:<{widths[2]}}  {format_bytes(o.bytes_per_device):>10}  "
                         f"{_traffic(o.traffic):>10}  {verdict}"
                         f"{'  <- chosen' if o is self.chosen else ''}")
        if self.chosen and len(shown) < len(self.candidates):
            more = _plural(len(self.candidates) - len(shown), "more layout")
            lines.append(f"  ({more}, each with more communication, not needed)")
        degrees = (f"Degrees: data={self.data} pipe={self.pipe} model={self.model} "
                   f"zero={self.zero} -> {self.strategy}" if self.chosen else
                   "Degrees: none fits")
        return "\n".join(lines + [self._reason()] + list(self.notes) + [degrees]) + "\n"

    def _reason(self):
        chosen = self.chosen
        if chosen is None:
            best = self.closest
            return (f"Does not fit: nothing considered fits {format_bytes(self.budget)} per "
                    f"device. The smallest shortfall is {best.name} ({best.strategy}, data x "
                    f"pipe x model {best.degrees}): {format_bytes(best.bytes_per_device)} per "
                    f"device, over by {format_bytes(self.shortfall)}."
                    f"{_zero3_hint(self.options[3].estimate, self.budget)} Use more devices, "
                    f"fewer bytes per value (dtype_bytes), an optimizer with fewer slots, or a "
                    f"smaller batch per model copy (activations).")
        if chosen is self.candidates[0]:
            return (f"Chosen: {chosen.strategy}: a full replica fits, nothing needs sharding "
                    f"(one all-reduce of the gradients, the least communication).")
        before = self.candidates[self.candidates.index(chosen) - 1]
        if chosen.pipe == 1 and chosen.model == 1:
            return (f"Chosen: {chosen.name}, the least sharding that fits ({before.name} needs "
                    f"{format_bytes(before.bytes_per_device)}); each further stage communicates "
                    f"more, and stage 3 gathers every variable before using it.")
        if chosen.model == 1:
            activations = chosen.config.activation_bytes + _layer_activations(chosen.estimate)
            of_which = (f" Of that, {format_bytes(activations)} are activations, which ZeRO "
                        f"does not shard." if activations else "")
            zero = (f" ZeRO stage {chosen.zero} shards each stage's state over its "
                    f"{chosen.data} replicas." if chosen.zero else "")
            return (f"Chosen: {chosen.name}, the fewest stages that fit (fewer stages, smaller "
                    f"bubble): even {before.name} needs {format_bytes(before.bytes_per_device)} "
                    f"per device.{of_which} A pipeline splits weights, state and activations "
                    f"over its stages, sending one activation per micro-batch between them."
                    f"{zero}")
        closest = min((o for o in self.candidates if o.model == 1),
                      key=lambda o: o.bytes_per_device)
        over = (" (over the budget: no pipeline stage can hold it)"
                if self.largest_layer_bytes > self.budget else "")
        return (f"Chosen: {chosen.name}: no layout without tensor parallelism fits (the "
                f"closest, {closest.name}, needs {format_bytes(closest.bytes_per_device)}). The "
                f"largest layer's state and update alone need "
                f"{format_bytes(self.largest_layer_bytes)}{over};"
                f" tensor parallelism splits every layer over {chosen.model} devices of one "
                f"host, at the cost of two all-reduces of the activation per layer pair per "
                f"micro-batch, so it stays inside a host. The layout tried just before, "
                f"{before.name}, needs {format_bytes(before.bytes_per_device)}.")


def _plural(n, noun):
    return f"{n} {noun}{'s' * (n != 1)}"


def _traffic(traffic):
    if traffic is None:
        return ""
    unknown = traffic.pipe is None or traffic.model is None
    return f"{format_bytes(round(traffic.total))}{'+?' if unknown else ''}"


def _layer_activations(estimate):
    """Activations given per layer (beyond the config's total), over all stages."""
    config = estimate.config
    devices = estimate.devices
    if config.kind in ("pipeline", "model"):
        per_copy = devices[:config.num_devices * config.tensor_parallel:config.tensor_parallel]
        return sum(d.activations for d in per_copy) - config.activation_bytes
    return devices[0].activations - config.activation_bytes


def _zero3_hint(estimate, budget):
    """How many devices ZeRO stage 3 would need: only its state shrinks as 1/N (the
    update's temporaries stay those of the largest variable, on its owner)."""
    state = sum(d.weights + d.gradients + d.optimizer for d in estimate.devices)
    fixed = (estimate.devices[0].activations + estimate.devices[0].gather_buffer
             + max(d.update for d in estimate.devices))
    if fixed >= budget:
        return (f" Activations, the gather buffer and the update's temporaries alone "
                f"({format_bytes(fixed)}) are over the budget, however many devices share "
                f"the state.")
    return (f" ZeRO stage 3 would fit on about {math.ceil(state / (budget - fixed))} devices "
            f"(more with uneven variables).")


def _divisors(n):
    return [k for k in range(1, n + 1) if n % k == 0]


def _layouts(num_devices, devices_per_host, most_stages, hosts):
    """(preference key, R, K, T, ZeRO stage) of every layout, in order of preference."""
    layouts = []
    for t in _divisors(devices_per_host):
        for k in _divisors(num_devices // t):
            if k > most_stages:
                continue
            r = num_devices // (t * k)
            for z in range(4):
                if (k > 1 or t > 1) and r == 1 and z:
                    continue  # ZeRO over one replica shards nothing.
                if t > 1:
                    tier = 4
                elif k > 1:
                    tier = 3 if hosts == 1 else 2
                else:
                    tier = {0: 0, 1: 1, 2: 1, 3: 2 if hosts == 1 else 3}[z]
                layouts.append(((tier, t, z == 3, k, z), r, k, t, z))
    return sorted(layouts)


def _name(r, k, t, z):
    if k == 1 and t == 1:
        return f"ZeRO stage {z}" if z else "data parallel"
    parts = [f"pipeline, {_plural(k, 'stage')}" if k > 1 else "no pipeline"]
    if t > 1:
        parts.append(f"tensor parallel {t}")
    if z:
        parts.append(f"ZeRO stage {z}")
    return ", ".join(parts)


def _outputs(variables, activation_bytes, layer_output_bytes):
    """Each unit's output bytes at one model copy's batch (what crosses a stage boundary
    and what tensor parallelism all-reduces), or None when unknown."""
    if layer_output_bytes is not None:
        return None if variables.sizes is None else [layer_output_bytes] * len(variables.sizes)
    if variables.activations:
        return list(variables.activations)
    if variables.sizes is not None and activation_bytes:
        return [activation_bytes / len(variables.sizes)] * len(variables.sizes)
    return None


def _traffic_of(variables, outputs, r, k, t, z, dtype_bytes, layer_output_bytes):
    stages = variables.stages(k)
    gradient_bytes = dtype_bytes * max(held.total for stage in stages for held in stage.split(t))
    data = communication.data_parallel_bytes(gradient_bytes, r, z)
    if outputs is None and layer_output_bytes is None:
        return Traffic(data, None if k > 1 else 0, None if t > 1 else 0)
    if outputs is None:  # Only a total: one output size, layers per stage unknown.
        pairs = 1
        boundary = largest = layer_output_bytes
    else:
        ends = list(itertools.accumulate(len(stage.sizes) for stage in stages))
        boundary = max((outputs[end - 1] for end in ends[:-1]), default=0)
        largest = max(outputs)
        pairs = max(-(-len(stage.sizes) // 2) for stage in stages)
    pipe = communication.pipeline_bytes(boundary, k)
    model = communication.tensor_parallel_bytes(largest, t, pairs) if t > 1 else 0
    return Traffic(data, pipe, model)


def advise(num_params_or_sizes, num_devices, bytes_per_device, optimizer_slots=2, dtype_bytes=4,
           activation_bytes=0, largest_variable=None, *, hosts=1, input_bytes=0,
           layer_output_bytes=None):
    """Returns the `Advice`: the data x pipe x model degrees and ZeRO stage with the least
    communication whose estimate fits `bytes_per_device` (see the module's order).

    Args:
      num_params_or_sizes: the model, as for `estimate_memory`: a number of parameters,
        each variable's elements, its layers as `placement.LayerCost` (params and the
        activation bytes each keeps at one model copy's batch: stages then hold their own
        layers' activations, and a layer's output is what crosses a stage boundary), or a
        built Keras model.
      num_devices: devices in all, `hosts` x devices per host.
      bytes_per_device: the memory of each device.
      optimizer_slots, dtype_bytes: state copies per variable, bytes per value.
      activation_bytes: what one model copy keeps for the backward pass at its batch (the
        same batch for every layout), beyond the layers' own.
      largest_variable: with a number of parameters only, the largest variable's elements.
      hosts: hosts the devices are spread over evenly; tensor parallelism stays inside one.
      input_bytes: one batch of inputs and targets of one model copy (`MemoryConfig`).
      layer_output_bytes: one layer's output at one model copy's batch, for the pipeline's
        and tensor parallelism's traffic; default: the layers' own, else activations over
        the number of variables, else unknown.

    1.3e9 parameters, Adam, 8 devices of 16 GiB: 20.8 GB per replica is too much,
    ZeRO stage 1 needs 8 + 8/8 = 9 B/param (11.7 GB).

    >>> advise(1.3e9, 8, 16 * 2**30).strategy
    "DataParallelStrategy(shard='optimizer')"
    """
    budget = _count("bytes_per_device", bytes_per_device, 1)
    num_devices = _count("num_devices", num_devices, 1)
    hosts = _count("hosts", hosts, 1)
    if num_devices % hosts:
        raise ValueError(f"The {num_devices} devices do not spread evenly over {hosts} hosts: "
                         f"give num_devices = hosts x devices per host.")
    if layer_output_bytes is not None:
        layer_output_bytes = _count("layer_output_bytes", layer_output_bytes)
    variables = _variables(num_params_or_sizes, largest_variable)
    common = dict(optimizer_slots=optimizer_slots, dtype_bytes=dtype_bytes,
                  activation_bytes=activation_bytes, input_bytes=input_bytes)
    units = len(variables.sizes) if variables.sizes is not None else variables.total
    outputs = _outputs(variables, activation_bytes, layer_output_bytes)
    candidates = []
    for _, r, k, t, z in _layouts(num_devices, num_devices // hosts, units, hosts):
        shard = [name for name, stage in sharding.STAGES.items() if stage == z][0]
        if k == 1 and t == 1:
            config = MemoryConfig("sharded" if z else "data", r, shard, **common)
        else:  # As PipelineStrategy describes itself: stage-3 weights kept to the backward.
            config = MemoryConfig("pipeline", k, shard, num_replicas=r, tensor_parallel=t,
                                  reshard_after_forward=False, **common)
        estimate = _estimate(variables, config)
        single = k == 1 and t == 1
        candidates.append(Option(
            _name(r, k, t, z), config.strategy(), z if single else None,
            r if single else k, estimate, estimate.peak <= budget, r, k, t, z,
            _traffic_of(variables, outputs, r, k, t, z, dtype_bytes, layer_output_bytes)))
    chosen = next((o for o in candidates if o.fits), None)
    options = _single_strategies(candidates)
    notes = []
    if len(options) == 4:
        notes.append(f"No pipeline: its number of stages must divide the devices "
                     f"({num_devices}), and be at least 2 and at most the number of variables"
                     f"{f' ({len(variables.sizes)})' if variables.sizes else ''}.")
    if variables.sizes is None and not variables.largest:
        notes.append("The largest variable is unknown: ZeRO stage 3's gather buffer and the "
                     "optimizer update's temporaries are counted as 0. Give the variable "
                     "sizes, or largest_variable.")
    if hosts > 1:
        notes.append(f"Tensor parallelism only within a host: T divides the "
                     f"{num_devices // hosts} devices per host.")
    if outputs is None and layer_output_bytes is None and (
            chosen is None or chosen.pipe > 1 or chosen.model > 1):
        notes.append("Pipeline and tensor-parallel traffic are unknown (+?): give the layers "
                     "(LayerCost), layer_output_bytes or activation_bytes with variable sizes.")
    update = dtype_bytes * (optimizer_slots + 1) * variables.largest if optimizer_slots else 0
    largest = dtype_bytes * (2 + optimizer_slots) * variables.largest + update
    return Advice(budget, options, chosen, tuple(notes), tuple(candidates), hosts, largest)


def _single_strategies(candidates):
    """Data parallelism, ZeRO stages 1-3 and the pipeline (no ZeRO, no tensor parallelism)
    with the fewest stages that fits, else the most split one."""
    singles = [o for o in candidates if o.pipe == 1 and o.model == 1]
    singles.sort(key=lambda o: o.zero)
    pipelines = sorted((o for o in candidates if o.pipe > 1 and o.model == 1 and not o.zero),
                       key=lambda o: o.pipe)
    pipeline = next((o for o in pipelines if o.fits), pipelines[-1] if pipelines else None)
    return tuple(singles + ([pipeline] if pipeline else []))
