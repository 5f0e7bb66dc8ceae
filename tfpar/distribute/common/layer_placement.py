"""What ModelParallelStrategy and PipelineStrategy share: when a model is placed, and where
its variables are born.

*When.* Placing needs the whole built model: a balanced plan weighs every layer, stage cuts
need the whole graph, a memory limit is checked on the plan's totals. A model created under
the strategy's scope is placed once: just before it first runs (the Keras seam's model-call
hook; an unbuilt model is first built from the shapes of that call, allocating nothing), or
when one of its variables is first read or written before that (weights loaded, a
checkpoint restored), or by the strategy's report.

*Where a variable is born* (the strategy's answer to `tfpar.keras.variable_birth`):

- a layer whose device is known when it is built (`strategy._known_home(layer)`: a
  placement dict or callable, a layer already placed; `OnDevice` names its own): the
  variable is created there;
- any other layer's variable (a balanced plan, pipeline stages, a memory limit to check
  first), and a layer's random state made in its constructor (which layer, and so which
  device, shows only in its model): it is kept without storage, like the variables Keras
  makes while building a model from shapes, and gets its storage on its device when the
  model is placed;
- variables of no layer (metrics, the optimizer's own, a subclassed model's own weights):
  where the strategy puts them by default (its first device; each pipeline replica's first
  device). Optimizer state is created next to its variable.

So no variable is created on a device of the strategy and moved away later. A variable
kept without storage that is used when no model of the strategy holds it gets its storage
where variables of no layer go.
"""

import contextlib
import threading
import weakref

import tensorflow as tf

from tfpar.contract import StrategyHooks
from tfpar.errors import PlacementError
from tfpar.keras import models
from tfpar.keras import steps
from tfpar.keras import variable_birth

_local = threading.local()


class PlacingStrategy(StrategyHooks):
    """Mixin of the strategies that place a model's layers on devices.

    The strategy defines `_lock` (an RLock), `_default_home` (the devices of a variable of
    no layer, one per copy), `_place(model)` and `_known_home(layer)` (the devices of a
    layer's variables when known before its model is placed, else None).
    """

    # Read by the Keras seam: optimizer updates one variable after another, so that a
    # device holds one update's temporaries at a time (`tfpar.keras.replicas`).
    _tfpar_updates_in_turn = True
    # Read by the Keras seam: a replica's gradients live on its layers' devices; the
    # optimizer's sum over replicas leaves each where it is (`tfpar.keras.replicas`).
    _tfpar_replica_spans_devices = True

    # Called by the Keras seam before every call of a model created under this scope.
    def _tfpar_before_model_call(self, model, args, kwargs):
        if getattr(model, "_tfpar_placed_by", None) is not None:
            return
        building = _local.__dict__.setdefault("building", set())
        # A functional model built out of this one, our own build, or Keras inferring the
        # output of a layer that calls this model (a Sequential inside a custom layer,
        # given placeholders, not KerasTensors: inside another layer's call): nothing
        # runs, and this model is a part. (Keras' symbolic build of the model itself, also
        # in a symbolic scope, is the model's own call: it is placed.)
        if (models.any_symbolic_tensors(args, kwargs) or id(model) in building
                or (models.in_symbolic_scope() and steps.inside_a_layer_call())):
            return
        # In a StatelessScope, variables Keras creates get no storage until it ends
        # (even inside Keras' own symbolic build): placing gives them storage on their
        # device before that.
        with models.stateless_scope():
            if not is_built(model):
                building.add(id(model))
                try:
                    models.build_symbolically(model, args, kwargs)
                finally:
                    building.discard(id(model))
            self._place(model)

    # Called by the Keras seam for each model created under this scope.
    def _tfpar_model_created(self, model):
        with self._lock:
            created = self.__dict__.setdefault("_placed_models", [])
            created[:] = [m for m in created if m() is not None]
            created.append(weakref.ref(model))

    # Called by the Keras seam when a Keras variable is about to get its storage.
    def _tfpar_variable_home(self, variable, callers):
        unit = models.creating_layer(callers)
        if unit is None:
            # A layer's random state made in its constructor waits for the layer's model.
            seeds = models.made_by_seed_generator(callers)
            return variable_birth.PENDING if seeds else None
        home = self._known_home(unit)
        return variable_birth.PENDING if home is None else home

    # Called by the Keras seam when a variable kept without storage is used concretely.
    def _tfpar_first_use(self, variable):
        with self._lock:
            if not variable_birth.is_pending(variable):
                return
            owner = self._owner_of(variable)
            if owner is not None:
                self._place(owner)
            if variable_birth.is_pending(variable):  # Held by no model it can place.
                with tf.init_scope(), self._creating_variables():
                    variable_birth.materialize(variable, self._default_home)

    def _creating_variables(self):
        """This strategy's scope unless it is entered: a model may be placed outside it (a
        report, a model called without it), and its variables are created by its creator.
        Enter it under `tf.init_scope()`, where variables are created."""
        if tf.distribute.has_strategy() and tf.distribute.get_strategy() is self:
            return contextlib.nullcontext()
        return self.scope()

    def _owner_of(self, variable):
        """The outermost unplaced, built model created under this scope that holds
        `variable` (the last one created if several), or None."""
        owners = [model for model in (ref() for ref in self.__dict__.get("_placed_models", ()))
                  if model is not None and getattr(model, "_tfpar_placed_by", None) is None
                  and is_built(model) and any(v is variable for v in model.variables)]
        # Models inside another (a Sequential's own functional model too) are left out.
        inside = {id(held) for model in owners for held in models.held_inside(model)}
        outermost = [model for model in owners if id(model) not in inside]
        return outermost[-1] if outermost else None


def claim_model(strategy, model, placed, why_built):
    """False when `strategy` has placed `model` already; raises if it cannot place it."""
    placed_by = getattr(model, "_tfpar_placed_by", None)
    if placed_by is strategy and placed:
        return False
    if placed_by is not None:
        raise PlacementError(
            f"Model {model.name!r} is already placed by {placed_by!r} (alone or "
            f"inside another model); place the outer model once.")
    if not is_built(model):
        raise PlacementError(
            f"Model {model.name!r} is not built, so {why_built}. Build it first: call it "
            f"on a batch, or give it a keras.Input.")
    return True


def mark_placed(strategy, model):
    """Records that `strategy` placed `model` and the models inside it."""
    for sub in [model] + [layer for layer in models.all_layers(model)
                          if models.is_model(layer)]:
        object.__setattr__(sub, "_tfpar_placed_by", strategy)


def is_built(model):
    """True when the model and every layer in it are built (their variables exist, with
    storage or not)."""
    return model.built and all(layer.built for layer in models.all_layers(model))
