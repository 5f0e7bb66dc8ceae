"""What a `PipelineStrategy` reports to its user: the bytes each device holds
(`memory_report`) and one real training step's timeline (`trace`).

The strategy's methods of the same names say what they return; these are their bodies.
"""

# A PipelineStrategy's own state, read by its reports.
# pylint: disable=protected-access

import time

import tensorflow as tf

from tfpar.distribute.common import device_memory as memory
from tfpar.distribute.pipeline import mirrored_placement
from tfpar.errors import PlacementError
from tfpar.plan import memory as plan_memory
from tfpar.viz import pipeline_profiler as profiling


def memory_report(strategy, model, optimizer=None):
    """`PipelineStrategy.memory_report`: bytes each device of `strategy.stage_devices`
    holds for training `model`, as a `tfpar.plan.MemoryEstimate`."""
    if strategy._tensor_parallel > 1:
        raise NotImplementedError(
            "memory_report does not measure a tensor-parallel pipeline yet (its split "
            "variables are shards on the stages' T devices).")
    strategy._place(model)
    devices = [d for row in strategy._grid for d in row]
    stage, owners = strategy._tfpar_shard_stage, strategy._tfpar_shard_owners
    gradients, gather = [0] * len(devices), [0] * len(devices)
    for variable in model.trainable_weights:
        value = variable.value  # (Its tf.Variable, as Keras' optimizer colocates with.)
        copies = (owners.group_devices(value) if stage
                  else mirrored_placement.devices_of(value))
        held = memory.resident_bytes(strategy, [variable], devices)
        size = memory.num_bytes(variable)
        for r, device in enumerate(copies):
            i = devices.index(device)
            if stage < 2 or owners.owner_of(value) == r:
                gradients[i] += size
            if not held[i]:
                gather[i] += size
    config = strategy._tfpar_memory_config(plan_memory.compiled_optimizer_slots(model))
    return memory.measure(strategy, model, optimizer or getattr(model, "optimizer", None),
                          config, devices, gradients, gather)


def trace(strategy, path, model, x, y, sample_weight, warmup_steps, profilers):
    """`PipelineStrategy.trace`: profiles a real training step of `model` on one batch,
    writes its Chrome trace to `path` and a picture next to it, returns the events."""
    from tfpar.viz import pipeline_trace

    grid = strategy._grid
    stage_devices = [d for row in grid for d in row]
    if strategy._workers is not None:
        addresses = strategy._workers.profiler_addresses(stage_devices, profilers)
    elif profilers:
        raise ValueError(f"profilers= is for stages on other tasks, but every stage of "
                         f"this pipeline is in this process. Received: {profilers!r}")
    else:
        addresses = []
    data = tuple(v for v in (x, y, sample_weight) if v is not None)
    dataset = tf.data.Dataset.from_tensors(data if len(data) > 1 else data[0]).repeat()
    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    @tf.function
    def step(iterator):
        return strategy.run(model.train_step, args=(next(iterator),))

    def run_step():
        # (Through a tensor's value: a step on other tasks is over when its result is here.)
        tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t,
                              step(iterator), expand_composites=True)

    for _ in range(max(1, warmup_steps)):
        start = time.perf_counter()
        run_step()
    ops = profiling.record_ops(run_step, addresses, time.perf_counter() - start)
    spans = pipeline_trace.action_spans(ops, strategy.num_stages)
    if not spans:
        raise PlacementError(
            f"trace() times the pipeline's own train step, but {model.name!r} overrides "
            f"train_step (or was not created under this strategy's scope).")
    rows = [f"r{r} stage {s}: {strategy._name(device)}" if len(grid) > 1
            else f"stage {s}: {strategy._name(device)}"
            for r, row in enumerate(grid) for s, device in enumerate(row)]
    empty = [name for i, name in enumerate(rows) if not any(s[1] == i for s in spans)]
    if empty:
        # (A task's profiler that started after the step did, or recorded elsewhere.)
        raise RuntimeError(f"trace() recorded no action of {', '.join(empty)}: its profile "
                           f"holds none of the step's ops. Profilers given: {profilers!r}.")
    title = (f"{strategy._schedule.name}: {strategy.num_stages} stages x "
             f"{strategy.num_micro_batches} micro-batches{' (remat)' if strategy._remat else ''}"
             f"{f', {len(grid)} replicas' if len(grid) > 1 else ''}: one step")
    return pipeline_trace.write_step_trace(path, spans, rows, title)
