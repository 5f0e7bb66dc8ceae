"""A Keras callback that records this process's measured memory peaks while it trains."""

import keras

from tfpar.cluster import memory_probe
from tfpar.contract import hooks_of


class MemoryPeaks(keras.callbacks.Callback):
    """Records, for each epoch, this process's peak bytes (TensorFlow's allocator and the
    resident set, `tfpar.process_memory`) and, when the model's strategy can say, its plan
    (`tfpar.plan.estimate_memory`) beside them.

    `epochs` holds one `tfpar.ProcessMemory` per epoch (peaks since the epoch began);
    `planned` the strategy's planned peak per device in bytes, or None. With `verbose`
    each epoch prints one line.

        peaks = tfpar.MemoryPeaks(verbose=True)
        model.fit(dataset, epochs=2, callbacks=[peaks])
        peaks.epochs[-1].rss_peak_bytes
    """

    def __init__(self, verbose=False, device="CPU:0"):
        super().__init__()
        self.verbose = verbose
        self.device = device
        self.epochs = []
        self.planned = None

    def on_train_begin(self, logs=None):
        self.planned = _planned_peak(self.model)

    def on_epoch_begin(self, epoch, logs=None):
        memory_probe.reset_memory_peaks(self.device)

    def on_epoch_end(self, epoch, logs=None):
        measured = memory_probe.process_memory(self.device)
        self.epochs.append(measured)
        if self.verbose:
            plan = (f"; planned per device {self.planned / (1 << 20):.1f} MiB"
                    if self.planned else "")
            print(f"tfpar memory, epoch {epoch + 1}: {measured.format()}{plan}", flush=True)


def _planned_peak(model):
    from tfpar.plan import memory as plan

    strategy = getattr(model, "distribute_strategy", None)
    if hooks_of(strategy)._tfpar_memory_config is None or not model.trainable_weights:
        return None
    return plan.estimate_memory(model, strategy).peak
