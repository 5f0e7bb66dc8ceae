"""One pipeline step under TensorFlow's profiler, in this process and on other tasks
(TensorFlow glue for `PipelineStrategy.trace`; `tfpar.viz.pipeline_trace` reads the ops)."""

import os
import shutil
import tempfile
import threading
import time

import tensorflow as tf

from tfpar.viz import pipeline_trace


def record_ops(step, profilers=(), step_seconds=1.0):
    """Runs `step()` once under TensorFlow's profiler, in this process and in each task whose
    profiler server is in `profilers` ("host:port", `tfpar.cluster.server --profiler_port`); returns
    the ops they all recorded, as `profiled_ops` does. Tasks on other hosts are as far apart
    as the hosts' clocks."""
    logdir = tempfile.mkdtemp(prefix="tfpar_trace_")
    # A task's profiler records for a fixed time from when the request reaches it: the step
    # starts after a margin, and the time covers the step three times over.
    margin = 1.0 if profilers else 0.0
    duration_ms = int((margin + 3 * step_seconds + 1.0) * 1000)
    failed = []

    def record(address, directory):
        try:
            tf.profiler.experimental.client.trace(f"grpc://{address}", directory, duration_ms)
        except Exception as error:  # Reported below, with the task's address.
            failed.append(f"{address}: {type(error).__name__}: {error}")

    directories = [os.path.join(logdir, f"task{i}") for i in range(len(profilers))]
    threads = [threading.Thread(target=record, args=pair, daemon=True)
               for pair in zip(profilers, directories)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(margin)
        tf.profiler.experimental.start(os.path.join(logdir, "here"))
        try:
            step()
        finally:
            tf.profiler.experimental.stop()
        for thread in threads:
            thread.join(duration_ms / 1000 + 60)
        if failed or any(t.is_alive() for t in threads):
            raise RuntimeError(f"Could not record the step on another task's profiler: "
                               f"{'; '.join(failed) or 'no answer in time'}.")
        absolute = bool(directories)
        ops = pipeline_trace.profiled_ops(os.path.join(logdir, "here"), absolute)
        for directory in directories:
            ops += pipeline_trace.profiled_ops(directory, absolute)
        return ops
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
