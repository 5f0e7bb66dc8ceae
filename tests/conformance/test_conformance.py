"""Keras conformance: every (feature x strategy) cell of expected.EXPECTED.

"equal" cells compare the strategy's run with one device's on the same global batches and seed
(weights after fit, epoch logs, evaluate, predict, and any saved/exported model's outputs);
"documented" cells compare it with a one-device emulation of the semantics they document;
"within" cells compare it with one device's at a tolerance of their own;
"error" cells expect fit to raise before the first step. Cells in expected.KNOWN_GAPS are
strict xfails: they fail today for the reason recorded there.
"""

import numpy as np
import pytest

import expected
import harness
import semantics


def _cells():
    for (feature, sid), target in expected.EXPECTED.items():
        if sid == expected.MULTI_WORKER:
            continue
        marks = []
        if (feature, sid) in expected.KNOWN_GAPS:
            marks.append(pytest.mark.xfail(strict=True, reason=expected.KNOWN_GAPS[feature, sid]))
        yield pytest.param(feature, sid, target, marks=marks, id=f"{feature}-{sid}")


def _describe(bad):
    return "; ".join(f"{k}: {v:.3g}" if isinstance(v, float) else f"{k}: {v}"
                     for k, v in sorted(bad.items()))


@pytest.mark.parametrize("feature, sid, target", list(_cells()))
def test_cell(feature, sid, target):
    spec = harness.FEATURES[feature]
    kind, _, detail = target.partition(":")
    if kind == "error":
        exception, _, fragment = detail.partition(":")
        with pytest.raises(Exception) as raised:
            harness.run(sid, spec)
        names = [c.__name__ for c in type(raised.value).__mro__]
        assert exception in names, f"{names[0]}: {raised.value}"
        assert fragment in str(raised.value)
        # (Set by harness.run when fit raised; an error from compile came before any step.)
        assert getattr(raised.value, "iterations_run", 0) == 0, "raised after a training step"
        assert getattr(raised.value, "weights_unchanged", True), "the weights changed first"
        return
    got = harness.run(sid, spec)
    atol = rtol = float(detail.partition(":")[0]) if kind == "within" else None
    if kind in ("equal", "within"):
        want, parts = harness.reference(feature), harness.PARTS
    else:
        assert kind == "documented", target
        want, parts = semantics.emulated(feature, sid)
    if not harness.infers(sid, spec):
        parts = tuple(p for p in parts if p not in ("evaluate", "predict"))
    if not spec.predicts:
        parts = tuple(p for p in parts if p != "predict")
    bad = harness.failures(got, want, atol or spec.atol, rtol or spec.rtol, parts)
    what = "the emulation" if kind == "documented" else "one device"
    assert not bad, f"{sid} differs from {what}: " \
                    f"{_describe(bad)}"
    # A model saved or exported under the strategy gives what the strategy predicted.
    for name, values in got.extras.items():
        np.testing.assert_allclose(values, got.predict, atol=spec.atol, rtol=spec.rtol,
                                   err_msg=name)


def test_every_cell_has_a_target_and_every_gap_a_cell():
    for (feature, sid), target in expected.EXPECTED.items():
        kind = target.split(":")[0]
        assert kind in ("equal", "documented", "within", "error"), (feature, sid, target)
        if kind == "within":
            assert 0 < float(target.split(":")[1]) < 0.1 and target.split(":", 2)[2], target
    for feature in harness.FEATURE_NAMES:
        for sid in harness.STRATEGY_IDS:
            if feature in expected.OPTIMIZER_FEATURES + expected.RECIPE_FEATURES:
                continue  # Recipe and optimizer rows run on their own columns.
            target = expected.EXPECTED[feature, sid]
            kind = target.split(":")[0]
            if kind == "documented":
                assert feature in semantics.EMULATIONS, (feature, sid)
            if kind == "error":
                assert len(target.split(":", 2)) == 3 and target.split(":", 2)[2], target
    assert set(expected.KNOWN_GAPS) <= set(expected.EXPECTED)
    assert all(r.startswith(expected.ISSUE) for r in expected.KNOWN_GAPS.values())


def test_a_cell_that_leaves_inference_to_another_column_finds_it_there():
    """A column of harness.INFERENCE_OF compares evaluate and predict on the column it names:
    every feature it trains but does not infer with runs there too, not refused."""
    missing = []
    for (feature, sid), target in expected.EXPECTED.items():
        spec = harness.FEATURES[feature]
        if (sid in harness.INFERENCE_OF and not target.startswith("error")
                and spec.inference and not harness.infers(sid, spec)):
            there = expected.EXPECTED.get((feature, harness.INFERENCE_OF[sid]), "absent")
            if there.startswith(("error", "absent")):
                missing.append((feature, sid, harness.INFERENCE_OF[sid], there))
    assert not missing, missing


def test_a_row_that_leaves_predict_to_the_base_row_finds_it_on_its_column():
    """A row of harness.BASE_OUTPUTS compares no predict: on each of its columns the base
    row (the same model, inputs and outputs) runs predict, compared with one device."""
    base = harness.FEATURES[harness.BASE_ROW]
    assert base.predicts and base.inference
    missing = []
    for (feature, sid), target in expected.EXPECTED.items():
        if feature in harness.BASE_OUTPUTS and not target.startswith("error") \
                and sid != expected.MULTI_WORKER:
            column = sid if harness.infers(sid, base) else harness.INFERENCE_OF[sid]
            there = expected.EXPECTED.get((harness.BASE_ROW, column), "absent")
            if there.startswith(("error", "absent")):
                missing.append((feature, sid, there))
    assert not missing, missing
