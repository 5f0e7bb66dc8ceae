"""Running a pipeline schedule with TensorFlow: one replica's train step, and the forward.

The train step walks `execution_order(schedule)` and builds, for each action:

- F(s, m): stage s's layers on micro-batch m's input, under `tf.device(stage s)`,
  recorded by a `GradientTape` of its own (the last stage also computes the loss).
- B(s, m): that tape's vector-Jacobian product under the same `tf.device`: the
  gradient of the stage's output (seeded with the gradient that stage s+1 sent
  back) with respect to the stage's input and variables. Variable gradients are
  summed over micro-batches on the stage's device.
- I(s, m) and W(s, m), a B split in two (zero-bubble schedules): I builds the whole
  VJP but only the input gradient is its work; the ops that only the variables'
  gradients need get a control input from W's start, so they run in W's turn (no op
  is computed twice).

With virtual stages, s is a model chunk and runs on device s % K: `devices` lists each
chunk's device, and the control chain below is per device.

*Order.* On CPUs a device is not a serial stream: every ready op runs. So each
action's first ops (an identity of its input, variable reads) get a control
dependency on the outputs of the same stage's previous action: a stage runs its
actions strictly in schedule order, while different stages overlap. Data flows
between stages as usual, so the graph is the schedule.

*Scaling.* Keras' default losses are means over the batch. Micro-batch m's loss
(a mean over its examples, with Keras' 1/replicas scaling) is multiplied by R times
its share of the *global* batch: 1/M when every part is equal, else its examples
over all replicas' examples (an epoch's last batch splits into micro-batches that
differ by one example, and replicas that differ too), or its sum of sample weights
over the global sum for `mean_with_sample_weight`. The summed gradients are then
those of the mean over the whole global batch. A loss with reduction "sum" is not
scaled. Losses added in `call` (activity regularizers, normalized by batch size
since Keras 3.14) are scaled by the examples' share, but not those that are sums
over the batch (activity regularizers before 3.14, `replicas.is_batch_sum`); weight
regularizers are added once per step, by the stage that owns the layer. A custom `compute_loss` is scaled by the examples'
share, and the call losses of earlier stages it reads get their gradient from it.

*Rematerialization.* With `remat`, F(s, m) runs without a tape and keeps only its
input; B(s, m) runs the stage again under a tape, then takes the VJP. The rerun
replays the random-generator states the forward saw (same dropout masks), and
its variable updates (BatchNorm statistics) are discarded, so each micro-batch
updates them once.

    schedule (K=2, M=2, GPipe)     graph built (-> data, ==> control)
    stage 0: 0F0 0F1 0B0 0B1       0F0 ==> 0F1 ==> 0B0 ==> 0B1
    stage 1: 1F0 1F1 1B0 1B1        |       |       ^       ^
                                   1F0 ==> 1F1 ==> 1B0 ==> 1B1
"""

# tfpar's own private attributes (_tfpar_*) on Keras objects.
# pylint: disable=protected-access

import contextlib

import tensorflow as tf

from tfpar.distribute.common.placed_call import placed_call
from tfpar.distribute.pipeline import step_copies
from tfpar.keras import models
from tfpar.keras import replicas
from tfpar.keras import steps
from tfpar.keras import tf_runtime
from tfpar.keras.losses import (
    SUM, WEIGHT, has_custom_compute_loss, loss_kind, outputs_masked)
from tfpar.plan.schedule import BACKWARD, FORWARD, INPUT_GRAD, execution_order
from tfpar.plan.stages import check_micro_batches


def tensors_of(structure):
    """The tensors of a structure, flat; IndexedSlices count by their values."""
    found = []
    for x in tf.nest.flatten(structure):
        if isinstance(x, tf.IndexedSlices):
            found.append(x.values)
        elif isinstance(x, tf.Tensor):
            found.append(x)
    return found


def _floats(structure):
    return [x for x in tf.nest.flatten(structure)
            if isinstance(x, tf.Tensor) and (x.dtype.is_floating or x.dtype.is_complex)]


def _start_marker():
    """A cheap op the profiler records, which orders nothing but what depends on it.

    Not `tf.timestamp`: a tf.function chains, in program order, every stateful op without a
    resource input, so timestamps made each stage's I wait for the other stage's earlier W.
    TensorFlow leaves its legacy random ops out of that chain (`auto_control_deps`), and
    fixed seeds keep this one allowed under op determinism; its value is never read.
    """
    return tf.raw_ops.RandomUniform(shape=tf.constant([], tf.int32), dtype=tf.float32,
                                    seed=1, seed2=1, name="start")


def _anchor(structure, homes=None):
    """An identity of each tensor, made in the current device and control scopes: on the
    current device, or on the device the tensor is marked for (`_tfpar_home`: a slice of a
    tensor-parallel stage's output goes to the next stage's device of the same rank), or
    given in `homes` (one per tensor, None: the current device).

    Keras masks riding on the tensors are kept.
    """
    flat = tf.nest.flatten(structure)
    homes = list(homes) if homes is not None else [None] * len(flat)
    copies = []
    for x, home in zip(flat, homes + [None] * (len(flat) - len(homes))):
        if not isinstance(x, tf.Tensor):
            copies.append(x)
            continue
        home = home or getattr(x, "_tfpar_home", None)
        with tf.device(home) if home else contextlib.nullcontext():
            y = tf.identity(x)
        models.keep_mask(x, y)
        if home:
            y._tfpar_home = home
        copies.append(y)
    return tf.nest.pack_sequence_as(structure, copies)


def micro_batch_sizes(size, num_micro_batches, nonempty):
    """Sizes of `num_micro_batches` parts of `size` rows that differ by at most one row.

    `nonempty`: check, when the step runs, that every part gets a row.
    """
    base, extra = size // num_micro_batches, size % num_micro_batches
    sizes = base + tf.cast(tf.range(num_micro_batches) < extra, size.dtype)
    static = tf.get_static_value(size)
    if not nonempty or (static is not None and static >= num_micro_batches):
        return sizes
    check = tf.debugging.Assert(size >= num_micro_batches, [
        f"tfpar.PipelineStrategy: a batch (per pipeline replica) has fewer examples "
        f"than its {num_micro_batches} micro-batches. Use batches of at least "
        f"num_replicas x num_micro_batches examples, or drop the last partial batch "
        f"(dataset.batch(..., drop_remainder=True)). Batch size:", size])
    with tf.control_dependencies([check]):
        return tf.identity(sizes)


def _batch_tensor(structure):
    return next((x for x in tf.nest.flatten(structure) if isinstance(x, tf.Tensor)), None)


def split_batch(structure, num_micro_batches, sizes=None):
    """Splits each tensor of `structure` into `num_micro_batches` parts along axis 0.

    Returns one structure per micro-batch. `sizes`: the rows of each part (from
    `micro_batch_sizes`); None: equal parts (a static batch size that does not
    split raises `BatchSizeError`).
    """
    leaves = tf.nest.flatten(structure)
    first = _batch_tensor(structure)
    if num_micro_batches == 1 or first is None:
        return [structure] * num_micro_batches
    if sizes is None and first.shape[0] is not None:
        check_micro_batches(int(first.shape[0]), num_micro_batches)
    splits = num_micro_batches if sizes is None else sizes
    parts = [tf.split(leaf, splits, num=num_micro_batches) if isinstance(leaf, tf.Tensor)
             else [leaf] * num_micro_batches for leaf in leaves]
    return [tf.nest.pack_sequence_as(structure, [p[m] for p in parts])
            for m in range(num_micro_batches)]


def concat_batch(parts):
    """Joins micro-batch structures back into one batch (inverse of `split_batch`), the
    micro-batches' Keras masks joined too (a masked output keeps its mask for the loss and
    metrics that evaluate computes from it)."""
    if len(parts) == 1:
        return parts[0]

    def join(*xs):
        joined = tf.concat(xs, axis=0)
        masks = [models.mask_of(x) for x in xs]
        if all(m is not None for m in masks):
            models.set_mask(joined, tf.concat(masks, axis=0))
        return joined

    return tf.nest.map_structure(join, *parts)


def _accumulate(total, grad):
    if grad is None:
        return total
    if total is None:
        return grad
    if isinstance(total, tf.IndexedSlices) and isinstance(grad, tf.IndexedSlices):
        # Summing sparse gradients is keeping all their rows.
        return tf.IndexedSlices(tf.concat([total.values, grad.values], 0),
                                tf.concat([total.indices, grad.indices], 0), total.dense_shape)
    return tf.convert_to_tensor(total) + tf.convert_to_tensor(grad)


def _only_for(made, wanted, others):
    """Of the ops `made` (in creation order), the first ones that compute only `wanted`
    tensors, not `others`: the ops whose inputs are all made elsewhere, each the start of
    a chain that leads to `wanted` alone. Adding a control input to them delays all of
    `wanted`'s own work."""
    made_ids = {id(op) for op in made}

    def ancestors(tensors):
        seen, stack = set(), [t.op for t in tensors]
        while stack:
            op = stack.pop()
            if id(op) in seen or id(op) not in made_ids:
                continue
            seen.add(id(op))
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
        return seen

    shared = ancestors(others)
    own = ancestors(wanted) - shared
    return [op for op in made if id(op) in own
            and not any(id(t.op) in own for t in op.inputs)
            and not any(id(c) in own for c in op.control_inputs)]


class TrainStep:
    """Builds one pipeline replica's training computation for a schedule.

    Args:
      model: the compiled Keras model.
      program: its `StageProgram`.
      devices: the device of each stage, for this replica.
      schedule: a validated `Schedule`.
      remat: recompute each stage's forward in its backward.
      offload_devices: under remat, where each chunk keeps its inputs until its backward
        (None: on its own device).
      replica: this replica's id; its actions are built in name scope `pipeline_r<id>`,
        e.g. `pipeline_r0/1F0/...` (their gradients: `gradient_tape/pipeline_r0/1F0/...`).
      num_replicas: how many pipeline replicas share the global batch.
      copy_weights_once: read each chunk's trainable variables once per step, into copies on
        its device that every micro-batch reads (pipeline x ZeRO-3, whose variables live on
        one owner each).
    """

    def __init__(self, model, program, devices, schedule, remat, replica=0, num_replicas=1,
                 offload_devices=None, copy_weights_once=False, input_device=None):
        self.model, self.program, self.devices = model, program, list(devices)
        self.input_device = input_device
        # Pipeline x ZeRO-3: each stage's weights read from their owners once per step, into
        # copies every micro-batch reads (`step_copies`); {chunk: its copies} once taken.
        self.copy_weights_once = copy_weights_once
        self.copies = {}
        if copy_weights_once:
            for stage in program.stages:
                for variable in stage.trainable_variables:
                    step_copies.serve_from_copies(variable)
        self.schedule, self.remat = schedule, remat
        self.offload_devices = offload_devices
        self.replica, self.num_replicas = replica, num_replicas
        k, m = schedule.num_chunks, schedule.num_micro_batches
        self.last_chunk = k - 1
        self.inputs = [[None] * m for _ in range(k)]  # What each chunk reads, per micro-batch.
        self.kept = [[None] * m for _ in range(k)]  # Tapes, or inputs under remat.
        self.upstream = [[None] * m for _ in range(k)]  # Gradient of each chunk's output.
        # Where each float output of a chunk was made, when not on the chunk's device (the
        # slices a tensor-parallel stage passes on): its gradient comes back there.
        self.output_homes = [[None] * m for _ in range(k)]
        # A split backward: what the input-gradient pass (I) leaves to the weight pass (W).
        self.split = any(a.kind == INPUT_GRAD for order in schedule.stage_orders for a in order)
        self.for_weights = [[None] * m for _ in range(k)]
        # With a custom compute_loss, which reads model.losses at the last stage: each
        # earlier stage's call losses per micro-batch, and the gradient the last stage
        # sends back to them.
        self.call_losses = [[None] * m for _ in range(k)]
        self.aux_upstream = [[None] * m for _ in range(k)]
        # The outputs of each device's previous action (a device runs its list in order).
        self.after = [[] for _ in range(schedule.num_stages)]
        self.grads = {}  # id(variable) -> gradient summed so far.
        self.outputs = [None] * m  # The model's outputs, per micro-batch.
        self.losses = []  # Every loss term, scaled, for the reported loss.
        self.custom_loss = has_custom_compute_loss(model)
        # Each chunk's last action: it adds the chunk's weight-regularizer gradients.
        self.last_action = {a.stage: a for order in schedule.stage_orders for a in order
                            if a.kind != FORWARD}

    # -- Building ------------------------------------------------------------------

    def __call__(self, x, y, sample_weight):
        """Builds the step; returns (loss, y_pred, gradients of model.trainable_weights)."""
        m = self.schedule.num_micro_batches
        first = _batch_tensor(x)
        # A batch size known now must split into equal micro-batches (fail now, speaking
        # of the global batch). One known only when the step runs (an epoch's last
        # partial batch) may not: its micro-batches differ by at most one example, and
        # each one's mean loss is weighted by its share of the batch.
        sizes, self.shares = None, [1.0 / m] * m
        if first is not None and first.shape.rank:
            if first.shape[0] is not None:
                check_micro_batches(int(first.shape[0]) * self.num_replicas, m,
                                    self.num_replicas)
            elif m > 1 or self.num_replicas > 1:
                size = tf.shape(first)[0]
                sizes = micro_batch_sizes(size, m, nonempty=True) if m > 1 else None
                self.shares = self._global_shares(
                    [size] if sizes is None else tf.unstack(sizes, num=m))
        # Split where the batch is fed (stages on other processes: the chief's device for
        # this replica): a tensor-parallel first stage's devices each read their
        # micro-batch from there, not through the first of them.
        with tf.device(self.input_device or self.devices[0]):
            flat = self.program.standardize(x)
            for i, part in enumerate(split_batch(flat, m, sizes)):
                self.inputs[0][i] = part
        if self.custom_loss:
            self.x_parts = split_batch(x, m, sizes)
        with tf.device(self.devices[-1]):
            self.y_parts = split_batch(y, m, sizes)
            self.weight_parts = split_batch(sample_weight, m, sizes)
        self.kind = None  # Known once the compiled loss has been built (its first call).
        with tf.name_scope(f"pipeline_r{self.replica}"):
            for action in execution_order(self.schedule):
                if action.kind == FORWARD:
                    self._forward(action)
                elif action.kind in (BACKWARD, INPUT_GRAD):
                    self._backward(action)
                else:
                    self._weights(action)
        with tf.device(self.devices[-1]):
            loss = tf.add_n([tf.cast(l, tf.float32) for l in self.losses]) if self.losses else (
                tf.constant(0.0))
            y_pred = concat_batch(self.outputs)
        # (A tensor-parallel stage's split variables are trained as their shards.)
        grads = [self.grads.get(id(v))
                 for v in self.program.optimizer_variables(self.model.trainable_weights)]
        return loss, y_pred, grads

    def _global_shares(self, parts):
        """Each micro-batch's part of the global batch (examples or sample weights), times
        R: Keras divides every replica's mean loss by R. Replicas may differ in size (an
        epoch's last batch), so the total is summed over replicas.

            R=2, replica 0 holds 3 + 3 examples, replica 1 holds 2 + 2:
            shares on replica 0: 3/10 * 2 = 0.6 each (not 1/M = 0.5)
        """
        parts = [tf.cast(p, tf.float32) for p in parts]
        total = tf.add_n(parts)
        if self.num_replicas > 1:
            total = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, total)
        return [p / total * self.num_replicas for p in parts]

    @contextlib.contextmanager
    def _in_order(self, action):
        """Scope of one action: its chunk's device, after that device's previous action."""
        with tf.name_scope(str(action)), tf.device(self.devices[action.stage]):
            with tf.control_dependencies(self.after[self.schedule.rank_of(action.stage)]):
                # Marks where a backward part starts, for trace() (which reads gradient
                # ops as B): the part's ops and the device's next action wait for it.
                self._marker = (_start_marker()
                                if self.split and action.kind != FORWARD else None)
                with tf.control_dependencies([self._marker] if self._marker is not None
                                             else []):
                    yield

    def _done(self, action, tensors):
        tensors = tensors + ([self._marker] if self._marker is not None else [])
        if tensors:
            self.after[self.schedule.rank_of(action.stage)] = tensors

    def _scaled(self, tensor):
        optimizer = getattr(self.model, "optimizer", None)
        return optimizer.scale_loss(tensor) if optimizer is not None else tensor

    def _stage(self, action, x, rerun=False):
        """Runs stage s on x. Returns (output for the next stage, differentiable targets)."""
        s, m = action.stage, action.micro_batch
        y = self.program.run(s, x, training=True, crossing=True)
        last = s == self.last_chunk
        if self.custom_loss:
            aux = []
            if not last:
                # compute_loss (last stage) adds these through model.losses; this stage
                # differentiates them with the gradient it sends back.
                snapshot = self.program.snapshot_losses(s)
                if not rerun:
                    self.call_losses[s][m] = snapshot
                return y, _floats(y) + [t for _, losses in snapshot for t in losses]
        else:
            aux = [tf.cast(steps.aggregate_additional_loss(self.model, l), tf.float32)
                   * replicas.call_loss_share(l, self.shares[m])
                   for l in self.program.call_losses(s)]
        if not last:
            if not rerun:
                self.losses.extend(aux)
            return y, _floats(y) + aux
        if not rerun:
            self.outputs[m] = y
        loss = self._loss(m, y)
        terms = ([] if loss is None else [loss]) + aux
        if not terms:
            raise ValueError("No loss to compute. Provide a `loss` argument in `compile()`.")
        total = tf.add_n(terms)
        if not rerun:
            self.losses.append(total)
        return None, [total]

    def _loss(self, m, y_pred):
        model = self.model
        if self.custom_loss:
            earlier = [self.call_losses[s][m] for s in range(self.last_chunk)]
            if any(earlier):
                if self.remat:
                    raise ValueError(
                        f"PipelineStrategy(remat=True) cannot yet differentiate the losses "
                        f"that earlier stages of {model.name!r} add in call (add_loss, "
                        f"activity regularizers) through a custom compute_loss. Use "
                        f"remat=False, or Keras' own compute_loss.")
                for snapshot in earlier:
                    self.program.restore_losses(snapshot or ())
                self._tape_of_last_stage.watch(self._earlier_aux(m))
            factor = self.shares[m]
            with replicas.weighed_as_part(factor):  # Sums over the batch count once.
                loss = steps.compute_loss(
                    model, x=self.x_parts[m], y=self.y_parts[m], y_pred=y_pred,
                    sample_weight=self.weight_parts[m], training=True)
        elif steps.compiled_loss(model) is not None:
            loss = steps.compiled_loss(model)(self.y_parts[m], y_pred, self.weight_parts[m])
            if self.kind is None:
                self._weigh_losses()
            self._refuse_masked_means(y_pred)
            factor = 1.0 if self.kind == SUM else self.loss_shares[m]
        else:
            return None
        return None if loss is None else tf.cast(loss, tf.float32) * factor

    def _weigh_losses(self):
        weighted = self.weight_parts[0] is not None
        self.kind = loss_kind(self.model, weighted)
        self.loss_shares = self.shares
        if self.kind == WEIGHT:
            self.loss_shares = self._global_shares(
                [tf.reduce_sum(tf.cast(w, tf.float32)) for w in self.weight_parts])

    def _refuse_masked_means(self, y_pred):
        if outputs_masked(y_pred) and self.kind != SUM and self.schedule.num_micro_batches > 1:
            raise ValueError(
                f"PipelineStrategy cannot train {self.model.name!r} equal to one device: its "
                f"outputs are masked, so a mean loss divides by the batch's valid entries, "
                f"which the pipeline only knows after the last micro-batch (1F1B starts the "
                f"backward before). Compile the loss with reduction='sum' (and a learning "
                f"rate scaled to it), or use num_micro_batches=1, or "
                f"tfpar.DataParallelStrategy (exact for masked losses).")

    def _variables(self, s):
        if self.custom_loss and s == self.last_chunk:
            # A custom compute_loss may read any variable (e.g. self.losses).
            return self.program.optimizer_variables(self.model.trainable_weights)
        return list(self.program.stages[s].trainable_variables)

    def _copies(self, s):
        """Chunk s's copies of its weights for this step ({} unless `copy_weights_once`),
        taken at its first forward."""
        if not self.copy_weights_once:
            return {}
        if s not in self.copies:
            self.copies[s] = step_copies.take_copies(
                self.program.stages[s].trainable_variables, self.devices[s])
        return self.copies[s]

    def _forward(self, action):
        s, m = action.stage, action.micro_batch
        with self._in_order(action):
            copies = self._copies(s)  # (Before x arrives: the copy overlaps the wait.)
            # The first chunk's micro-batch stays where it is fed (each device of a
            # tensor-parallel stage reads it from there).
            with (tf.device(self.input_device) if s == 0 and self.input_device
                  else contextlib.nullcontext()):
                x = _anchor(self.inputs[s][m])
            with tf.control_dependencies(tensors_of(x)), step_copies.reading_copies(copies):
                if self.remat:  # (The action starts when x is here.)
                    states = [(v, tf.identity(v.value))
                              for v in self.program.stages[s].seed_variables]
                    y, targets = self._stage(action, x)
                    self.kept[s][m] = (self._on_offload_device(s, x), states)
                else:
                    tape = tf.GradientTape()
                    self._tape_of_last_stage = tape
                    with tape:
                        tape.watch(_floats(x) + list(copies.values()))
                        y, targets = self._stage(action, x)
                    self.kept[s][m] = (tape, x, targets)
        self._done(action, tensors_of(targets))
        if y is not None:
            self.inputs[s + 1][m] = y
            self.output_homes[s][m] = [getattr(t, "_tfpar_source", None) for t in _floats(y)]

    def _on_offload_device(self, s, x):
        """x, or a copy of it made on chunk s's offload device in the current scopes. After
        a forward: what the backward's rerun reads, so the chunk's own x is freed. In the
        backward: that copy copied again, in the backward's control scope, which is what is
        sent back to the chunk then (a receive runs as soon as its sender has sent: had the
        kept copy itself been sent, it would have come straight back)."""
        if self.offload_devices is None:
            return x
        with tf.device(self.offload_devices[s]):
            return _anchor(x)

    def _backward(self, action):
        """B (the whole backward) or I (its input-gradient part; W follows)."""
        s, m = action.stage, action.micro_batch
        last = s == self.last_chunk
        done = []
        with self._in_order(action):
            upstream = None if last else self.upstream[s][m]
            if last or upstream is not None:
                upstream = None if last else _anchor(upstream, self.output_homes[s][m])
                with tf.control_dependencies(tensors_of(upstream)):  # Starts when it is here.
                    done += self._vjp(action, upstream)
            self.kept[s][m] = None
            if action == self.last_action[s]:
                done += self._regularize(s)
        self._done(action, tensors_of(done))

    def _weights(self, action):
        """W: the weight gradients of a backward whose input gradient I has sent; their
        own ops start now."""
        s, m = action.stage, action.micro_batch
        done = []
        with self._in_order(action):
            if self.for_weights[s][m] is not None:
                weights, deferred = self.for_weights[s][m]
                start = self._marker.op
                for op in deferred:
                    tf_runtime.add_control_input(op, start)
                done += self._add(self._variables(s), weights)
            self.for_weights[s][m] = None
            if action == self.last_action[s]:
                done += self._regularize(s)
        self._done(action, tensors_of(done))

    def _vjp(self, action, upstream):
        """Chunk s's gradients for micro-batch m: sends the input's back; sums the
        variables' (B), or leaves them to W (I)."""
        s, m = action.stage, action.micro_batch
        copies = self.copies.get(s, {})
        if self.remat:
            x, states = self.kept[s][m]
            x = _anchor(self._on_offload_device(s, x))  # The rerun starts now, not as soon as x exists.
            tape = tf.GradientTape()
            with tape, models.stateless_scope(state_mapping=states, collect_losses=True), \
                    step_copies.reading_copies(copies):
                tape.watch(_floats(x) + list(copies.values()))
                _, targets = self._stage(action, x, rerun=True)
        else:
            tape, x, targets = self.kept[s][m]
        seeds = [self._scaled(tf.ones_like(t)) for t in targets]
        passed = 0  # The targets that are the chunk's outputs: the next chunk's inputs.
        if upstream is not None:
            # One gradient per float tensor passed on (None: the next chunk did not use it).
            passed = len(upstream)
            seeds[:passed] = [u if u is not None else tf.zeros_like(t)
                              for u, t in zip(upstream, targets)]
        if self.custom_loss and upstream is not None:  # Call losses: as the last stage says.
            sent = self.aux_upstream[s][m] or [None] * (len(targets) - passed)
            seeds[passed:] = [g if g is not None else tf.zeros_like(t)
                              for g, t in zip(sent, targets[passed:])]
        inputs = _floats(x) if s > 0 else []
        variables = self._variables(s)
        earlier = self._earlier_aux(m) if self.custom_loss and upstream is None else []
        graph = tf.compat.v1.get_default_graph()
        made_before = len(graph.get_operations())
        sources = [step_copies.copy_of(v, copies) for v in variables]  # (Read from there.)
        grads = tape.gradient(targets, inputs + sources + earlier, output_gradients=seeds)
        if earlier:
            self._send_aux_gradients(m, grads[len(grads) - len(earlier):])
        sent = grads[:len(inputs)] + grads[len(grads) - len(earlier):] if earlier else (
            grads[:len(inputs)])
        weights = grads[len(inputs):len(inputs) + len(variables)]
        done = []
        if s > 0:
            sent_back = list(grads[:len(inputs)])
            self.upstream[s - 1][m] = (sent_back if any(g is not None for g in sent_back)
                                       else None)
            done += [g for g in grads[:len(inputs)] if g is not None]
        if action.kind == INPUT_GRAD:
            # One gradient computation, no work twice: the ops only the weight gradients
            # need wait for W's turn (W adds them a control input). Collectives stay in I
            # (a tensor-parallel stage's backward all-reduces, which the first stage needs
            # for its weights alone): each device runs its collectives in the order they
            # were built (an ordering token), so one deferred to W would hold every later
            # collective of the device, and the forwards between I and W behind it.
            made = graph.get_operations()[made_before:]
            collectives = [t for op in made if op.type.startswith("Collective")
                           for t in op.outputs]
            self.for_weights[s][m] = (weights, _only_for(
                made, tensors_of(weights), tensors_of(sent) + collectives))
            return done
        return done + self._add(variables, weights)

    def _earlier_aux(self, m):
        return [t for s in range(self.last_chunk)
                for _, losses in (self.call_losses[s][m] or ()) for t in losses]

    def _send_aux_gradients(self, m, grads):
        grads = list(grads)
        for s in range(self.last_chunk):
            n = sum(len(losses) for _, losses in (self.call_losses[s][m] or ()))
            self.aux_upstream[s][m], grads = grads[:n], grads[n:]

    def _add(self, variables, grads):
        changed = []
        for variable, grad in zip(variables, grads):
            if grad is not None:
                # Summed where the gradient was made (a tensor-parallel shard's device),
                # not on the stage's first device, which would then hold every shard's.
                made = grad.values if isinstance(grad, tf.IndexedSlices) else grad
                with tf.device(made.device):
                    total = _accumulate(self.grads.get(id(variable)), grad)
                self.grads[id(variable)] = total
                changed.append(total)
        return changed

    def _regularize(self, s):
        """Adds the weight-regularizer losses of stage s's layers, once per step."""
        if self.custom_loss:
            return []  # A custom compute_loss adds self.losses itself.
        with tf.GradientTape() as tape:
            losses = self.program.regularization_losses(s)
            if not losses:
                return []
            total = tf.add_n([tf.cast(steps.aggregate_additional_loss(self.model, l), tf.float32)
                              for l in losses])
        variables = self._variables(s)
        grads = tape.gradient(self._scaled(total), variables)
        self.losses.append(total)
        return self._add(variables, grads)


def forward(program, devices, num_micro_batches, inputs, training):
    """The model's outputs, computed by micro-batches flowing through the stages.

    Each stage runs its micro-batches in order on its device. Under a gradient tape
    (a custom training loop) every stage call is a `placed_call`, so its backward
    runs on its device too. Micro-batches may differ in size by one example; when
    `training`, each needs at least one.
    """
    inputs = program.standardize(inputs)
    first = _batch_tensor(inputs)
    sizes = None if first is None or num_micro_batches == 1 else micro_batch_sizes(
        tf.shape(first)[0], num_micro_batches, nonempty=bool(training))
    parts = split_batch(inputs, num_micro_batches, sizes)
    taped = tf_runtime.tape_recording()
    after = [[] for _ in program.stages]
    outputs = []
    with tf.name_scope("pipeline_forward"):
        for x in parts:
            for s, device in enumerate(devices):
                with tf.device(device):
                    with tf.control_dependencies(after[s]):  # After the stage's previous one,
                        x = _anchor(x)
                    with tf.control_dependencies(tensors_of(x)):  # and once x is here.
                        if taped:
                            x = placed_call(program.run, device, s, x, training)
                        else:
                            x = program.run(s, x, training)
                after[s] = tensors_of(x)
            outputs.append(x)
    if num_micro_batches > 1:
        size = tf.shape(first)[0] if first is not None else None
        shares = ([1.0 / num_micro_batches] * num_micro_batches if sizes is None else tf.unstack(
            tf.cast(sizes, tf.float32) / tf.cast(size, tf.float32), num=num_micro_batches))
        _merge_micro_batch_losses(program, shares)
    with tf.device(devices[-1]):
        return concat_batch(outputs)


def _merge_micro_batch_losses(program, shares):
    """Each layer's call losses of the M micro-batches -> one loss for the batch.

    Losses added in `call` (activity regularizers, which Keras divides by the batch
    size since 3.14; `add_loss` terms) are per-batch means: the batch's is the
    micro-batches' mean weighted by their shares. Sums over the batch (activity
    regularizers before Keras 3.14) are added. Left as they were, M terms would count M times in
    `evaluate` and in a user's loop over `model.losses`.
    """
    if models.in_stateless_scope():
        return  # Keras' symbolic build: nothing ran.
    m, seen = len(shares), set()
    for stage in program.stages:
        for layer in stage.layers:
            for sub in models.all_layers(layer):
                if id(sub) in seen:
                    continue
                seen.add(id(sub))
                losses = replicas.call_losses(sub)
                if not losses or len(losses) % m:
                    continue
                k = len(losses) // m  # Terms per call, in call order.
                replicas.set_call_losses(sub, [replicas.batch_call_loss(
                    [losses[i * k + j] for i in range(m)], shares) for j in range(k)])

