"""The package's layout: imports flow one way, and pure modules stay pure."""

import ast
import pathlib

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


@pytest.mark.parametrize("prefix", ["tfpar.plan", "tfpar.viz", "tfpar.cluster.tf_config"])
def test_pure_modules_import_no_tensorflow_glue(prefix):
    graph = import_graph()
    pure = [m for m in graph if m == prefix or m.startswith(prefix + ".")]
    assert pure
    for module in pure:
        text = _modules()[module].read_text()
        assert "import tensorflow" not in text and "import keras" not in text, module
        assert not {d for d in graph[module] if d.startswith(("tfpar.distribute", "tfpar.keras"))}


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
