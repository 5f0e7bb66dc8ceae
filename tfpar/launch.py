"""`tfpar launch`: run a local TF_CONFIG cluster on 127.0.0.1, like torchrun for TensorFlow.

    tfpar launch --workers 2 -- python -m tfpar.train --strategy=data
    tfpar launch --workers 2 --ps 1 -- python examples/parameter_server.py

Every task gets its TF_CONFIG and free ports; output lines are prefixed with the
task name; if a task fails, all are stopped and its exit code is returned;
Ctrl-C stops everything.

    tfpar launch --workers 2 --ps 1 --max_restarts 3 -- python examples/parameter_server.py
    tfpar launch --workers 2 --ps 1 --data_service -- python my_training.py

--max_restarts N (parameter-server clusters only): a worker server that exits is started
again with the same TF_CONFIG, at most N times per worker task; the chief and ps tasks
never are. --data_service: also run a tf.data service (a dispatcher and one worker per
training worker); every task finds the dispatcher's address in $TFPAR_DATA_SERVICE.
"""

import sys

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("workers", 2, "Worker tasks.")
flags.DEFINE_integer("ps", 0, "Parameter-server tasks (adds a chief that runs the command).")
flags.DEFINE_string("host", "127.0.0.1", "Address the tasks bind to.")
flags.DEFINE_float("grace_seconds", 5.0, "Seconds between SIGTERM and SIGKILL when stopping.")
flags.DEFINE_float("report_seconds", 60.0,
                   "After a ps task dies, seconds the chief gets to fail with its own error "
                   "before all tasks are stopped.")
flags.DEFINE_integer("max_restarts", 0,
                     "With --ps: times each worker server is started again (same TF_CONFIG) "
                     "after it exits. The chief and ps tasks are never restarted.")
flags.DEFINE_bool("data_service", False,
                  "Also run a tf.data service: a dispatcher and one tf.data service worker per "
                  "training worker; tasks get the dispatcher's address in $TFPAR_DATA_SERVICE.")


def main(argv):
    from tfpar.cluster.launcher import Launcher

    command = argv[1:]
    if command and command[0] == "--":
        command = command[1:]
    try:
        launcher = Launcher(command, FLAGS.workers, FLAGS.ps, FLAGS.host, FLAGS.grace_seconds,
                            report_seconds=FLAGS.report_seconds,
                            max_restarts=FLAGS.max_restarts, data_service=FLAGS.data_service)
    except ValueError as error:
        print(f"tfpar launch: {error}", file=sys.stderr)
        return 2
    return launcher.run()


def entry():
    app.run(main)


if __name__ == "__main__":
    entry()
