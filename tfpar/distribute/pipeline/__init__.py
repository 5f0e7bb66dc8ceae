"""Pipeline parallelism: the strategy, its stages and the runtime that executes a schedule.

- `strategy.py`: `PipelineStrategy` (placement, replicas, the Keras train step);
- `stages.py`: a Keras model cut into stages (which layer calls each stage runs);
- `execution.py`: one replica's train step and forward, built from a schedule.

Schedules themselves are pure data in `tfpar.plan.schedule`.
"""
