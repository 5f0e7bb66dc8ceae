"""How a Keras model's compiled loss adds up over parts of a batch (the pipeline's micro-batches)."""

import tensorflow as tf

from tfpar.keras import internals

_COUNT_MEANS = ("sum_over_batch_size", "mean")
COUNT, WEIGHT, SUM = "count", "weight", "sum"  # How a batch's loss is made of its parts.


def has_custom_compute_loss(model):
    trainer = internals.symbol("keras.src.trainers.trainer.Trainer")
    return type(model).compute_loss is not trainer.compute_loss


def loss_kind(model, weighted):
    """How the compiled loss of a batch is made of its micro-batches' losses.

    COUNT: means over examples, weighted by each micro-batch's share of the examples;
    WEIGHT: `mean_with_sample_weight` with sample weights, weighted by each one's share
    of the sample weights; SUM: sums, added as they are.
    """
    compile_loss = internals.attr(model, "_compile_loss")
    entries = internals.attr(compile_loss, "_flat_losses") if compile_loss is not None else ()
    internals.check(
        all(isinstance(e, tuple) and len(e) > 1 and hasattr(e[1], "reduction") for e in entries),
        "compiled losses as (loss, Loss with a reduction, ...) entries in _flat_losses")
    reductions = {entry[1].reduction for entry in entries}
    if weighted:
        reductions = {WEIGHT if r == "mean_with_sample_weight" else r for r in reductions}
    else:
        reductions = {"mean" if r == "mean_with_sample_weight" else r for r in reductions}
    if not reductions or reductions <= set(_COUNT_MEANS):
        return COUNT
    if reductions == {WEIGHT}:
        return WEIGHT
    if reductions == {"sum"}:
        return SUM
    raise ValueError(
        f"PipelineStrategy adds the losses of micro-batches to get the loss of the batch, "
        f"which works for losses with reduction 'sum_over_batch_size' (Keras' default), "
        f"'mean', 'mean_with_sample_weight' or 'sum', all alike. The compiled losses use "
        f"reductions {sorted(map(str, reductions))}. Compile with losses of one of these "
        f"reductions.")


def outputs_masked(y_pred):
    """Whether Keras carries a mask on any of the model's outputs."""
    get_keras_mask = internals.symbol("keras.src.backend.common.masking.get_keras_mask")
    return any(get_keras_mask(t) is not None for t in tf.nest.flatten(y_pred)
               if isinstance(t, tf.Tensor))
