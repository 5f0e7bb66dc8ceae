"""Pipeline parallelism: the strategy, its stages and the runtime that executes a schedule.

- `pipeline_strategy.py`: `PipelineStrategy` (placement, replicas, the Keras train step);
- `pipeline_config.py`: its arguments checked, and the device grid and schedule they
  resolve to (`PipelineConfig`);
- `pipeline_extended.py`: its extended part, a mirrored strategy that all-reduces each
  stage's gradients with that stage's cross-device ops (`stage_reductions`);
- `pipeline_reports.py`: what it reports (`memory_report`, `trace`);
- `execution.py`: one replica's train step and forward, built from a schedule;
- `workers.py`: stages on the worker processes of a cluster (connecting, a lost worker).
- `mirrored_placement.py`: each replica's copy of a stage's variable moved, in place, to
  the device that runs the stage for that replica.

A Keras model cut into stages (which layer calls each stage runs) is Keras glue:
`tfpar.keras.pipeline_stages`.

Schedules themselves are pure data in `tfpar.plan.schedule`.
"""
