"""Drawings: pipeline timelines of what ran, as Chrome traces and PNGs, and pictures of plans
(schedules, memory per device, the advisor's layouts); no TensorFlow but in
pipeline_profiler, which runs its profiler."""
