"""Serve the worker or ps task that TF_CONFIG names, until killed.

Parameter-server training, and a pipeline whose stages live on the workers, run the
user's program on the chief only; every worker and ps task just runs a TensorFlow
server. `tfpar launch --workers N --ps K` (or `--workers N --coordinator`) starts this
module for those tasks:

    TF_CONFIG='{"cluster": {...}, "task": {"type": "ps", "index": 0}}' python -m tfpar.cluster.server
"""

import os
import signal
import sys

from absl import app, flags

from tfpar.cluster.tf_config import parse_tf_config

FLAGS = flags.FLAGS
flags.DEFINE_integer("intra_op_threads", 0,
                     "Threads one op may use (0: TensorFlow's default, all cores).")

flags.DEFINE_integer("profiler_port", 0,
                     "Also serve TensorFlow's profiler on this port (0: no), so that "
                     "tf.profiler.experimental.client.trace can record this task.")

SERVED_JOBS = ("worker", "ps")


def serve(config, intra_op_threads=0, profiler_port=0):
    """Starts the server of `config`'s task and blocks until the process is killed."""
    if config.task_type not in SERVED_JOBS:
        raise ValueError(
            f"tfpar.cluster.server serves 'worker' and 'ps' tasks; TF_CONFIG names task type "
            f"{config.task_type!r}. Run your training program on the chief instead.")
    from tfpar.cluster.memory_probe import use_allocator_statistics

    use_allocator_statistics()  # (What the chief places here is measured on any CPU.)
    import tensorflow as tf

    # The server's devices take their threads per op from its session config. (How many
    # ops run at once, in the functions a chief runs here, is the chief's setting: its
    # context's config reaches every task it connects to, measured on TF 2.21.)
    threads = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=intra_op_threads)
    server = tf.distribute.Server(
        tf.train.ClusterSpec({job: list(a) for job, a in config.cluster.items()}),
        job_name=config.task_type, task_index=config.task_index,
        protocol=config.rpc_layer or "grpc", config=threads, start=True)
    if profiler_port:
        tf.profiler.experimental.server.start(profiler_port)
    _say_peaks_when_stopped(config.task_name)
    print(f"tfpar.cluster.server: {config.task_name} serving at {server.target}", flush=True)
    while True:  # (Not server.join(): a signal handler runs only between Python bytecodes.)
        signal.pause()


def _say_peaks_when_stopped(name):
    """On SIGTERM (how the launcher stops a server), print what this task held at its
    peak (what the chief placed here: pipeline stages, ps variables), then exit."""
    from tfpar.cluster.memory_probe import process_memory

    def stop(signum, frame):
        print(f"tfpar.cluster.server: {name} stopping; {process_memory().format()}", flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    config = parse_tf_config(os.environ.get("TF_CONFIG"))
    if config.task_type is None:
        sys.exit("tfpar.cluster.server: TF_CONFIG has no 'task'; say which task this process serves, "
                 "e.g. \"task\": {\"type\": \"worker\", \"index\": 0}.")
    serve(config, FLAGS.intra_op_threads, FLAGS.profiler_port)


def entry():
    app.run(main)


if __name__ == "__main__":
    entry()
