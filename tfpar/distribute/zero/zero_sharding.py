"""ZeRO-sharded data parallelism: the TensorFlow side of `DataParallelStrategy(shard=...)`.

Every trainable variable has one owner replica (`tfpar.plan.sharding`), chosen when the
optimizer first asks for it; whole variables are owned, as in PyTorch's
ZeroRedundancyOptimizer, so an optimizer that looks at a whole variable (LAMB's trust
ratio, per-variable clipping) sees it whole.

- Stage 1 ("optimizer"): the optimizer state of a variable lives on its owner only
  (`slot_device`). Gradients are all-reduced as usual; each replica updates the
  variables it owns, with the user's own optimizer, and the updated values are
  all-gathered into every replica's copy.
- Stage 2 ("gradients"): as stage 1, but gradients are reduce-scattered: each replica
  receives the summed gradients of its own variables only.
- Stage 3 ("parameters"): as stage 2, and each trainable variable lives on its owner
  only (a plain variable on one device, made there: `ShardOwners.create_owned`). Every
  replica reads it where a layer uses it (TensorFlow copies it to the replica's device
  at that point, and frees the copy when the step no longer needs it); the owner alone
  updates it, so nothing is gathered after the update. Across workers a replica cannot
  read another worker's variable: each read is a broadcast from the owner, and its
  gradient goes back to the owner alone, which sums (`read_parameter`, as FSDP gathers
  and reduces per layer); a worker that owns no part of a variable holds an empty
  stand-in. With `reshard_after_forward` (the default) recomputable layers are recomputed
  in the backward pass, so each read lives for its layer's forward (or backward) only
  (`tfpar.keras.zero_optimizers.regather_in_backward`). These collectives are keyed by the
  variable's ordinal and its count of reads in the traced step, not by trace order, which
  differs between a variable's owner and the others once layers are recomputed.

Gradients and updated values travel in flat buckets of about `bytes_per_pack` (25 MiB by
default), the last layers' first: each bucket's reduce-scatter waits only for its own
gradients, so it overlaps the backward pass of earlier layers. Within a bucket each
owner's part is padded to the largest, so one reduce-scatter and one all-gather serve it. On
GPUs they are NCCL collectives. On CPUs TensorFlow has no reduce-scatter: on one host the
gradients are all-reduced and each replica keeps its own (measured in
benchmarks/sharded.py); across workers each gradient is sent to its owner alone, one
variable at a time (`ShardCollectives.reduce_to_owners`), the backward pass waiting once
about a bucket is in flight (`_pace_gradients`), and stages 1-2 broadcast each updated
variable from its owner, one after another, instead of gathering buckets.

One job per module, as in PyTorch FSDP2's `_fully_shard/`: `zero_owners` (who owns what,
and state made on its owner), `zero_reads` (stage 3's reads from the owner), `zero_update`
(the sharded optimizer step), `zero_pacing` (the backward pass paced across workers),
`zero_collectives` (the collectives and their keys); this module is what a strategy sets
up (`ZeroHooks`, `set_up`).
"""

from tfpar.distribute.zero.zero_owners import ShardOwners, full_state
from tfpar.distribute.zero.zero_update import Accumulation, StepShapes, sharded_update
from tfpar.keras import hooks as keras_hooks


class ZeroHooks:
    """What a sharding strategy (`DataParallelStrategy(shard=...)`, a pipeline's
    `PipelineStrategy(shard=...)`) answers the Keras seam with. Set up by `set_up`."""

    def _tfpar_full_optimizer_state(self, keras_variables):
        # Asked by the Keras seam when a sharded optimizer is saved across workers, and for
        # the moving averages (use_ema) that replace the weights when training ends.
        return full_state(self, keras_variables)

    def _tfpar_sharded_update(self, optimizer, grads, variables, learning_rate,
                              accumulation=None):
        # Asked by the Keras seam for an optimizer step under shard=...
        return sharded_update(self, optimizer, grads, variables, learning_rate,
                              self._tfpar_shard_stage, self._tfpar_shard_collectives,
                              self._zero_bucket_bytes, accumulation)

    # Asked by the Keras seam for gradient accumulation under shard=...
    _tfpar_accumulation = Accumulation


def set_up(strategy, num_replicas, collectives, group_of=None):
    """A strategy's ZeRO state: its owners (`ShardOwners(num_replicas, group_of)`), and
    under shard=... (`strategy._tfpar_shard_stage`) Keras' optimizers sharded and the
    collectives `collectives()` makes (a `ShardCollectives`)."""
    strategy._tfpar_shard_owners = ShardOwners(num_replicas, group_of)
    strategy._tfpar_step_shapes = StepShapes()
    if strategy._tfpar_shard_stage:
        keras_hooks.install_sharded_optimizers()
        strategy._tfpar_shard_collectives = collectives()
