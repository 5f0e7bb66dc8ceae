"""Pipeline parallelism: the strategy, its stages and the runtime that executes a schedule.

- `pipeline_strategy.py`: `PipelineStrategy` (placement, replicas, the Keras train step);
- `execution.py`: one replica's train step and forward, built from a schedule;
- `workers.py`: stages on the worker processes of a cluster (connecting, a lost worker).
- `mirrored_placement.py`: each replica's copy of a stage's variable moved, in place, to
  the device that runs the stage for that replica.

A Keras model cut into stages (which layer calls each stage runs) is Keras glue:
`tfpar.keras.pipeline_stages`.

Schedules themselves are pure data in `tfpar.plan.schedule`.
"""
