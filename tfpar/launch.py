"""`tfpar launch`: run a local TF_CONFIG cluster on 127.0.0.1, like torchrun for TensorFlow.

    tfpar launch --workers 2 -- python -m tfpar.train --strategy=data
    tfpar launch --workers 2 --ps 1 -- python examples/parameter_server.py

Every task gets its TF_CONFIG and free ports; output lines are prefixed with the
task name; if a task fails, all are stopped and its exit code is returned;
Ctrl-C stops everything.
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


def main(argv):
    from tfpar.cluster.launcher import Launcher

    command = argv[1:]
    if command and command[0] == "--":
        command = command[1:]
    try:
        launcher = Launcher(command, FLAGS.workers, FLAGS.ps, FLAGS.host, FLAGS.grace_seconds,
                            report_seconds=FLAGS.report_seconds)
    except ValueError as error:
        print(f"tfpar launch: {error}", file=sys.stderr)
        return 2
    return launcher.run()


def entry():
    app.run(main)


if __name__ == "__main__":
    entry()
