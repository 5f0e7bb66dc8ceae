"""The package's layout: imports flow one way, and pure modules stay pure."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tfpar"


def _module_name(path):
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules():
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(path, modules):
    """tfpar modules imported anywhere in the file (also inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name in modules:
                found.add(name)
    return found


def import_graph():
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _cycle(graph):
    """One import cycle as a list of modules, or None. Packages' __init__ re-exports and
    the lazy top-level `tfpar` are left out: they only name things."""
    graph = {m: {d for d in deps if d != "tfpar" and not _is_package(d)}
             for m, deps in graph.items() if m != "tfpar" and not _is_package(m)}
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        state[module] = "done"
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def _is_package(name):
    return (ROOT.parent / name.replace(".", "/") / "__init__.py").exists()


def test_no_import_cycles():
    cycle = _cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def imported_modules(name, path, modules):
    """Every module a tfpar module imports, anywhere in the file (inside functions too;
    docstrings are not code): `from a.b import c` counts as `a.b.c` when that is a tfpar
    module, else as `a.b`; relative imports are resolved."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
    return found - {name}


def _within(module, prefixes):
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _imports_of(prefixes):
    modules = _modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()
            if _within(name, prefixes)}


# Not glue: the schema of the profile files TensorFlow's profiler writes, read by a drawing.
PURE_MAY_READ = {("tfpar.viz.pipeline_trace", "tensorflow.tsl.profiler.protobuf")}


# (tfpar.viz.pipeline_profiler runs TensorFlow's profiler: glue, beside the drawing it feeds.)
@pytest.mark.parametrize("prefix", ["tfpar.plan", "tfpar.viz.pipeline_trace",
                                    "tfpar.viz.plan_pictures", "tfpar.cluster.tf_config"])
def test_pure_modules_import_no_tensorflow_glue(prefix):
    imports = _imports_of([prefix])
    assert imports
    for module, imported in imports.items():
        glue = {m for m in imported if _within(m, ["tensorflow", "keras"])
                and (module, m) not in PURE_MAY_READ}
        assert not glue, (module, glue)
        assert not {m for m in imported if _within(m, ["tfpar.distribute", "tfpar.keras"])}


# Pure planning leans on nothing of tfpar but the contract and the errors.
PLAN_MAY_IMPORT = ["tfpar.plan", "tfpar.contract", "tfpar.errors"]


def test_plan_imports_only_plan_the_contract_and_the_errors():
    stray = sorted(f"{module}: {m}" for module, imported in _imports_of(["tfpar.plan"]).items()
                   for m in imported if _within(m, ["tfpar"]) and not _within(m, PLAN_MAY_IMPORT))
    assert not stray, stray


# Keras is imported by the seam, the Keras layers and the programs; the runtime asks the
# seam (tfpar.keras.models, .steps, .mesh, ...) instead.
KERAS_IMPORTERS = ["tfpar.keras", "tfpar.layers", "tfpar.cli", "tfpar.cluster.server",
                   "tfpar.cluster.data_service", "tfpar.data"]


def keras_importers_outside_the_seam(imports):
    return sorted(f"{module}: {m}" for module, imported in imports.items()
                  if not _within(module, KERAS_IMPORTERS)
                  for m in imported if _within(m, ["keras"]))


def test_keras_is_imported_by_the_seam_layers_and_programs_only():
    stray = keras_importers_outside_the_seam(_imports_of(["tfpar"]))
    assert not stray, stray


def test_a_stray_keras_import_is_caught(tmp_path):
    """A function-local `import keras` in the runtime is caught; one in a docstring is not."""
    module = tmp_path / "model_parallel.py"
    module.write_text('"""\n>>> import keras\n"""\n\ndef f():\n    import keras.layers\n')
    name = "tfpar.distribute.model_parallel.model_parallel_strategy"
    imported = imported_modules(name, module, _modules())
    assert keras_importers_outside_the_seam({name: imported}) == [f"{name}: keras.layers"]
    module.write_text('"""\n>>> import keras\n"""\n')
    imported = imported_modules(name, module, _modules())
    assert not keras_importers_outside_the_seam({name: imported})


# The seam never imports the strategies' runtime: the runtime hands the seam what it needs
# (hooks declared in tfpar.contract, or objects given to an install function, as
# tfpar.use_keras_distribution gives tfpar.keras.keras_distribution its DTensor runtime).
def runtime_reached_from_the_seam(graph):
    """{seam module: "runtime module <- ... <- seam module"}: the first runtime module each
    seam module imports, directly or through other modules (the lazy top-level `tfpar`
    only names things and is not followed)."""
    found = {}
    for start in sorted(m for m in graph if _within(m, ["tfpar.keras"])):
        parent, stack = {start: None}, [start]
        while stack and start not in found:
            module = stack.pop()
            for dep in sorted(graph.get(module, ())):
                if dep == "tfpar" or dep in parent:
                    continue
                parent[dep] = module
                if _within(dep, ["tfpar.distribute"]):
                    path = [dep]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    found[start] = " <- ".join(path)
                    break
                stack.append(dep)
    return found


def test_the_seam_does_not_import_the_runtime():
    """Not directly, nor through another package (tfpar.layers imports the runtime)."""
    reached = runtime_reached_from_the_seam(import_graph())
    assert not reached, f"seam -> runtime imports: {reached}"


def test_a_seam_import_of_the_runtime_through_another_module_is_caught():
    graph = {"tfpar.keras.a": {"tfpar.layers.b"}, "tfpar.layers.b": {"tfpar.distribute.c"},
             "tfpar.distribute.c": set()}
    assert runtime_reached_from_the_seam(graph) == {
        "tfpar.keras.a": "tfpar.distribute.c <- tfpar.layers.b <- tfpar.keras.a"}


def test_keras_is_adapted_in_the_seam_only():
    """Keras' private modules (keras.src) are imported in tfpar/keras/ only."""
    outside = []
    for name, path in _modules().items():
        if name.startswith("tfpar.keras"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("keras.src"):
                outside.append(f"{name}: from {node.module}")
    assert not outside, outside


# --- Privates are named in the seam only ---------------------------------------------------
# Outside tfpar/keras/, a TensorFlow or Keras private is reached through a function of the
# seam (tfpar.keras.tf_runtime, .tf_variables, .tf_coordinator, .models, .steps, ...). The
# runtime uses `internals` only to declare the private methods its subclasses of TensorFlow
# classes override (`@internals.overrides`: the override must live on the class).

_ATTRIBUTE_CALLS = {"getattr", "setattr", "hasattr", "delattr", "object.__setattr__",
                    "object.__getattribute__", "object.__delattr__"}
_PRIVATE_MODULES = ("keras.src", "tensorflow.python")


def _docstrings(tree):
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}


def internals_uses(source):
    """Uses of `tfpar.keras.internals` other than `@internals.overrides`, as 'line: code'."""
    tree = ast.parse(source)
    names, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "tfpar.keras.internals":
            found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                      if a.name != "overrides"]
        elif isinstance(node, ast.ImportFrom) and node.module == "tfpar.keras":
            names |= {a.asname or a.name for a in node.names if a.name == "internals"}
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if a.name == "tfpar.keras.internals"]
    decorators = {id(d) for node in ast.walk(tree)
                  if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  for d in node.decorator_list}
    allowed = {id(node.value) for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and node.attr == "overrides"
               and id(node) in decorators}
    found += [f"{node.lineno}: {node.id}" for node in ast.walk(tree)
              if isinstance(node, ast.Name) and node.id in names and id(node) not in allowed]
    return found


def private_names(source, marks):
    """String literals that name a TensorFlow or Keras private, as 'line: code': a private
    attribute got, set, tested or deleted by name (tfpar's own marks, `marks`, and dunders
    aside), or a private module path (`keras.src...`, `tensorflow.python...`, docstrings
    aside)."""
    tree = ast.parse(source)
    docstrings, found = _docstrings(tree), []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and ast.unparse(node.func) in _ATTRIBUTE_CALLS
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
            name = node.args[1].value
            if (isinstance(name, str) and name.startswith("_") and not name.startswith("__")
                    and name not in marks):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docstrings
              and any(m in node.value for m in _PRIVATE_MODULES)):
            found.append(f"{node.lineno}: {node.value!r}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""])
            found += [f"{node.lineno}: import {m}" for m in modules
                      if m.startswith(_PRIVATE_MODULES)]
    return found


def _outside_the_seam():
    return {name: path for name, path in _modules().items() if not _within(name, ["tfpar.keras"])}


def test_internals_is_used_outside_the_seam_only_to_declare_overrides():
    stray = {name: found for name, path in _outside_the_seam().items()
             if (found := internals_uses(path.read_text()))}
    assert not stray, stray


def test_no_private_is_named_outside_the_seam():
    from tfpar import contract

    stray = {name: found for name, path in _outside_the_seam().items()
             if (found := private_names(path.read_text(), contract.MARKS))}
    assert not stray, stray


def test_a_private_named_in_the_runtime_is_caught():
    from tfpar import contract

    assert internals_uses(
        "from tfpar.keras import internals\n\n@internals.overrides\nclass A:\n    pass\n") == []
    assert internals_uses(
        "from tfpar.keras import internals\n\n"
        "def f(s):\n    return internals.attr(s.extended, '_collective_keys')\n") == [
        "4: internals"]
    assert internals_uses("from tfpar.keras.internals import symbol\n") == [
        "1: from tfpar.keras.internals import symbol"]
    assert private_names('"""Reads keras.src.losses (a docstring)."""\n'
                         'getattr(model, "_tfpar_placed_by", None)\n'
                         'getattr(type(model), "__name__")\n', contract.MARKS) == []
    assert private_names('hasattr(v, "_value")\n', contract.MARKS) == [
        "1: hasattr(v, '_value')"]
    assert private_names('getattr(m, "_tfpar_placd_by", None)\n', contract.MARKS) == [
        "1: getattr(m, '_tfpar_placd_by', None)"]
    assert private_names('f("tensorflow.python.eager.context.context")\n', {}) == [
        "1: 'tensorflow.python.eager.context.context'"]
    assert private_names("from keras.src import backend\n", {}) == [
        "1: import keras.src"]

# A `call` set on one layer or model, or a class of its own given to one variable, goes
# through the seam's ledger (`tfpar.keras.hooks.patch_object`), so `remove_patches` can undo it.
_OBJECT_PATCH = re.compile(r'__setattr__\([^,]+,\s*"(call|__class__)"|\.__class__\s*=[^=]')


def object_patches_outside_the_ledger(sources):
    return sorted(f"{name}:{number}" for name, text in sources.items()
                  if name != "tfpar.keras.hooks"
                  for number, line in enumerate(text.splitlines(), 1)
                  if _OBJECT_PATCH.search(line))


def test_per_object_patches_go_through_the_ledger():
    stray = object_patches_outside_the_ledger(
        {name: path.read_text() for name, path in _modules().items()})
    assert not stray, stray


def test_a_per_object_patch_outside_the_ledger_is_caught():
    assert object_patches_outside_the_ledger({
        "tfpar.a": 'object.__setattr__(layer, "call", f)\n',
        "tfpar.b": "variable.__class__ = Mine\n",
        "tfpar.c": "if variable.__class__ == Mine: pass\n"}) == ["tfpar.a:1", "tfpar.b:1"]


def test_module_file_names_are_unique():
    """One file name, one module: `memory.py` in three packages read as one in a traceback,
    a grep or an import line. (The old names of moved programs run the new ones.)"""
    from tfpar.cli import moved

    shims = {f"{old.replace('.', '/')}.py" for old in moved.MOVED}
    by_name = {}
    for path in ROOT.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py") \
                and str(path.relative_to(ROOT.parent)) not in shims:
            by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT.parent)))
    repeated = {name: sorted(paths) for name, paths in by_name.items() if len(paths) > 1}
    assert not repeated, repeated


# The runtime has one subpackage per parallelism; what several share is in common/. A
# family imports common/ and itself only, common/ no family. ZeRO is an option of
# DataParallelStrategy and of PipelineStrategy (shard=...): both may import it; so is
# context parallelism of DataParallelStrategy (context_parallel=...); a
# keras.distribution.DataParallel runs as a DataParallelStrategy (tfpar.use_keras_distribution).
FAMILY_MAY_IMPORT = {("data_parallel", "zero"), ("pipeline", "zero"), ("mesh", "data_parallel"),
                     ("data_parallel", "context")}


def _family(module):
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["tfpar", "distribute"] else None


def test_each_parallelism_imports_only_the_shared_runtime_and_itself():
    stray = sorted(f"{module}: {m}"
                   for module, imported in _imports_of(["tfpar.distribute"]).items()
                   for m in imported if _family(m) not in (None, "common", _family(module))
                   and (_family(module), _family(m)) not in FAMILY_MAY_IMPORT)
    assert not stray, stray
