"""Where a Keras variable gets its storage, asked of the strategy that places its layer.

Keras gives a variable its TensorFlow storage in one method, `_initialize_with_initializer`:
when the variable is created, or later for a variable Keras made without storage while
building a model from shapes (inside a `keras.StatelessScope`; `_deferred_initialize` gives
it storage when the scope ends). tfpar wraps both once. Under a strategy that defines
`_tfpar_variable_home(variable, callers)`, the strategy answers where the storage goes (a
home: one device per copy of the variable, see `variable_home`), None for its own default,
or `PENDING`: the variable is kept without storage, in the state of Keras' own deferred
variables (shape and dtype known; while Keras traces shapes it reads its initializer's
values), until the strategy knows its device and calls `materialize`.

A pending variable that is read or written concretely before then (weights loaded, a
checkpoint restored, a custom loop) first asks the strategy
(`_tfpar_first_use(variable)`), which places the variable's model or gives it storage where
variables of no layer go. Models created under such a strategy are announced to it
(`_tfpar_model_created(model)`) so that it can find a variable's model then.

`callers` are the objects on Keras' name-scope stack, outermost first: the layers being
built or called, then the metric, optimizer or seed generator creating the variable.
"""

import contextlib
import threading

from tfpar.contract import hooks_of
from tfpar.keras import internals

_local = threading.local()
_checked = []  # [True] once Keras was seen naming the layer that creates a variable.


class _Pending:
    """The answer that keeps a variable without storage for now."""

    def __repr__(self):
        return "PENDING"


PENDING = _Pending()


@contextlib.contextmanager
def variable_home(devices):
    """Variables created meanwhile by tfpar's placing strategies get their copies on `devices`.

    `devices`: one device for every copy, or one per copy (a pipeline's replicas).
    """
    previous = getattr(_local, "home", None)
    _local.home = tuple(devices)
    try:
        yield
    finally:
        _local.home = previous


def current_variable_home():
    """The devices of the innermost `variable_home` scope, or None."""
    return getattr(_local, "home", None)


def callers():
    """The objects Keras' name-scope stack names (layers being built or called), outermost
    first."""
    stack = internals.symbol("keras.src.backend.common.global_state.get_global_attribute")(
        "name_scope_stack") or []
    internals.check(all(hasattr(scope, "caller") for scope in stack),
                    "Keras name scopes that name their caller (the layer being built)")
    return [scope.caller for scope in stack if scope.caller is not None]


def has_no_storage(variable):
    """True for a Keras variable that is pending, or deferred by Keras' symbolic build."""
    return internals.attr(variable, "_value") is None


def is_pending(variable):
    """True for a variable a strategy keeps without storage until it knows its device."""
    return has_no_storage(variable) and isinstance(
        internals.attr(variable, "_initializer"), _Initializer)


def materialize(variable, home):
    """Gives a variable without storage its storage on `home` (devices, see `variable_home`),
    with the values its initializer makes."""
    import tensorflow as tf

    initializer = internals.attr(variable, "_initializer")
    if isinstance(initializer, _Initializer):
        initializer = initializer.initializer
    # The TensorFlow name it would have had, made in its layer's name scope ("/": absolute).
    scope = variable.path.rpartition("/")[0]
    # init_scope: it may be needed first while a tf.function or a Keras shape trace runs.
    named = tf.name_scope(scope + "/") if scope else contextlib.nullcontext()
    with tf.init_scope(), named, variable_home(home):
        internals.attr(variable, "_initialize_with_initializer")(initializer)
    internals.set_attr(variable, "_initializer", None)  # As Keras' own does.


class _Initializer:
    """A pending variable's initializer: Keras' placeholder values while shapes are traced;
    any other use first asks the strategy for the variable's storage."""

    def __init__(self, initializer, variable, strategy):
        import weakref

        self.initializer = initializer
        self._variable = weakref.ref(variable)
        self._strategy = strategy

    def __call__(self, shape, dtype=None):
        if tracing_shapes():
            return self.initializer(shape, dtype=dtype)
        variable = self.give_storage()
        # What Keras' `Variable.value` returns for a variable with storage.
        return internals.attr(variable, "_value")

    def give_storage(self):
        """Asks the strategy for the variable's storage now; returns the variable."""
        variable = self._variable()
        self._strategy._tfpar_first_use(variable)  # pylint: disable=protected-access
        internals.check(not has_no_storage(variable),
                        "a pending variable given storage by its strategy")
        return variable


def tracing_shapes():
    """True while Keras traces shapes (symbolic build, StatelessScope): values read there
    are placeholders."""
    return (internals.symbol("keras.src.backend.common.stateless_scope.in_stateless_scope")()
            or internals.symbol("keras.src.backend.common.symbolic_scope.in_symbolic_scope")())


def _ask(variable):
    """(strategy, its answer) for a variable about to get storage; (None, None) when no
    strategy in scope places layers, or when a `variable_home` scope says where already."""
    if current_variable_home() is not None:
        return None, None
    import tensorflow as tf

    strategy = tf.distribute.get_strategy()
    ask = hooks_of(strategy)._tfpar_variable_home
    if ask is None:
        return None, None
    return strategy, ask(variable, callers())


def _keep_pending(variable, initializer, strategy):
    # The state Keras gives the variables it creates in a StatelessScope (in __init__).
    init = internals.symbol("keras.src.backend.tensorflow.core.Variable").__init__
    internals.set_attr(variable, "_value", None, set_by=init)
    internals.set_attr(variable, "_initializer", _Initializer(initializer, variable, strategy),
                       set_by=init)


def _home_scope(home):
    return variable_home(home) if home else contextlib.nullcontext()


def _born_at_home(initialize_with_initializer):
    def wrapper(self, initializer):
        strategy, home = _ask(self)
        if home is PENDING:
            return _keep_pending(self, initializer, strategy)
        with _home_scope(home):
            return initialize_with_initializer(self, initializer)
    return wrapper


def _deferred_born_at_home(deferred_initialize):
    def wrapper(self):
        if not has_no_storage(self):
            return None  # tfpar gave it storage on its device while Keras' scope was open.
        strategy, home = _ask(self)
        if home is PENDING:
            return _keep_pending(self, internals.attr(self, "_initializer"), strategy)
        with _home_scope(home):
            return deferred_initialize(self)
    return wrapper


def _stored_before_written(direct_assign):
    def wrapper(self, value):
        if is_pending(self):
            internals.attr(self, "_initializer").give_storage()
        return direct_assign(self, value)
    return wrapper


def _restored_with_its_shape(restore_from_tensors):
    """A TensorFlow checkpoint restored across tasks (a pipeline's stages on workers) runs
    in a tf.function, where a restored tensor's shape is unknown, and Keras' fallback
    `assign` compares shapes statically ("Cannot take the length of shape with unknown
    rank"): the tensor takes the variable's shape, checked when it runs."""
    import tensorflow as tf

    def wrapper(self, restored_tensors):
        value = restored_tensors.get(VALUE_KEY)
        if isinstance(value, tf.Tensor) and value.shape.rank is None:
            restored_tensors = {**restored_tensors,
                                VALUE_KEY: tf.ensure_shape(value, self.shape)}
        return restore_from_tensors(self, restored_tensors)
    return wrapper


VALUE_KEY = "VARIABLE_VALUE"  # (TensorFlow's `trackable.base.VARIABLE_VALUE_KEY`.)


def _slices_restored_together(restore):
    """TrackableSaveable.restore: TensorFlow 2.21 keys the restored tensors by local name,
    so an object saved as several slices under one name (a tensor-parallel variable, as its
    shards' slices) would get one of them. For a Keras variable whose storage restores
    slices (`RESTORES_SLICES`), each name maps to {slice spec: tensor}: every slice, each
    read by the restore op of its own device (across processes, its owner's)."""
    import keras
    import tensorflow as tf

    def wrapper(self, restored_tensors, restored_shapes):
        trackable = internals.attr(self, "_trackable")
        names = internals.attr(self, "_local_names")
        # (Its one name, VARIABLE_VALUE, for the specs of all its slices.)
        if len(names) != 1 or len(self.specs) < 2 or not isinstance(trackable, keras.Variable) \
                or not getattr(type(internals.attr(trackable, "_value")), "RESTORES_SLICES",
                               False):
            return restore(self, restored_tensors, restored_shapes)
        grouped = {names[0]: {spec.slice_spec: tensor
                              for spec, tensor in zip(self.specs, restored_tensors)}}
        internals.attr(trackable, "_restore_from_tensors")(grouped)
        return tf.no_op()
    return wrapper


def _announced_to_the_strategy(init):
    def wrapper(self, *args, **kwargs):
        init(self, *args, **kwargs)
        announce = hooks_of(internals.attr(self, "_distribute_strategy"))._tfpar_model_created
        if announce is not None:
            announce(self)
    return wrapper


def check_layers_name_themselves():
    """Fails closed unless the layer creating a variable is on Keras' name-scope stack: a
    Keras that stopped putting it there would have every variable born on the strategy's
    first device, silently."""
    import keras
    import tensorflow as tf

    seen = []

    def probe(next_creator, **kwargs):
        seen.append(callers())
        return next_creator(**kwargs)

    layer = keras.layers.Layer(name="tfpar_probe")
    with tf.init_scope(), tf.device("/cpu:0"), tf.variable_creator_scope(probe):
        layer.add_weight(shape=(), initializer="zeros", name="probe")
    internals.check(len(seen) == 1 and any(caller is layer for caller in seen[0]),
                    "Keras' name-scope stack naming the layer that creates a variable")


def patches():
    """What tfpar replaces in Keras so that variables are born on their device:
    (owner, attribute, wrap)."""
    variable = internals.symbol("keras.src.backend.tensorflow.core.Variable")
    trainer = internals.symbol("keras.src.backend.tensorflow.trainer.TensorFlowTrainer")
    saveable = internals.symbol(
        "tensorflow.python.training.saving.saveable_object_util.TrackableSaveable")
    for name in ("_initialize_with_initializer", "_deferred_initialize", "_direct_assign",
                 "_restore_from_tensors"):
        internals.attr(variable, name)  # Fails closed before anything is wrapped.
    if not _checked:  # Once, before the wrappers ask strategies.
        check_layers_name_themselves()
        _checked.append(True)
    return [(variable, "_initialize_with_initializer", _born_at_home),
            (variable, "_deferred_initialize", _deferred_born_at_home),
            (variable, "_direct_assign", _stored_before_written),
            (variable, "_restore_from_tensors", _restored_with_its_shape),
            (saveable, "restore", _slices_restored_together),
            (trainer, "__init__", _announced_to_the_strategy)]
