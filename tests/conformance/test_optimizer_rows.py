"""The conformance rows for optimizers come from the installed Keras: every argument of its
optimizer base class and every optimizer class in `keras.optimizers` has a row (a feature
that trains with it), and every column runs those rows (or names the column whose update
code it runs)."""

import inspect

import keras

import expected
import harness


def _base_arguments():
    """The named arguments of the first class in keras.optimizers.Optimizer's MRO whose
    __init__ names them (TensorFlow's TFOptimizer takes *args, **kwargs)."""
    for cls in keras.optimizers.Optimizer.__mro__:
        if "__init__" not in vars(cls):
            continue
        parameters = inspect.signature(cls.__init__).parameters.values()
        named = [p.name for p in parameters if p.name != "self"
                 and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if named:
            return named
    raise AssertionError("no optimizer class of Keras names its arguments")


def _classes():
    return sorted(name for name, value in vars(keras.optimizers).items()
                  if isinstance(value, type) and issubclass(value, keras.optimizers.Optimizer)
                  and value is not keras.optimizers.Optimizer)


def test_keras_names_what_the_rows_cover():
    arguments = _base_arguments()
    assert {"learning_rate", "clipnorm", "global_clipnorm", "weight_decay"} <= set(arguments)
    assert {"SGD", "Adam", "AdamW", "LossScaleOptimizer"} <= set(_classes())


def test_every_optimizer_argument_of_keras_has_a_row():
    missing = [a for a in _base_arguments() if a not in harness.OPTIMIZER_ARGUMENT_ROWS]
    assert not missing, (f"Keras {keras.__version__}'s optimizers take {missing}, which no "
                         f"conformance row trains with: add rows (harness."
                         f"OPTIMIZER_ARGUMENT_ROWS) and their cells (expected.py)")


def test_every_optimizer_class_of_keras_has_a_row():
    missing = [c for c in _classes() if c not in harness.OPTIMIZER_CLASS_ROWS]
    assert not missing, (f"keras.optimizers {keras.__version__} has {missing}, which no "
                         f"conformance row trains: add rows (harness.OPTIMIZER_CLASS_ROWS) "
                         f"and their cells (expected.py)")


def test_every_row_is_a_feature_with_cells():
    for what, rows in (("argument", harness.OPTIMIZER_ARGUMENT_ROWS),
                       ("class", harness.OPTIMIZER_CLASS_ROWS)):
        for name, feature in rows.items():
            if what == "class" and name not in _classes():
                continue  # A class this Keras release does not have.
            assert feature in harness.FEATURES, (what, name, feature)
            columns = [c for (f, c) in expected.EXPECTED if f == feature]
            assert "zero3" in columns or "zero2" in columns, (what, name, columns)


def test_every_column_runs_every_optimizer_row_or_names_the_column_whose_step_it_runs():
    """A column applies the optimizer's update with code of its own, and then has a cell for
    every optimizer row, or names (expected.OPTIMIZER_STEP_OF) a column whose update code it
    runs, which has them."""
    for column in expected.COLUMNS:
        runs = expected.OPTIMIZER_STEP_OF.get(column, column)
        assert runs not in expected.OPTIMIZER_STEP_OF, (column, runs)
        missing = [f for f in expected.OPTIMIZER_FEATURES if (f, runs) not in expected.EXPECTED]
        assert not missing, (column, runs, missing)
    assert set(expected.OPTIMIZER_STEP_OF) < set(expected.COLUMNS)
