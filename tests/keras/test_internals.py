"""The manifest of Keras/TensorFlow privates: each exists in the pinned versions, tfpar reads
no other, and a missing one fails closed with the versions named."""

import ast
import contextlib
import importlib
import importlib.util
import inspect
import pathlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfpar.errors import InternalsError
from tfpar.keras import internals

ROOT = pathlib.Path(__file__).resolve().parents[2] / "tfpar"
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
    averaging = keras.optimizers.SGD(0.1, use_ema=True)
    averaging.build(functional.trainable_variables)
    with tf.Graph().as_default():
        graph_op = tf.constant(0.0).op
    collective_ops = internals.symbol(
        "tensorflow.python.distribute.cross_device_ops.CollectiveAllReduce")(
        devices=["/cpu:0"], group_size=1,
        options=internals.symbol("tensorflow.python.distribute.collective_util.Options")())
    epoch_iterator = internals.symbol("keras.src.backend.tensorflow.trainer.TFEpochIterator")(
        distribute_strategy=strategy, x=np.zeros((4, 4), "float32"), batch_size=2)
    attention = keras.layers.MultiHeadAttention(2, 4)
    attention(np.zeros((1, 3, 8), "float32"), np.zeros((1, 3, 8), "float32"))
    model_objects = [optimizer, averaging, functional, functional.layers[1], functional._compile_loss, sequential,
                     hidden, functional.weights[0], functional.weights[0]._value, mirrored,
                     mirrored._values[0].handle, strategy.extended,
                     tf.distribute.OneDeviceStrategy("/cpu:0").extended,
                     keras.layers.BatchNormalization(), attention,
                     keras.callbacks.BackupAndRestore("/tmp/tfpar-test-unused"), graph_op,
                     epoch_iterator, collective_ops,
                     internals.symbol("keras.src.saving.saving_lib"),
                     internals.symbol("keras.src.backend.tensorflow.distribution_lib")]
    try:  # (keras-hub is optional: the oldest pair's environment has none.)
        from keras_hub.src.models.llama.llama_attention import LlamaAttention
    except ImportError:
        return model_objects
    llama = LlamaAttention(num_query_heads=2, num_key_value_heads=1)
    llama.build((1, 3, 8))
    return model_objects + [llama]


KERAS_HUB_ATTRIBUTES = ("_inv_norm_factor",)


def _has_keras_hub():
    return importlib.util.find_spec("keras_hub") is not None


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
    # A checkpoint's saveable of a trackable is made inside TensorFlow's restore only.
    saveable = inspect.getsource(internals.symbol(
        "tensorflow.python.training.saving.saveable_object_util.TrackableSaveable"))
    missing = [name for name in internals.ATTRIBUTES
               if not any(hasattr(obj, name) for obj in objects)
               and not (name in internals.SINCE and internals.installed(
                   internals.SINCE[name][0]) < internals.release(internals.SINCE[name][1]))
               and f"self.{name} =" not in collective + coordinator + saveable
               and not (name in KERAS_HUB_ATTRIBUTES and not _has_keras_hub())]
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
    from tfpar.keras.pipeline_stages import build_program

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


@contextlib.contextmanager
def _keras_global_state(monkeypatch, answer):
    """Keras' global state, each attribute's value passed through `answer(name, value)`."""
    from keras.src.backend.common import global_state

    get = global_state.get_global_attribute
    monkeypatch.setattr(global_state, "get_global_attribute",
                        lambda name, *a, **k: answer(name, get(name, *a, **k)))
    internals.symbol.cache_clear()
    try:
        yield
    finally:
        monkeypatch.undo()
        internals.symbol.cache_clear()


def test_a_keras_that_does_not_name_the_layer_being_built_fails_closed(monkeypatch):
    """Placing strategies find the layer creating a variable on Keras' name-scope stack; if
    Keras stopped putting it there, every variable would be born on the first device."""
    from tfpar.keras import variable_birth

    variable_birth.check_layers_name_themselves()  # The pinned Keras names it.

    class Forgetful(list):  # Keras' scopes still push and pop; nothing is kept.
        def append(self, item):
            pass

        def pop(self, *args):
            return None

    with _keras_global_state(monkeypatch, lambda name, value: (
            Forgetful() if name == "name_scope_stack" else value)):
        with pytest.raises(InternalsError, match="name-scope stack naming the layer"):
            variable_birth.check_layers_name_themselves()


# --- Overrides, wraps and writes -----------------------------------------------------------

def _tfpar_classes():
    """Every class tfpar defines at module level or inside another class."""
    import pkgutil

    import tfpar

    found = {}
    for info in pkgutil.walk_packages(tfpar.__path__, "tfpar."):
        if info.name.endswith("__main__"):
            continue
        for value in vars(importlib.import_module(info.name)).values():
            if inspect.isclass(value) and value.__module__.startswith("tfpar"):
                for cls in [value, *[v for v in vars(value).values() if inspect.isclass(v)]]:
                    if cls.__module__.startswith("tfpar"):
                        found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


def _decorated_classes():
    """ClassDefs of tfpar's sources decorated with internals.overrides (those made inside a
    function too), with the private methods each defines."""
    found = {}
    for path, text in SOURCES.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and any(
                    ast.unparse(d) == "internals.overrides" for d in node.decorator_list):
                found[(path.name, node.name)] = {
                    f.name for f in node.body if isinstance(f, ast.FunctionDef)
                    and f.name.startswith("_") and not f.name.startswith(("__", "_tfpar_"))}
    return found


def test_every_override_of_a_private_is_in_the_manifest_and_checked():
    """Derived, not declared: a tfpar class that defines a private its TensorFlow or Keras base
    also defines overrides it; each such private is in OVERRIDES and its class is checked."""
    derived, unchecked = {}, []
    for name, cls in _tfpar_classes().items():
        overridden = internals.overridden(cls)
        if overridden:
            derived[name] = overridden
            if name not in internals.overriding:
                unchecked.append(name)
    assert len(derived) >= 5  # The scan itself works (strategies' extendeds, MeshVariable).
    unlisted = {n: sorted(o - set(internals.OVERRIDES)) for n, o in derived.items()
                if o - set(internals.OVERRIDES)}
    assert not unlisted, f"overrides missing from internals.OVERRIDES: {unlisted}"
    assert not unchecked, f"classes overriding privates without @internals.overrides: {unchecked}"
    # Classes made inside functions (ReadFromOwner) are found in the sources: every class that
    # defines a listed private is decorated, and every listed override is someone's.
    decorated = _decorated_classes()
    for path, text in SOURCES.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and (path.name, node.name) not in decorated:
                defined = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
                assert not defined & set(internals.OVERRIDES), (path.name, node.name)
    used = set().union(*derived.values(), *decorated.values())
    assert not set(internals.OVERRIDES) - used, "OVERRIDES lists privates nothing overrides"


def test_an_override_of_a_missing_private_fails_closed():
    tested = r"tested with Keras 3\.10\.0 to 3\.15\.1 and TensorFlow 2\.19\.0 to 2\.21\.0"

    class Extended:  # A TensorFlow whose extended has it.
        def _create_variable(self, next_creator, **kwargs):
            return next_creator(**kwargs)

    class Renamed:  # A TensorFlow that renamed it: the override would never be called.
        def _make_variable(self, next_creator, **kwargs):
            return next_creator(**kwargs)

    def subclass(base, **members):
        return type("Subclass", (base,), {"__module__": "tfpar.example", **members})

    def create(self, next_creator, **kwargs):
        return next_creator(**kwargs)

    assert internals.overrides(subclass(Extended, _create_variable=create))
    with pytest.raises(InternalsError, match=rf"_create_variable of Renamed.*Subclass.*{tested}"):
        internals.overrides(subclass(Renamed, _create_variable=create))
    # An override of a private that is not in the manifest is refused too.
    with pytest.raises(KeyError, match="_make_variable.*internals.OVERRIDES"):
        internals.overrides(subclass(Renamed, _make_variable=create))
    # A tfpar mixin's overrides are checked on each TensorFlow class mixing it in.
    mixin = internals.overrides(type("Mixin", (), {"__module__": "tfpar.example",
                                                   "_create_variable": create}))
    assert internals.overrides(type("Mixed", (mixin, Extended), {"__module__": "tfpar.example"}))
    with pytest.raises(InternalsError, match=rf"_create_variable of Renamed.*Mixed.*{tested}"):
        internals.overrides(type("Mixed", (mixin, Renamed), {"__module__": "tfpar.example"}))


def _all_wraps(monkeypatch):
    """(owner name, attribute) of every wrap tfpar installs, recorded without wrapping."""
    from tfpar.distribute.mesh import mesh_strategy
    from tfpar.keras import hooks
    from tfpar.keras import keras_distribution as mesh
    from tfpar.keras import ps_adapters as parameter_server
    from tfpar.keras import replicas
    from tfpar.keras import variable_birth
    from tfpar.keras import zero_optimizers as sharded

    recorded = set()

    def record(owner, name, wrap, marker):
        internals.wrapped(owner, name)
        recorded.add((owner.__name__, name))

    monkeypatch.setattr(hooks, "_wrap_once", record)
    monkeypatch.setattr(mesh, "_backend_functions", dict)  # (Nothing written into Keras.)
    for install in (hooks.install_multi_worker_callbacks, hooks.install_cluster_error_explanation,
                    hooks.install_exact_replicas, hooks.install_sharded_optimizers,
                    hooks.install_parameter_server_training, hooks.install_variable_births,
                    hooks.install_model_call_hook, hooks.install_train_step_hook,
                    mesh_strategy.use_keras_distribution):
        install()
    from_patches = {(owner.__name__, name) for module in (
        replicas, sharded, parameter_server, variable_birth) for owner, name, _ in module.patches()}
    return recorded, from_patches


def test_every_wrapped_attribute_is_in_the_manifest(monkeypatch):
    recorded, from_patches = _all_wraps(monkeypatch)
    assert from_patches <= recorded and len(recorded) > 40  # The recording works.
    expected = {wrap for wrap in internals.WRAPS if wrap not in internals.WRAPS_BEFORE
                or internals.installed(internals.WRAPS_BEFORE[wrap][0])
                < internals.release(internals.WRAPS_BEFORE[wrap][1])}
    assert recorded == expected, (
        f"wrapped but not listed: {sorted(recorded - expected)}; "
        f"listed but not wrapped: {sorted(expected - recorded)}")
    # And no module wraps Keras another way than through hooks._wrap_once.
    calls = [p.name for p, text in SOURCES.items() for _ in re.findall(r"_wrap_once\(", text)]
    assert set(calls) == {"hooks.py", "keras_distribution.py"}


def test_wrapping_a_missing_attribute_fails_closed():
    from tfpar.keras import hooks

    renamed = type("BackupAndRestore", (), {})  # A Keras whose callback lost _save_model.
    tested = r"tested with Keras 3\.10\.0 to 3\.15\.1 and TensorFlow 2\.19\.0 to 2\.21\.0"
    with pytest.raises(InternalsError, match=rf"BackupAndRestore\._save_model.*{tested}"):
        hooks._wrap_once(renamed, "_save_model", lambda original: original, "_tfpar_test")
    assert not hasattr(renamed, "_save_model")  # Nothing was written.
    with pytest.raises(KeyError, match="internals.WRAPS"):
        hooks._wrap_once(renamed, "_not_listed", lambda original: original, "_tfpar_test")


def _private(name):
    return name.startswith("_") and not name.startswith(("__", "_tfpar"))


def test_privates_are_written_through_the_manifest_only():
    """A TensorFlow or Keras private is written with internals.set_attr (which checks it is
    still there): directly on another object, by setattr with its name, or on `self` in a
    subclass of a TensorFlow or Keras class whose bases set it."""
    found = []
    for path, text in SOURCES.items():
        if path.name == "internals.py":
            continue
        tree = ast.parse(text)
        # `self` outside a class body is a Keras or TensorFlow object (a wrapped method's).
        in_classes = {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                      for n in ast.walk(c)}
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                       else [])
            for target in targets:
                for t in (target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]):
                    if (isinstance(t, ast.Attribute) and _private(t.attr)
                            and not (isinstance(t.value, ast.Name) and t.value.id == "self"
                                     and id(t) in in_classes)):
                        found.append(f"{path.name}:{t.lineno}: {ast.unparse(t)} =")
            if (isinstance(node, ast.Call) and ast.unparse(node.func) in (
                    "setattr", "object.__setattr__") and len(node.args) > 1
                    and isinstance(node.args[1], ast.Constant) and _private(node.args[1].value)):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    # `self._x = ...` in a tfpar subclass where a TensorFlow or Keras base has `_x`.
    for name, cls in _tfpar_classes().items():
        _, bases = internals.own_privates(cls)
        if not bases or cls.__module__ == "tfpar.errors":
            continue
        theirs = "".join(inspect.getsource(b) for b in bases
                         if b.__module__.startswith(("keras", "tensorflow")))
        source = inspect.getsource(cls)
        for written in set(re.findall(r"self\.(_\w+) =[^=]", source)):
            if _private(written) and (f"self.{written} =" in theirs
                                      or any(written in vars(b) for b in bases)):
                found.append(f"{name}: self.{written} =")
    assert not found, found


def test_a_write_of_a_missing_private_fails_closed():
    tested = r"tested with Keras 3\.10\.0 to 3\.15\.1 and TensorFlow 2\.19\.0 to 2\.21\.0"

    class Renamed:  # A Keras model that keeps its initial epoch elsewhere.
        pass

    model = Renamed()
    with pytest.raises(InternalsError, match=rf"Renamed\._initial_epoch.*{tested}"):
        internals.set_attr(model, "_initial_epoch", 3)
    assert not hasattr(model, "_initial_epoch")  # Not written for nothing.
    # A new object is checked against one of its kind.
    with pytest.raises(InternalsError, match=r"_distributed_container"):
        internals.set_attr(Renamed(), "_distributed_container", None, like=Renamed())
    handle = tf.Variable(1.0).handle
    internals.set_attr(handle, "_distributed_container", None, like=type(
        "Copy", (), {"_distributed_container": None})())
    assert handle._distributed_container is None
    with pytest.raises(KeyError, match="manifest"):
        internals.set_attr(model, "_not_in_the_manifest", 1)


def test_a_keras_without_its_call_context_fails_closed(monkeypatch):
    """Pipelines leave a model alone while Keras infers the output of a layer that calls it
    (a Sequential inside a custom layer): known from Keras' call context. A Keras that kept it
    under another name would have them place the inner model, silently."""
    from tfpar.keras import steps

    steps._call_context_checked.clear()
    assert steps.inside_a_layer_call() is False  # This Keras keeps it.
    steps._call_context_checked.clear()
    try:
        with _keras_global_state(monkeypatch, lambda name, value: (
                None if name == "current_call_ctx" else value)):
            with pytest.raises(InternalsError, match="current_call_ctx"):
                steps.inside_a_layer_call()
    finally:
        steps._call_context_checked.clear()


def test_split_calls_inside_a_block_fail_closed_if_keras_stops_running_the_instance_call(
        monkeypatch):
    """A tensor-parallel pipeline runs a split Dense inside a Transformer block by setting
    its `call` on the instance; a Keras whose __call__ ran the class's `call` would train
    the whole variables instead. The check it makes first says so."""
    import keras

    from tfpar.keras import split_variables

    split_variables._check_instance_calls.cache_clear()
    split_variables._check_instance_calls()  # This Keras runs the instance's call.
    split_variables._check_instance_calls.cache_clear()
    monkeypatch.setattr(keras.layers.Identity, "__call__",
                        lambda self, x, **kwargs: type(self).call(self, x))
    try:
        with pytest.raises(InternalsError, match=r"Layer.__call__ running the `call` of the "
                                                 r"layer instance.*tested with Keras"):
            split_variables._check_instance_calls()
    finally:
        split_variables._check_instance_calls.cache_clear()
