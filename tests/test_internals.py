"""The manifest of Keras/TensorFlow privates: each exists in the pinned versions, tfpar reads
no other, and a missing one fails closed with the versions named."""

import ast
import importlib
import inspect
import pathlib
import re

import keras
import pytest
import tensorflow as tf

from tfpar.errors import InternalsError
from tfpar.keras import internals

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tfpar"
SOURCES = {p: p.read_text() for p in ROOT.rglob("*.py")}


def test_the_installed_versions_are_in_the_tested_ranges_which_setup_declares():
    setup = (ROOT.parent / "setup.py").read_text()
    for package in ("keras", "tensorflow"):
        oldest, newest = (internals.release(v) for v in internals.TESTED_WITH[package])
        assert oldest <= internals.installed(package) <= newest, package
        declared = re.search(rf'"{package}>=([\d.]+),<([\d.]+)"', setup)
        assert declared, f"setup.py declares no range for {package}"
        assert internals.release(declared[1]) == oldest[:len(internals.release(declared[1]))]
        # The upper bound is the next minor release after the newest tested one.
        assert internals.release(declared[2]) == (newest[0], newest[1] + 1)


def test_a_private_only_newer_releases_have_gives_what_older_ones_mean(monkeypatch):
    class Old:
        pass

    monkeypatch.setitem(internals.SINCE, "_layout", ("keras", "99.0.0", None))
    assert internals.attr(Old(), "_layout") is None  # An older Keras: no own layout.
    monkeypatch.setitem(internals.SINCE, "_layout", ("keras", "3.0.0", None))
    with pytest.raises(InternalsError, match=r"_layout.*tested with Keras 3\.10\.0 to"):
        internals.attr(Old(), "_layout")  # A release that should have it: fails closed.


@pytest.mark.parametrize("path", sorted(internals.SYMBOLS))
def test_every_private_symbol_exists(path):
    assert internals.symbol(path) is not None


def _objects():
    """Objects that carry each private attribute in the pinned versions."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dropout(0.5, seed=1)(keras.layers.Dense(3)(inputs))
    functional = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    functional.compile("sgd", "mse", jit_compile=False)
    sequential = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        mirrored = tf.Variable(1.0)
    optimizer = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
    optimizer.build(functional.trainable_variables)
    with tf.Graph().as_default():
        graph_op = tf.constant(0.0).op
    model_objects = [optimizer, functional, functional.layers[1], functional._compile_loss, sequential,
                     hidden, functional.weights[0], functional.weights[0]._value, mirrored,
                     mirrored._values[0].handle, strategy.extended,
                     tf.distribute.OneDeviceStrategy("/cpu:0").extended,
                     keras.layers.BatchNormalization(),
                     keras.callbacks.BackupAndRestore("/tmp/tfpar-test-unused"), graph_op,
                     internals.symbol("keras.src.saving.saving_lib")]
    return model_objects


def test_every_private_attribute_exists():
    objects = _objects()
    # A multi-worker strategy would configure this process's collectives: read the
    # attributes its extended sets from the class's source instead.
    collective = inspect.getsource(internals.symbol(
        "tensorflow.python.distribute.collective_all_reduce_strategy."
        "CollectiveAllReduceExtended"))
    # Nor can a coordinator and its remote values be made without a cluster.
    coordinator = "".join(
        inspect.getsource(getattr(importlib.import_module(f"tensorflow.python.distribute.{m}"), c))
        for m, c in (("coordinator.cluster_coordinator", "ClusterCoordinator"),
                     ("coordinator.values", "RemoteValueImpl")))
    missing = [name for name in internals.ATTRIBUTES
               if not any(hasattr(obj, name) for obj in objects)
               and not (name in internals.SINCE and internals.installed(
                   internals.SINCE[name][0]) < internals.release(internals.SINCE[name][1]))
               and f"self.{name} =" not in collective + coordinator]
    assert not missing, f"not found on any reference object: {missing}"


def _literal_calls(function):
    pattern = re.compile(rf"internals\.{function}\(\s*(?:[^,()]+(?:\([^()]*\))?,\s*)?\n?\s*\"([^\"]+)\"")
    return {(p.name, m) for p, text in SOURCES.items() for m in pattern.findall(text)}


def test_tfpar_reads_only_privates_in_the_manifest():
    used = _literal_calls("symbol") | _literal_calls("attr")
    assert len(used) > 40  # The scan itself works.
    unknown = sorted((f, n) for f, n in used if n not in internals.MANIFEST)
    assert not unknown


def test_private_modules_are_imported_through_the_manifest_only():
    found = []
    for path, text in SOURCES.items():
        if path.name == "internals.py":
            continue
        for node in ast.walk(ast.parse(text)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {n}" for n in names
                      if n.startswith(("keras.src", "tensorflow.python"))]
    assert not found


def test_no_private_is_read_with_a_default():
    """`getattr(obj, "_private", default)` would silently change behaviour if the private
    went away (fail open); tfpar's own `_tfpar_` attributes are exempt."""
    pattern = re.compile(r"getattr\([^,]+,\s*\"(_(?!tfpar)[a-z]\w*)\"\s*,")
    found = [(p.name, m) for p, text in SOURCES.items() if p.name != "internals.py"
             for m in pattern.findall(text)]
    assert not found


def test_a_missing_private_fails_closed_naming_the_versions(monkeypatch):
    installed = rf"installed: Keras {re.escape(keras.__version__)}, TensorFlow {re.escape(tf.__version__)}"
    tested = r"tested with Keras 3\.10\.0 to 3\.15\.1 and TensorFlow 2\.19\.0 to 2\.21\.0"
    with pytest.raises(InternalsError, match=rf"_compile_loss.*{installed}.*{tested}"):
        internals.attr(object(), "_compile_loss")
    monkeypatch.setitem(internals.SYMBOLS, "keras.src.no_such_module.thing", "test")
    internals.symbol.cache_clear()
    with pytest.raises(InternalsError, match=rf"keras.src.no_such_module.thing.*{tested}"):
        internals.symbol("keras.src.no_such_module.thing")
    with pytest.raises(KeyError, match="manifest"):
        internals.attr(object(), "_not_in_the_manifest")


def test_a_changed_compiled_loss_fails_closed():
    """If `_compile_loss._flat_losses` changed shape, the pipeline would scale sum losses
    by 1/M: it must refuse instead."""
    from tfpar.keras.losses import SUM, loss_kind

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", keras.losses.MeanSquaredError(reduction="sum"))
    model._compile_loss.build(tf.zeros((1, 1)), tf.zeros((1, 1)))
    assert loss_kind(model, weighted=False) == SUM
    model._compile_loss._flat_losses = [object()]
    with pytest.raises(InternalsError, match="_flat_losses"):
        loss_kind(model, weighted=False)


def test_a_renamed_seed_generator_list_fails_closed():
    """remat replays the layers' random states: without them Dropout masks would silently
    differ between the forward and its recomputation."""
    from tfpar.keras.stages import build_program

    class RenamedSeeds(keras.layers.Dropout):  # A Keras whose layers keep seeds elsewhere.
        @property
        def _seed_generators(self):
            raise AttributeError("_seed_generators")

        @_seed_generators.setter
        def _seed_generators(self, value):
            pass

        @property
        def variables(self):
            return []

    def model(dropout):
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), dropout,
                                 keras.layers.Dense(2)])

    program = build_program(model(keras.layers.Dropout(0.5, seed=1)), 2)
    assert program.stages[0].seed_variables  # The real layers have it.
    with pytest.raises(InternalsError, match="_seed_generators"):
        build_program(model(RenamedSeeds(0.5, seed=1)), 2)


def test_a_callback_without_its_model_fails_closed():
    """Non-chief workers skip checkpoint writes by asking the callback's model for its
    strategy; if Keras stopped setting it, every worker would write again."""
    from tfpar.keras.hooks import _is_non_chief_worker

    with pytest.raises(InternalsError, match="Callback.model"):
        _is_non_chief_worker(keras.callbacks.Callback())


def test_a_keras_that_does_not_name_the_layer_being_built_fails_closed(monkeypatch):
    """Placing strategies find the layer creating a variable on Keras' name-scope stack; if
    Keras stopped putting it there, every variable would be born on the first device."""
    from keras.src.backend.common import global_state
    from tfpar.keras import variable_birth

    variable_birth.check_layers_name_themselves()  # The pinned Keras names it.
    get = global_state.get_global_attribute

    class Forgetful(list):  # Keras' scopes still push and pop; nothing is kept.
        def append(self, item):
            pass

        def pop(self, *args):
            return None

    def stack_without_callers(name, *args, **kwargs):
        value = get(name, *args, **kwargs)
        return Forgetful() if name == "name_scope_stack" else value

    monkeypatch.setattr(global_state, "get_global_attribute", stack_without_callers)
    internals.symbol.cache_clear()
    try:
        with pytest.raises(InternalsError, match="name-scope stack naming the layer"):
            variable_birth.check_layers_name_themselves()
    finally:
        monkeypatch.undo()
        internals.symbol.cache_clear()
