"""The chief of the pipeline-across-workers tests, run by `tfpar launch --workers 2
--coordinator` (the workers serve; this process runs the program).

    python pipeline_chief.py --out=DIR [--epochs=3] [--pause_after=0]

1. Before connecting to the cluster: the reference, the same model trained on this
   process's CPU, its weights after each epoch.
2. `tfpar.PipelineStrategy(cluster_resolver=TFConfigClusterResolver())`: one stage per
   worker task, M=4, Adam; `fit` with `BackupAndRestore(DIR/backup)`, 3 steps an epoch.
3. With --pause_after=E, in a run that starts from scratch: after epoch E's backup the
   chief prints "PAUSED" and waits (at most 120 s) for the file DIR/killed, which the test
   creates once it has killed (or stopped) a worker; then training goes on, and fails (or,
   with a stopped worker, this process exits after --stage_timeout seconds).

Each run writes DIR/run<k>.json (k = 0, 1, ... in the order of the runs): what it placed
where, each epoch's distance to the reference, and the error that ended it, if any.
"""

import glob
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
from absl import app, flags  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import multi_worker_common as common  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Directory for the backup and the results.")
flags.DEFINE_integer("epochs", 3, "Epochs of 3 steps.")
flags.DEFINE_integer("pause_after", None, "Wait for DIR/killed after this epoch's backup.")
flags.DEFINE_float("stage_timeout", 120.0, "PipelineStrategy(stage_timeout_seconds=...).")

EXAMPLES = 48
BATCH = 16  # 3 steps an epoch, micro-batches of 4.


def _compile(model):
    model.compile(keras.optimizers.Adam(0.01, epsilon=1e-3), common.loss())
    return model


def _reference(x, y):
    """The initial weights, and the weights after each epoch, of the model trained on one
    device (this process)."""
    model = _compile(common.model())
    initial, after = model.get_weights(), []
    keep = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: after.append(model.get_weights()))
    model.fit(x, y, batch_size=BATCH, epochs=FLAGS.epochs, shuffle=False, verbose=0,
              callbacks=[keep])
    return initial, after


def _copies(variable):
    """The devices of a variable's copies (a mirrored variable has one per replica)."""
    value = getattr(variable, "value", variable)
    return [v.device for v in getattr(value, "values", [value])]


def _max_difference(weights, reference):
    return max(float(abs(a - b).max()) for a, b in zip(weights, reference))


class Record(keras.callbacks.Callback):
    """Records the epochs run, the weights against the reference, and pauses if asked."""

    def __init__(self, result, initial, reference, write, pause_after):
        super().__init__()
        self.result, self.initial, self.reference = result, initial, reference
        self.write, self.pause_after = write, pause_after

    def on_epoch_begin(self, epoch, logs=None):
        if not self.result["epochs_run"]:  # After BackupAndRestore restored (or not).
            start = self.initial if epoch == 0 else self.reference[epoch - 1]
            self.result["start_iterations"] = int(self.model.optimizer.iterations.numpy())
            self.result["start_difference"] = _max_difference(self.model.get_weights(), start)
        self.result["epochs_run"].append(epoch)

    def on_epoch_end(self, epoch, logs=None):
        self.result["epoch_differences"][str(epoch)] = _max_difference(
            self.model.get_weights(), self.reference[epoch])
        if epoch == self.pause_after and self.result["epochs_run"][0] == 0:
            self.write()
            print("PAUSED", flush=True)
            signal_file = os.path.join(FLAGS.out, "killed")
            deadline = time.monotonic() + 120
            while not os.path.exists(signal_file):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{signal_file} did not appear within 120 s")
                time.sleep(0.05)
            self.result["resumed_at"] = time.monotonic()


def main(argv):
    import tensorflow as tf

    import tfpar

    keras.config.disable_traceback_filtering()
    run = len(glob.glob(os.path.join(FLAGS.out, "run*.json")))
    result = {"epochs_run": [], "epoch_differences": {}}

    def write():
        with open(os.path.join(FLAGS.out, f"run{run}.json"), "w") as f:
            json.dump(result, f)

    x, y = common.data(EXAMPLES)
    initial, reference = _reference(x, y)
    keras.backend.clear_session()  # Nothing of this process's TensorFlow is used after.

    strategy = tfpar.PipelineStrategy(
        num_micro_batches=4, stage_timeout_seconds=FLAGS.stage_timeout,
        cluster_resolver=tf.distribute.cluster_resolver.TFConfigClusterResolver())
    # What the silent-worker watch sees of a live worker's gRPC server.
    from tfpar.cluster.probe import answers

    result["probes"] = [answers(address) for address in
                        json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]]
    result["stage_devices"] = list(strategy.stage_devices[0])
    with strategy.scope():
        model = _compile(common.model())
    result["stages"] = strategy.stages(model)
    result["layer_devices"] = {layer.name: sorted({d for v in layer.variables for d in _copies(v)})
                               for layer in model.layers}
    try:
        tfpar.PipelineStrategy(strategy.stage_devices[0], num_replicas=2)
    except tfpar.errors.DeviceError as error:
        result["replicas_error"] = str(error)
    callbacks = [keras.callbacks.BackupAndRestore(os.path.join(FLAGS.out, "backup")),
                 Record(result, initial, reference, write, FLAGS.pause_after)]
    try:
        model.fit(x, y, batch_size=BATCH, epochs=FLAGS.epochs, shuffle=False, verbose=2,
                  callbacks=callbacks)
    except Exception as error:
        if "resumed_at" in result:
            result["error_seconds"] = time.monotonic() - result["resumed_at"]
        result["error_type"] = type(error).__name__
        result["error"] = str(error)
        write()
        raise
    result["optimizer_devices"] = sorted({d for v in model.optimizer.variables
                                          for d in _copies(v)})
    write()
    print("DONE", flush=True)


if __name__ == "__main__":
    app.run(main)
