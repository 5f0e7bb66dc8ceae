"""Runtime pieces several parallelisms share: cross-device ops, collectives, group
keys, values of owners, rendezvous checks, the cluster a strategy runs on, placed calls,
layer placement and timing (model parallelism and pipelines), memory held per device."""
