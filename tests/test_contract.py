"""The contract between tfpar's strategies and its Keras seam: declared, never guessed."""

import pathlib
import re

import pytest
import tensorflow as tf

import tfpar
from tfpar import contract

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tfpar"
STRATEGIES = [tfpar.DataParallelStrategy, tfpar.PipelineStrategy, tfpar.ModelParallelStrategy,
              tfpar.ParameterServerStrategy]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda c: c.__name__)
def test_every_hook_a_strategy_defines_is_declared(strategy):
    """A misspelt hook (say `_tfpar_update_in_turn`) would never be asked for."""
    assert issubclass(strategy, contract.StrategyHooks)
    defined = {name for name in dir(strategy) if name.startswith("_tfpar_")}
    assert defined - set(contract.declared_hooks()) == set()


def test_hooks_are_read_through_the_contract_not_by_name():
    """No `getattr(x, "_tfpar_<hook>", default)` anywhere: a typo there silently gave the
    default. (Attributes of models, layers and variables are not hooks.)"""
    by_name = re.compile(r'getattr\([^"]*"(_tfpar_\w+)"')
    hooks = set(contract.declared_hooks())
    found = [(str(p.relative_to(ROOT)), name) for p in ROOT.rglob("*.py")
             for name in by_name.findall(p.read_text()) if name in hooks]
    assert found == []


def test_a_stock_strategy_answers_with_the_defaults_and_an_unknown_hook_is_an_error():
    hooks = contract.hooks_of(tf.distribute.get_strategy())
    assert (hooks._tfpar_shard_stage, hooks._tfpar_train_step, hooks._tfpar_mirrored) == (
        0, None, False)
    assert contract.hooks_of(None)._tfpar_updates_in_turn is False
    with pytest.raises(AttributeError):
        hooks._tfpar_update_in_turn  # pylint: disable=pointless-statement


def test_every_tfpar_name_is_a_declared_hook_or_mark():
    """`_tfpar_` names mean one thing each: a hook declared in the contract, a mark the
    runtime sets on Keras and TensorFlow objects (`contract.MARKS`), or one the Keras seam
    sets (`tfpar.keras.hooks.SEAM_MARKS`, found only in the seam). Private state of tfpar's
    own objects is named otherwise."""
    from tfpar.keras import hooks

    declared = set(contract.declared_hooks())
    assert not (declared & set(contract.MARKS)) and not (declared & set(hooks.SEAM_MARKS))
    assert not set(contract.MARKS) & set(hooks.SEAM_MARKS)
    unknown, seam_marks_outside = [], []
    for path in ROOT.rglob("*.py"):
        where = str(path.relative_to(ROOT))
        for name in set(re.findall(r"\b_tfpar_\w+", path.read_text())):
            if name in hooks.SEAM_MARKS:
                if not where.startswith("keras/"):
                    seam_marks_outside.append((where, name))
            elif name not in declared and name not in contract.MARKS:
                unknown.append((where, name))
    assert not unknown and not seam_marks_outside, (sorted(unknown), seam_marks_outside)
    # And each declared mark is used somewhere (a stale entry would hide nothing).
    text = "".join(p.read_text() for p in ROOT.rglob("*.py"))
    stale = [name for name in [*contract.MARKS, *hooks.SEAM_MARKS]
             if text.count(name) < 2]  # (Its declaration is one.)
    assert not stale, stale
