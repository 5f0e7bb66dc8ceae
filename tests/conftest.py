"""Test setup: 4 logical CPUs, made once before TensorFlow starts."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

NUM_CPUS = 4


def pytest_configure(config):
    import tfpar

    tfpar.virtual_cpus(NUM_CPUS)
    # The pytest processes of one run share files under this id (the conformance suite's
    # one-device references); the controlling process names it, and removes them after.
    if not hasattr(config, "workerinput") and hasattr(config.option, "testrunuid") \
            and config.option.testrunuid is None:
        import uuid

        config.option.testrunuid = uuid.uuid4().hex


def pytest_sessionstart(session):
    # (After pytest's faulthandler plugin has pointed faulthandler at stderr.)
    # A pytest process that crashes (a fatal signal in TensorFlow) dumps its threads' stacks
    # into a file, which the controlling process prints last: the end of a CI log is what
    # gets read, and there the stderr dump showed only its tail (xdist's own thread).
    config = session.config
    if hasattr(config, "workerinput"):
        import faulthandler

        worker = config.workerinput["workerid"]
        config._tfpar_crash_log = open(_crash_log(config, worker), "w")
        faulthandler.enable(file=config._tfpar_crash_log, all_threads=True)
        config._tfpar_stall_log = open(_crash_log(config, worker, "stall"), "w")
        # Another process watches this one's in-process tests (tests/stall_watch.py): a
        # stalled process cannot be trusted to report on itself.
        import subprocess
        import sys

        config._tfpar_stall_watch = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(__file__), "stall_watch.py"),
             str(os.getpid()), str(STALL_SECONDS), _crash_log(config, worker, "native")],
            stdin=subprocess.PIPE)


def pytest_sessionfinish(session):
    watch = getattr(session.config, "_tfpar_stall_watch", None)
    if watch is not None:
        watch.stdin.close()  # (It exits at end of input.)
        try:
            watch.wait(timeout=30)
        except Exception:  # noqa: BLE001 - never let the watcher outlive the run
            watch.kill()


# An in-process test that runs past this long has its threads' stacks written down (it goes on),
# and printed at the end of the run: such tests take seconds alone, but suite runs saw them
# stall for 83-175 s (late tf.data iterator deletions: see pytest_runtest_teardown).
# (Multi-process tests keep pytest.ini's faulthandler_timeout.)
STALL_SECONDS = 70


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    log = getattr(item.config, "_tfpar_stall_log", None)
    if log is None or item.get_closest_marker("slow") is not None:
        yield
        return
    import faulthandler
    import resource
    import time

    # What the process did meanwhile tells a stall's kind: this thread's CPU time (low: it
    # waited, for the interpreter lock or for a core), the whole process's, and major page
    # faults (memory paged back in).
    start, thread_cpu = time.monotonic(), time.thread_time()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    from tfpar.cluster.silence_watch import tell

    watch = item.config._tfpar_stall_watch
    tell(watch, f"start {item.nodeid}")
    faulthandler.dump_traceback_later(STALL_SECONDS, file=log)  # (Replaces pytest's timer.)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        tell(watch, "stop")
        took = time.monotonic() - start
        if took > STALL_SECONDS:
            now = resource.getrusage(resource.RUSAGE_SELF)
            log.write(
                f"STALLED: {item.nodeid} took {took:.0f} s (the stacks above are from "
                f"{STALL_SECONDS} s in); CPU time meanwhile: this thread "
                f"{time.thread_time() - thread_cpu:.1f} s, the process "
                f"{now.ru_utime + now.ru_stime - usage.ru_utime - usage.ru_stime:.1f} s; "
                f"major page faults {now.ru_majflt - usage.ru_majflt}; host load "
                f"{os.getloadavg()[0]:.1f}\n")
            log.flush()


@pytest.hookimpl(trylast=True)  # (After the test's fixtures are torn down.)
def pytest_runtest_teardown(item, nextitem):
    # A tf.data iterator that dies in a full garbage collection long after its test waits
    # for its autotuning thread's next wake-up, which TF 2.21 does not bring forward: up to a
    # minute per iterator, holding the interpreter lock. The suite's in-process stalls of
    # 87-173 s were that (gdb: ~IteratorResource -> ~LogicalThreadWrapper ->
    # WaitForNotification; an iterator alive 70 s took 11.9 s to delete, 0.2 s at 5 s old,
    # 0.18 s with autotuning off). So each test's garbage goes right after it, and what
    # survives is frozen out of later collections (one costs 0.03 s then, not 0.25 s).
    import gc

    gc.collect()
    gc.freeze()


def _crash_log(config, worker="*", kind="crash"):
    import tempfile

    # (A pytest-xdist process reads the run id from its environment.)
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID") or config.option.testrunuid
    return os.path.join(tempfile.gettempdir(), f"tfpar-{kind}-{run_id}-{worker}.log")


def pytest_terminal_summary(terminalreporter, config):
    import glob
    import re

    if hasattr(config, "workerinput") or getattr(config.option, "testrunuid", None) is None:
        return
    for kind, limit in (("stall", 80), ("native", 150), ("crash", 30)):
        for path in sorted(glob.glob(_crash_log(config, kind=kind))):
            with open(path) as f:
                # The signal and the crashed thread's stack (most recent call first) go
                # first; pytest's own frames say nothing.
                lines = [line for line in f.read().splitlines()
                         if not re.search(r"/(_pytest|pluggy|xdist|execnet)/", line)]
            if kind == "crash":
                main = next((i for i, line in enumerate(lines)
                             if line.startswith("Current thread")), len(lines))
                lines = lines[:1] + lines[main:] + lines[1:main]
            elif kind == "stall":  # Every thread's stack: one may hold what the test waits for.
                lines = [line for i, line in enumerate(lines) if line.strip() and (
                    not line.startswith(("Thread", "Current thread"))
                    or (i + 1 < len(lines) and lines[i + 1].startswith("  ")))]
                lines = ([line for line in lines if line.startswith("STALLED")] +
                         [line for line in lines if not line.startswith("STALLED")])
            if lines:
                what = "crashed" if kind == "crash" else "stalled"
                what += " (seen from outside)" if kind == "native" else ""
                terminalreporter.section(f"a test {what}: {os.path.basename(path)}")
                terminalreporter.line("\n".join(lines[:limit]))


def pytest_unconfigure(config):
    run_id = getattr(config.option, "testrunuid", None)
    if run_id and not hasattr(config, "workerinput"):
        import glob
        import shutil
        import tempfile

        shutil.rmtree(os.path.join(tempfile.gettempdir(), f"tfpar-conformance-{run_id}"),
                      ignore_errors=True)
        for kind in ("crash", "stall", "native"):
            for path in glob.glob(_crash_log(config, kind=kind)):
                os.remove(path)


@pytest.hookimpl(tryfirst=True)  # (Before xdist's own, which reads the groups.)
def pytest_collection_modifyitems(config, items):
    # With pytest-xdist, every multi-process test runs in the same worker, one at a time:
    # they start clusters whose timeouts assume the machine is not shared with another.
    # (xdist interleaves the group's modules: their shared clusters are session fixtures,
    # which a module switch does not tear down and run again.)
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("one_process"):
            item.add_marker(pytest.mark.xdist_group("processes"))


def cpus(n):
    return [f"/cpu:{i}" for i in range(n)]


def device_index(device):
    """The index of a device string ("/job:localhost/.../device:CPU:1" -> 1), None if empty."""
    import tensorflow as tf

    return tf.DeviceSpec.from_string(device).device_index if device else None


def tf_functions_in(fn, depth=0):
    """The tf.functions a Keras train function closes over: what fit really ran."""
    import tensorflow as tf

    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        value = cell.cell_contents
        if isinstance(value, tf.types.experimental.PolymorphicFunction):
            found.append(value)
        elif callable(value) and depth < 3:
            found += tf_functions_in(value, depth + 1)
    return found


def small_model(seed=0, inputs=4, classes=3):
    """A small MLP with deterministic weights."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((inputs,)),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(classes),
    ])


def call_loss_model(width=8):
    """Dense with an activity regularizer, then a layer adding a loss in call, then a head:
    both kinds of losses added in `call`, each a per-batch mean."""
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(width, activation="tanh",
                           activity_regularizer=keras.regularizers.L2(0.1)),
        mean_square_loss_layer()(), keras.layers.Dense(width), keras.layers.Dense(3)])


_layers = {}


def mean_square_loss_layer():
    """A layer class that adds half the batch mean of x**2 as a loss (made once, after the
    logical CPUs are set up)."""
    import keras

    if "mean_square" not in _layers:
        @keras.saving.register_keras_serializable("tfpar_tests")
        class MeanSquareLoss(keras.layers.Layer):
            def call(self, x):
                self.add_loss(0.5 * keras.ops.mean(keras.ops.square(x)))
                return x

        _layers["mean_square"] = MeanSquareLoss
    return _layers["mean_square"]


def toy_data(n=64, inputs=4, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, inputs)).astype("float32"),
            rng.integers(0, classes, n).astype("int32"))


@pytest.fixture(scope="session")
def toy():
    return toy_data()


def routed_all_reduce_ops(n, route):
    """TensorFlow's collective all-reduce over `n` logical CPUs, tfpar's launchers in it
    routing dense all-reduces by `route(key_base)` (a fresh block of group keys). Returns
    (ops, the devices, the key base)."""
    import tfpar
    from tfpar.distribute.common import group_keys
    from tfpar.keras import tf_runtime

    devices = [tf_runtime.canonical_device(d) for d in cpus(n)]
    keys = tf_runtime.collective_keys(tfpar.DataParallelStrategy(cpus(n),
                                                                 communication="ring").extended)
    ops = tf_runtime.ring_all_reduce(devices, 0, keys)
    base = group_keys.next_key_base()
    tf_runtime.replace_launchers(ops, n, keys, tf_runtime.ring_options(0), 0, route(base))
    return ops, devices, base


def check_routed_all_reduce(ops, n, devices=None):
    """Runs TensorFlow's collective all-reduce `ops` over `n` logical CPUs (tfpar's routed
    launchers in them) on replica i's values 0.1 x (i + 1) x [0..6], traced and eagerly:
    every replica ends with the sum, bitwise alike. Returns the traced graph."""
    import tensorflow as tf

    from tfpar.keras import tf_runtime

    devices = devices or [tf_runtime.canonical_device(d) for d in cpus(n)]
    values = []
    for i, device in enumerate(devices):
        with tf.device(device):
            values.append(tf.constant(np.arange(7, dtype="float32") * 0.1 * (i + 1)))
    values = tf_runtime.per_replica(values)
    want = np.arange(7, dtype="float32") * 0.1 * sum(range(1, n + 1))

    @tf.function
    def reduce(values):
        return list(ops.batch_reduce(tf.distribute.ReduceOp.SUM, [(values, values)])[0].values)

    for result in (reduce(values), ops.reduce(tf.distribute.ReduceOp.SUM, values, values).values):
        for got in result:
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
            np.testing.assert_array_equal(got.numpy(), result[0].numpy())  # Bitwise alike.
    return reduce.get_concrete_function(values).graph


def graph_operations(graph):
    """Every operation of a traced `graph` and of the functions it calls (loop bodies and
    conditions, branches, nested tf.functions), recursively."""
    found = list(graph.get_operations())
    for op in graph.get_operations():
        for attribute in ("body", "cond", "then_branch", "else_branch", "f"):
            try:
                name = op.get_attr(attribute).name
            except (ValueError, AttributeError):
                continue
            function = graph._get_function(name)
            if function is not None and getattr(function, "graph", None) is not None:
                found += graph_operations(function.graph)
    return found


def gpt2_language_model(length, vocabulary):
    """A small keras-hub GPT-2 (2 blocks, 2 heads, hidden 8, no dropout) on `length` tokens
    with a Dense head over `vocabulary`, not compiled; its inputs `token_ids` and
    `padding_mask`. (keras-hub must be installed: callers skip without it.)"""
    import keras
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocabulary, num_layers=2, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=length, dropout=0.0)
    inputs = {k: keras.Input((length,), dtype="int32", name=k) for k in backbone.input}
    return keras.Model(inputs, keras.layers.Dense(vocabulary)(backbone(inputs)))
