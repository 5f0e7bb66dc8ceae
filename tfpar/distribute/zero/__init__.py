"""ZeRO (`shard=...` of `DataParallelStrategy` and `PipelineStrategy`): owners, the
sharded update, reduce-scatter / all-gather, full checkpoints from sharded state."""
