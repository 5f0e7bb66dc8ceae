"""A Keras model cut into pipeline stages: which layer calls each stage runs.

Sequential and functional models are graphs of layer calls (Keras `Node`s). The
calls are taken in an order where each comes after those it reads from, and cut
into contiguous stages with `tfpar.plan.stages`: where the user put
`tfpar.layers.StageBoundary` markers, or else into groups of about equal
parameter count (all weights, frozen ones too, as `ModelParallelStrategy` counts).
`tfpar.layers.OnDevice` layers keep their variables on the device they name. A stage may
only start where exactly one activation (a tensor a layer made) crosses from the earlier
calls; the model's own inputs that later calls read (a Transformer backbone's padding mask
beside its hidden states) cross along with it. A stage runs its calls like Keras'
`Functional.call` does, from a dict of computed tensors.

Nested models are one call each: they are not cut. Subclassed models have no
graph to cut and are refused.
"""

# Glue over Keras' and TensorFlow's internals (and tfpar's own private attributes).
# pylint: disable=protected-access

import dataclasses

from tfpar.errors import PlacementError
from tfpar.keras import internals
from tfpar.keras import replicas
from tfpar.plan import stages as stages_plan


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage: its layer calls and the variables it reads, places and regularizes."""

    index: int
    nodes: tuple  # Keras Nodes, in run order.
    # The KerasTensors flowing in (() for stage 0) and out (() for the last stage): one
    # activation, and the model inputs later stages read.
    input_tensors: tuple
    output_tensors: tuple
    layers: tuple  # The distinct layers the nodes call.
    trainable_variables: tuple  # Keras variables whose gradients the stage computes.
    placed_variables: tuple  # Variables that live on the stage's device (first use).
    regularized_layers: tuple  # Layers whose weight regularizers the stage adds.
    seed_variables: tuple  # Random-generator states (replayed under rematerialization).

    @property
    def layer_names(self):
        """The names of the layers the stage calls, in order."""
        return [node.operation.name for node in self.nodes]


class StageProgram:
    """A model's stages, and how to run one of them."""

    def __init__(self, graph, stages, model_graph=None):
        self.graph = graph  # The keras Functional the nodes belong to.
        self.stages = tuple(stages)
        # The model's own graph (its input structure), when `graph` is it flattened.
        self.model_graph = model_graph if model_graph is not None else graph
        # Set by a tensor-parallel pipeline: {id(node): call(args, kwargs, training)} run in
        # place of the node's layer, and {id(variable): its shards}, what the optimizer and
        # the gradients see in place of a split variable.
        self.calls = {}
        self.substitutes = {}
        # The nodes whose calls take a block's output held on several devices as it is
        # (a tensor-parallel block run replicated), and how any other reader gets one
        # tensor of it (`tensor_groups.whole_values`).
        self.takes_replicated = set()
        self.whole_values = None
        # Set with those: how a stage's values cross to the next one in a training step
        # (`tensor_parallel.Crossings`: Megatron's scatter-gather), or None (whole).
        self.crossings = None

    def optimizer_variables(self, variables):
        """`variables` with each split variable replaced by its shards, in order."""
        return [s for v in variables for s in self.substitutes.get(id(v), (v,))]

    @property
    def num_stages(self):
        return len(self.stages)

    @property
    def trainable_variables(self):
        seen, result = set(), []
        for stage in self.stages:
            for variable in stage.trainable_variables:
                if id(variable) not in seen:
                    seen.add(id(variable))
                    result.append(variable)
        return result

    def standardize(self, inputs):
        """The model's inputs as the flat list stage 0 takes (like Functional.call)."""
        return list(internals.attr(self.model_graph, "_standardize_inputs")(inputs))

    def run(self, index, inputs, training, crossing=False):
        """Runs stage `index` on its input: the flat input list for stage 0, else what the
        previous stage returned.

        Returns what the next stage takes (a tensor, or a tuple when model inputs cross with
        the activation), or the model's outputs. With `crossing` (a training step's, whose
        executor anchors each value where it is marked to go), values held on several
        devices cross as `self.crossings` says.

        Each call of the stage in turn, from a dict of computed tensors, as Keras'
        `Function._run_through_graph` runs a whole graph. (Not a Keras `Function` of the
        stage: Keras 3.10 maps a Function's graph back past its inputs, so one that
        starts inside a model is "disconnected".)
        """
        import keras

        operation_fn = internals.symbol("keras.src.models.functional.operation_fn")
        unpack_singleton = internals.symbol("keras.src.models.functional.unpack_singleton")
        stage = self.stages[index]
        starts = list(self.graph.inputs) if index == 0 else list(stage.input_tensors)
        crossings = self.crossings if crossing else None
        if crossings is not None:
            inputs = crossings.arrive(index, inputs)
        values = {id(t): v for t, v in zip(starts, keras.tree.flatten(inputs))}
        if crossings is not None and index == 0:
            values = crossings.fed(values, stage)
        whole = self.whole_values or (lambda structure: structure)
        for node in stage.nodes:
            args, kwargs = node.arguments.fill_in(values)
            if id(node) not in self.takes_replicated:
                args, kwargs = whole((args, kwargs))
            split_call = self.calls.get(id(node))
            if split_call is not None:
                outputs = split_call(args, kwargs, training)
            else:
                outputs = operation_fn(node.operation, training=training)(*args, **kwargs)
            for symbolic, value in zip(node.outputs, keras.tree.flatten(outputs)):
                values[id(symbolic)] = value
        if stage.output_tensors:
            leave = (whole if crossings is None
                     else lambda value: crossings.leave(index, value, whole))
            passed = tuple(leave(values[id(t)]) for t in stage.output_tensors)
            return passed[0] if len(passed) == 1 else passed
        return unpack_singleton(keras.tree.map_structure(
            lambda t: whole(values[id(t)]), internals.attr(self.graph, "_outputs_struct")))

    def call_losses(self, index):
        """Losses the stage's layers added while they last ran (`add_loss`, activity
        regularizers)."""
        losses, seen = [], set()
        for layer in self.stages[index].layers:
            for sub in internals.attr(layer, "_flatten_layers")():
                for loss in internals.attr(sub, "_get_own_losses")():
                    if id(loss) not in seen:
                        seen.add(id(loss))
                        losses.append(loss)
        return losses

    def snapshot_losses(self, index):
        """[(layer, its call losses)] of the stage's layers after their last call."""
        snapshot, seen = [], set()
        for layer in self.stages[index].layers:
            for sub in internals.attr(layer, "_flatten_layers")():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    losses = replicas.call_losses(sub)
                    if losses:
                        snapshot.append((sub, losses))
        return snapshot

    @staticmethod
    def restore_losses(snapshot):
        """Puts back the call losses a `snapshot_losses` saw (another micro-batch ran since)."""
        for layer, losses in snapshot:
            replicas.set_call_losses(layer, losses)

    def regularization_losses(self, index):
        """The weight-regularizer losses of the layers the stage owns."""
        return [loss for layer in self.stages[index].regularized_layers
                for loss in internals.attr(layer, "_get_regularization_losses")()]


def functional_graph(model):
    """The keras Functional that runs `model`; PlacementError for models without one."""
    import keras

    functional = internals.symbol("keras.src.models.functional.Functional")
    if isinstance(model, keras.Sequential):
        graph = internals.attr(model, "_functional")
        if graph is None:
            raise PlacementError(
                f"Sequential model {model.name!r} has no layer graph to cut into pipeline "
                f"stages (its layers could not be traced symbolically). Give it a "
                f"keras.Input, or build it on a batch first.")
        return graph
    if isinstance(model, functional):
        return model
    raise PlacementError(
        f"PipelineStrategy cuts Sequential and functional models into stages, but "
        f"{model.name!r} is a subclassed model ({type(model).__name__}) whose call() it "
        f"cannot see into. Write it as a Sequential or functional model (nested "
        f"subclassed layers are fine), or use tfpar.ModelParallelStrategy.")


def _nested_graph(operation):
    """The Functional of a nested Sequential or functional model; None for a layer."""
    import keras

    if isinstance(operation, keras.Sequential):
        return internals.attr(operation, "_functional")
    if isinstance(operation, internals.symbol("keras.src.models.functional.Functional")):
        return operation
    return None


def flattened(graph):
    """`graph` with every nested Sequential or functional model replaced by its own
    layers (the same layer objects: the same variables), so stages may be cut inside
    them. `graph` itself when nothing is nested."""
    import keras

    if not any(_nested_graph(n.operation) is not None for n in _ordered_nodes(graph)):
        return graph

    def operation_fn(operation):
        inner = _nested_graph(operation)
        if inner is None:
            return operation

        def run(*args, **kwargs):  # Its layers, one by one, on the symbolic inputs.
            # (Flat, in the nested model's input order; standardizing would add a
            # convert_to_tensor node to the graph.)
            flat = keras.tree.flatten(args[0] if len(args) == 1 else list(args))
            return internals.attr(inner, "_run_through_graph")(flat, operation_fn=operation_fn)
        return run

    inputs = [keras.Input(batch_shape=t.shape, dtype=t.dtype) for t in graph.inputs]
    outputs = internals.attr(graph, "_run_through_graph")(inputs, operation_fn=operation_fn)
    return internals.symbol("keras.src.models.functional.Functional")(
        inputs, outputs, name=f"{graph.name}_flattened")


def _ordered_nodes(graph):
    nodes_by_depth = internals.attr(graph, "_nodes_by_depth")
    return [node for depth in sorted(nodes_by_depth, reverse=True)
            for node in nodes_by_depth[depth] if node.operation is not None and not node.is_input]


def _params(operation, seen):
    if id(operation) in seen:
        return 0
    seen.add(id(operation))
    # Every weight, trainable or frozen: a frozen backbone still holds memory and
    # computes its forward (counting trainable weights only put it all in stage 0).
    return sum(int(_size(w)) for w in getattr(operation, "weights", ()))


def _size(variable):
    size = 1
    for d in variable.shape:
        size *= int(d)
    return size


def _producer_name(tensor):
    return internals.attr(tensor, "_keras_history").operation.name


def build_program(model, num_stages, time_layer=None):
    """Cuts a built Sequential or functional `model` into `num_stages` stages (inside
    nested Sequential and functional models too), balanced by parameters, or by time: `time_layer(layer, first)` gives a layer's seconds (`first`:
    it is the model's first, which sends no input gradient back)."""
    from tfpar.layers.stage_boundary import StageBoundary

    model_graph = functional_graph(model)
    graph = flattened(model_graph)
    nodes = _ordered_nodes(graph)
    names = [f"layer {node.operation.name!r}" for node in nodes]
    tensors = {id(t): t for node in nodes for t in list(node.input_tensors) + list(node.outputs)}
    tensors.update({id(t): t for t in graph.inputs})
    crossing = stages_plan.crossing_tensors(
        [[id(t) for t in node.input_tensors] for node in nodes],
        [[id(t) for t in node.outputs] for node in nodes],
        [id(t) for t in graph.inputs], [id(t) for t in graph.outputs])
    model_inputs = {id(t) for t in graph.inputs}
    activations = [[t for t in crossed if t not in model_inputs] for crossed in crossing]
    cuts = [i for i in range(1, len(nodes)) if len(activations[i - 1]) == 1]
    boundaries = [i for i, node in enumerate(nodes) if isinstance(node.operation, StageBoundary)]
    for i in boundaries:
        if i == 0:
            raise PlacementError(
                f"StageBoundary {nodes[i].operation.name!r} is the model's first layer: a "
                f"marker starts a new stage, so it must come after at least one layer.")
        if i not in cuts:
            crossers = ", ".join(sorted({_producer_name(tensors[t])
                                         for t in activations[i - 1]}))
            raise PlacementError(
                f"StageBoundary {nodes[i].operation.name!r} cannot start a stage: "
                f"{len(activations[i - 1])} tensors cross there (outputs of {crossers}), but "
                f"a pipeline passes exactly one activation from a stage to the next (with "
                f"the model's inputs later layers read). Move the marker to a point where a "
                f"single tensor flows, e.g. after the layer that joins the branches.")
    seen = set()
    if time_layer is not None:
        costs = [time_layer(node.operation, i == 0) for i, node in enumerate(nodes)]
    else:
        costs = [_params(node.operation, seen) for node in nodes]
    if not any(costs):
        costs = [1] * len(nodes)
    ranges = stages_plan.stage_ranges(costs, num_stages, cuts, boundaries, names)

    stages, placed, owned_layers = [], set(), set()
    for index, (start, stop) in enumerate(ranges):
        stage_nodes = tuple(nodes[start:stop])
        layers = _distinct(node.operation for node in stage_nodes
                           if hasattr(node.operation, "variables"))
        trainable = _distinct(v for layer in layers for v in layer.trainable_variables)
        # An OnDevice layer runs on the device it names: its variables live there.
        own_variables = [v for layer in layers if not _is_pinned(layer)
                         for v in layer.variables if id(v) not in placed]
        placed.update(id(v) for v in own_variables)
        regularized = [layer for layer in layers if id(layer) not in owned_layers]
        owned_layers.update(id(layer) for layer in layers)
        seeds = _distinct(sg.state for layer in layers
                          for sub in internals.attr(layer, "_flatten_layers")()
                          for sg in internals.attr(sub, "_seed_generators"))
        stages.append(Stage(
            index=index, nodes=stage_nodes,
            input_tensors=_crossing(tensors, crossing, start, len(nodes), model_inputs),
            output_tensors=_crossing(tensors, crossing, stop, len(nodes), model_inputs),
            layers=layers, trainable_variables=trainable,
            placed_variables=tuple(_distinct(own_variables)), regularized_layers=tuple(regularized),
            seed_variables=seeds))
    return StageProgram(graph, stages, model_graph)


def _crossing(tensors, crossing, cut, num_nodes, model_inputs):
    """The tensors crossing the cut before node `cut` (none at either end): the activation
    first, then the model inputs crossing with it."""
    if cut in (0, num_nodes):
        return ()
    return tuple(tensors[t] for t in sorted(crossing[cut - 1], key=lambda t: t in model_inputs))


def _is_pinned(layer):
    # (tfpar.layers.OnDevice, by its mark: importing it would import the runtime.)
    return getattr(type(layer), "_tfpar_pins_device", False)


def pinned_variables(program):
    """[(variables, device)] of the `OnDevice` layers a program runs."""
    found, seen = [], set()
    for stage in program.stages:
        for layer in stage.layers:
            if _is_pinned(layer) and id(layer) not in seen and layer.pinned_device:
                seen.add(id(layer))
                found.append((tuple(layer.variables), layer.pinned_device))
    return found


def _distinct(items):
    seen, result = set(), []
    for item in items:
        if id(item) not in seen:
            seen.add(id(item))
            result.append(item)
    return tuple(result)
