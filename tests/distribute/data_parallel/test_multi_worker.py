"""Multi-worker DataParallelStrategy: real worker processes on 127.0.0.1 (some on two
simulated hosts: network namespaces joined by a virtual link)."""

import contextlib
import json
import os
import re
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import multi_worker_common as common
from cluster_helper import Cluster, run_in_own_session, stop_launcher

import tfpar

pytestmark = pytest.mark.slow

HERE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIT_WORKER = os.path.join(HERE, "workers", "fit.py")


@pytest.fixture
def cluster():
    clusters = []

    def make(workers=2):
        clusters.append(Cluster(workers))
        return clusters[-1]

    yield make
    for c in clusters:
        c.kill_all()


def _single_process_weights(epochs, examples, optimizer="sgd", strategy=None,
                            global_batch=common.GLOBAL_BATCH, jit_compile=False):
    x, y = common.data(examples)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = common.model()
        model.compile(common.optimizer(optimizer), common.loss(), jit_compile=jit_compile)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch),
              epochs=epochs, verbose=0)
    return model.get_weights()


# With compression="fp16" the workers sum float16 gradients across processes: they agree
# with each other, and with one process to float16's rounding only. With sync_every=3 each
# worker steps alone and the two average their weights every 3 steps (16 steps: also after
# fit): as two replicas of one process do (whose rule the conformance column "dp2_local"
# checks). ZeRO-1 with bfloat16: each gradient sent to its owner in bfloat16 (pairwise). Three workers by halving-doubling: the third hands its gradients to the first
# and gets the sum back, the first two exchange halves (a partial last global batch of 16
# of 136 examples split over 3 replicas: it must split, not hang). ZeRO-3 with a recipe
# that keeps moving averages (AdamW, weight decay, global clipping, use_ema overwriting the
# weights every 3 steps): each average on its weight's owner worker, every worker's weights
# the averages at the end of fit, as one process. Two cases run on 2 simulated hosts
# (`tfpar launch --hosts=2`: a network namespace and an address each, a virtual link
# between them), so their collectives cross a network interface: 4 workers summing
# hierarchically (within each host, then one slice per worker across the hosts), and
# ZeRO-3. And jit_compile=True with ZeRO-3: each worker's model call compiled by XLA, every
# variable read from its owner worker (a broadcast) before the compiled call, the
# gradients sent back to the owners outside it.
@pytest.mark.parametrize("workers, examples, compression, sync_every, communication, shard, "
                         "optimizer, hosts, jit_compile", [
                             (4, 128, None, 1, "hierarchical", None, "sgd", 2, False),
                             (3, 136, None, 1, "halving_doubling", None, "sgd", 1, False),
                             (2, 128, "fp16", 1, "auto", None, "sgd", 1, False),
                             (2, 128, "bf16", 1, "auto", "optimizer", "sgd", 1, False),
                             (2, 128, None, 3, "auto", None, "sgd", 1, False),
                             (2, 128, None, 1, "auto", "parameters", "adamw_clip_ema", 2, False),
                             (2, 128, None, 1, "auto", "parameters", "adam", 1, True)])
def test_workers_fit_equals_one_process(cluster, tmp_path, workers, examples, compression,
                                        sync_every, communication, shard, optimizer, hosts,
                                        jit_compile):
    batch = 24 if workers == 3 else common.GLOBAL_BATCH
    args = ([FIT_WORKER, f"--out={tmp_path}", "--epochs=2", f"--examples={examples}",
             f"--sync_every={sync_every}", f"--communication={communication}",
             f"--global_batch={batch}", f"--optimizer={optimizer}"]
            + ([f"--compression={compression}"] if compression else [])
            + ([f"--shard={shard}"] if shard else [])
            + (["--jit_compile=1"] if jit_compile else []))
    if hosts > 1:
        code, output = run_in_own_session(
            [sys.executable, "-m", "tfpar.cli.launch", f"--hosts={hosts}",
             f"--workers={workers}", "--timeout=220", "--", sys.executable, *args], 240)
        assert code == 0, output[-4000:]
        half = workers // 2
        assert ("simulated hosts: host 0 at 10.77.1.1: "
                + ", ".join(f"worker:{i}" for i in range(half)) + "; host 1 at 10.77.1.2: "
                + ", ".join(f"worker:{i}" for i in range(half, workers))) in output, \
            output[-4000:]
    else:
        tasks = cluster(workers)
        tasks.start(args)
        names = [f"worker:{i}" for i in range(workers)]
        assert tasks.wait(names, timeout=240) == [0] * workers, tasks.output()[-4000:]
    results = [json.loads((tmp_path / f"worker-{i}.json").read_text()) for i in range(workers)]
    options = f", shard={shard!r}" if shard else ""
    options += f", compression={compression!r}" if compression else ""
    options += f", sync_every={sync_every}" if sync_every > 1 else ""
    wire = "ring" if communication == "auto" else communication
    for result in results:
        assert result["strategy"] == (f"DataParallelStrategy(workers={workers}, "
                                      f"replicas={workers}, communication='{wire}'{options})")
        assert result["epochs_run"] == 2
        assert result["iterations"] == 2 * -(-examples // batch)
        assert result["predictions_shape"] == [examples, 3]
        # TensorFlow's ring sums in one group of every worker; tfpar's halving-doubling in
        # pairs; the hierarchy in groups of a host's workers and of one worker per host.
        assert result["all_reduce_group_sizes"] == (
            [workers] if wire == "ring" else [2] if wire == "halving_doubling"
            else sorted({workers // hosts, hosts})), result
    weights = [list(np.load(tmp_path / f"worker-{i}.npz").values()) for i in range(workers)]
    for other in weights[1:]:
        for w0, w1 in zip(weights[0], other):
            np.testing.assert_array_equal(w0, w1)
    want = _single_process_weights(2, examples, optimizer, global_batch=batch,
                                   jit_compile=jit_compile)
    if sync_every > 1:
        summed = want  # Plain data parallelism's: the averaging is another rule.
        want = _single_process_weights(2, examples, strategy=tfpar.DataParallelStrategy(
            ["/cpu:0", "/cpu:1"], sync_every=sync_every))
        assert max(float(np.abs(g - w).max()) for g, w in zip(want, summed)) > 1e-3
    if optimizer.endswith("_ema"):  # The averages were taken: not the last step's weights.
        last = _single_process_weights(2, examples, optimizer.removesuffix("_ema"),
                                       global_batch=batch)
        assert max(float(np.abs(g - w).max()) for g, w in zip(want, last)) > 1e-3
    tolerance = 1e-3 if compression else 1e-5
    for got, expected in zip(weights[0], want):
        np.testing.assert_allclose(got, expected, atol=tolerance, rtol=tolerance)
    if compression:  # The rounding happened: not one process's weights to float32's noise.
        assert max(float(np.abs(g - w).max()) for g, w in zip(weights[0], want)) > 1e-6


def _train_args(model_dir, epochs):
    return ["-m", "tfpar.cli.train", "--strategy=data", "--verbose=2", f"--epochs={epochs}",
            f"--model_dir={model_dir}", "--timeout_seconds=20"]


def test_dead_worker_stops_the_other_with_a_clear_message(cluster, tmp_path):
    """Resuming after it is the chaos test's (10 restarts) and test_train_binary's."""
    model_dir = tmp_path / "run"
    workers = cluster(2)
    workers.start(_train_args(model_dir, 4))
    # Kill worker 1 a moment into epoch 2 (epoch 1 has been backed up by then).
    deadline = time.monotonic() + 180
    while "Epoch 2/4" not in workers.output("worker:1"):
        assert time.monotonic() < deadline, workers.output()[-4000:]
        assert workers.process("worker:1").poll() is None, workers.output()[-4000:]
        time.sleep(0.05)
    time.sleep(0.3)
    killed_at = time.monotonic()
    workers.kill("worker:1")
    code = workers.process("worker:0").wait(timeout=90)
    survivor = workers.output("worker:0")
    assert code != 0
    assert time.monotonic() - killed_at < 60
    assert re.search(r"tfpar: training stopped on worker:0: a peer worker failed", survivor), \
        survivor[-3000:]
    assert "final:" not in survivor


def test_launcher_runs_the_binary_on_two_workers(tmp_path):
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", "tfpar.cli.launch", "--workers=2", "--", sys.executable, "-m",
         "tfpar.cli.train", "--verbose=2", "--epochs=2", f"--model_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stdout[-4000:]
    finals = re.findall(r"\[(worker:\d)\] final: loss=([\d.]+) accuracy=([\d.]+)", result.stdout)
    assert sorted(f[0] for f in finals) == ["worker:0", "worker:1"]
    assert finals[0][1:] == finals[1][1:]  # same model on both workers
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [
        "epoch-001.weights.h5", "epoch-002.weights.h5"]


# -- no silent hangs -------------------------------------------------------------------

HANG_WORKER = os.path.join(HERE, "workers", "hang.py")


def _hang_run(cluster, tmp_path, mode, timeout=4):
    workers = cluster(2)
    workers.start([HANG_WORKER, f"--mode={mode}", f"--timeout={timeout}", f"--out={tmp_path}"])
    names = ["worker:0", "worker:1"]
    if mode == "stuck":  # Worker 1 sleeps on; worker 0 must come back on its own.
        names = ["worker:0"]
    assert workers.wait(names, timeout=180) == [0] * len(names), workers.output()[-4000:]
    return {name: json.loads((tmp_path / f"{name.replace(':', '-')}.json").read_text())
            for name in names}


def test_a_stuck_worker_is_named_when_the_collective_times_out(cluster, tmp_path):
    """TensorFlow said only "Collective has timed out during execution" (and with no
    timeout, the default, waited forever)."""
    result = _hang_run(cluster, tmp_path, "stuck")["worker:0"]
    assert result.get("error_type") == "ClusterError", result
    assert ("A collective timed out after 4s on worker:0: worker:1 (alive, but not in the "
            "collective: stuck" in result["error"]), result
    assert result["seconds"] < 4 + 4 + 15, result


@pytest.mark.parametrize("shard", ["none", "gradients"])
def test_collectives_do_not_hold_a_thread_each_for_the_timeout(cluster, tmp_path, shard):
    """TensorFlow holds a thread for each collective that has a timeout, for as long as the
    timeout: with the default 600 s on every collective, 1,024 small steps left 12,400
    threads in each worker, and ZeRO-2 (a timed send per variable) aborted within 2,048
    ("Resource temporarily unavailable"). tfpar times the first collective of each step."""
    steps = 512
    workers = cluster(2)
    workers.start([os.path.join(HERE, "workers", "timed_collectives.py"), f"--out={tmp_path}",
                   f"--shard={shard}", f"--steps={steps}"])
    assert workers.wait(["worker:0", "worker:1"], timeout=240) == [0, 0], \
        workers.output()[-4000:]
    for i in (0, 1):
        result = json.loads((tmp_path / f"worker-{i}.json").read_text())
        assert result["steps"] == steps, result
        # Measured: ~2 a step (~4 under ZeRO-2); every collective timed: 12 a step and more.
        assert result["threads_gained"] < 6 * steps, result


def test_a_worker_with_one_strategy_more_fails_at_once_naming_it(cluster, tmp_path):
    """Its strategies' collectives never met the other worker's: both waited forever."""
    results = _hang_run(cluster, tmp_path, "count")
    error = results["worker:1"].get("error", "")
    assert results["worker:1"].get("error_type") == "ClusterError", results
    assert "worker:1 made cross-worker strategy #2" in error, error
    assert "at hang.py:" in error and "worker:0 made no strategy #2 within 4s" in error, error
    assert "error_type" in results["worker:0"], results  # It learns the peer is gone.


def test_a_local_strategy_on_one_worker_does_not_shift_the_cross_worker_keys(cluster, tmp_path):
    """A PipelineStrategy on worker 1 only took the next key block there: its next
    multi-worker strategy joined other groups than worker 0's, and both waited."""
    results = _hang_run(cluster, tmp_path, "order", timeout=60)
    assert "error" not in results["worker:0"] and "error" not in results["worker:1"], results
    assert results["worker:0"]["weights_sum"] == results["worker:1"]["weights_sum"]


def test_collective_timeout_values():
    from tfpar.distribute.data_parallel.multi_worker import collective_timeout

    assert collective_timeout(None) == 600.0 and collective_timeout(2) == 2.0
    with pytest.raises(ValueError, match=r"timeout_seconds must be a number of seconds > 0 "
                                         r"\(math.inf: no limit\), or None for 600s"):
        collective_timeout(0)


# -- elastic restarts --------------------------------------------------------------------

CHAOS_KILLS = 4  # (10 until session 21: each restart costs two processes of start-up)
CHAOS_EPOCHS = 30


def _chaos(tmp_path, kills, epochs, seed=0):
    """`tfpar launch --max_restarts` of a 2-worker Adam fit with a backup per epoch, each
    worker with its own directory (no shared filesystem); SIGKILLs a random worker at a
    random time after each start, `kills` times. Returns (exit code, output)."""
    import random
    import signal
    import subprocess
    import threading

    rng = random.Random(seed)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tfpar.cli.launch", "--workers=2", f"--max_restarts={kills}",
         "--timeout=400", "--grace_seconds=2", "--", sys.executable, FIT_WORKER,
         f"--out={tmp_path}", f"--epochs={epochs}", f"--model_dir={tmp_path}", "--own_dirs=1",
         "--optimizer=adam"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    lines, lock = [], threading.Lock()

    def read():
        for line in launcher.stdout:
            with lock:
                lines.append(line.rstrip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def wait_for(predicate, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and launcher.poll() is None:
            with lock:
                found = predicate(list(lines))
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError("\n".join(lines[-60:]))

    try:
        for kill in range(kills):
            # This start's training has begun on both workers: kill one of them soon.
            def training(seen, kill=kill):
                since = [i for i, l in enumerate(seen) if "restarting the job" in l]
                start = since[kill - 1] + 1 if kill else 0
                pids = {}
                for line in seen[start:]:
                    if " PID " in line:
                        pids[line.split("]")[0].strip("[")] = int(line.split()[-1])
                epochs = [l for l in seen[start:] if "Epoch" in l]
                return pids if len(pids) == 2 and epochs else None
            pids = wait_for(training)
            time.sleep(rng.uniform(0.0, 1.0))
            victim = rng.choice(sorted(pids))
            os.kill(pids[victim], signal.SIGKILL)
            wait_for(lambda seen, n=kill + 1: sum("restarting the job" in l for l in seen) >= n)
        code = launcher.wait(timeout=300)
        reader.join(10)
        return code, "\n".join(lines)
    finally:
        stop_launcher(launcher)


def test_chaos_kills_and_restarts_end_with_the_uninterrupted_weights(tmp_path):
    """A worker SIGKILLed at a random time, CHAOS_KILLS times: the launcher restarts the job, it
    resumes from the chief's backup (broadcast: the other worker has none of its own),
    and the final weights equal an uninterrupted run's. Before: a killed worker ended the
    run, and a resumed non-chief started again at epoch 0 with fresh weights."""
    start = time.monotonic()
    code, output = _chaos(tmp_path, CHAOS_KILLS, CHAOS_EPOCHS)
    assert code == 0, output[-6000:]
    assert output.count("restarting the job") == CHAOS_KILLS
    assert time.monotonic() - start < 420
    assert not (tmp_path / "worker-1" / "backup").exists() or not any(
        (tmp_path / "worker-1" / "backup").iterdir())  # Only the chief writes backups.
    want = _single_process_weights(CHAOS_EPOCHS, common.EXAMPLES, "adam")
    for task in ("worker-0", "worker-1"):
        got = list(np.load(tmp_path / f"{task}.npz").values())
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


# -- uneven inputs -------------------------------------------------------------------------

def test_workers_with_unequal_data_finish_each_epoch_together(cluster, tmp_path):
    """Worker 0 reads 10 batches, worker 1 13 (distribute_datasets_from_function): each
    stopped at its own count and their collectives crossed ("Collective instance 173
    expected type 0 and data_type 9 but got ... 1"). Now both run 13 steps; worker 0's
    last 3 are empty; each step's gradient is that of the examples read in it."""
    sys.path.insert(0, os.path.join(HERE, "workers"))
    import uneven

    workers = cluster(2)
    workers.start([os.path.join(HERE, "workers", "uneven.py"), f"--out={tmp_path}"])
    assert workers.wait(["worker:0", "worker:1"], timeout=180) == [0, 0], workers.output()[-4000:]
    results = [json.loads((tmp_path / f"worker-{i}.json").read_text()) for i in (0, 1)]
    steps = max(uneven.BATCHES)
    every_example = sum(uneven.BATCHES) * uneven.BATCH
    for result in results:
        assert result["iterations"] == uneven.EPOCHS * steps
        assert result["history"]["seen"] == [every_example] * uneven.EPOCHS
    # One device, on each step's examples from both workers.
    parts = [uneven.worker_data(k) for k in range(2)]
    batches = []
    for t in range(steps):
        chunk = [(x[t * uneven.BATCH:(t + 1) * uneven.BATCH], y[t * uneven.BATCH:(t + 1) * uneven.BATCH])
                 for x, y in parts if t < len(x) // uneven.BATCH]
        batches.append((np.concatenate([c[0] for c in chunk]), np.concatenate([c[1] for c in chunk])))
    # A known length: on a dataset of unknown length Keras 3.15 takes one more optimizer
    # step per epoch (measured: 28 iterations for 26 batches; it moves Adam's weights).
    dataset = tf.data.Dataset.from_generator(
        lambda: iter(batches), output_signature=(tf.TensorSpec((None, 4), tf.float32),
                                                 tf.TensorSpec((None,), tf.int32)),
    ).apply(tf.data.experimental.assert_cardinality(steps))
    model = common.model()
    model.compile(common.optimizer("adam"), common.loss())
    history = model.fit(dataset, epochs=uneven.EPOCHS, verbose=0)
    for task in ("worker-0", "worker-1"):
        for got, want in zip(np.load(tmp_path / f"{task}.npz").values(), model.get_weights()):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(results[0]["history"]["loss"], history.history["loss"], rtol=1e-5)


def test_across_workers_the_strategy_walks_like_stock_multi_worker_mirrored(cluster, tmp_path):
    """Each worker's public properties (resolver task type and id, should_checkpoint, ...)
    and cross-worker gather/reduce/run results, against MultiWorkerMirroredStrategy's."""
    results = {}
    for kind in ("stock", "tfpar"):
        out = tmp_path / kind
        out.mkdir()
        workers = cluster(2)
        workers.start([os.path.join(HERE, "workers", "api_worker.py"), f"--out={out}",
                       *(["--stock"] if kind == "stock" else [])])
        assert workers.wait(["worker:0", "worker:1"], timeout=120) == [0, 0], \
            workers.output()[-4000:]
        results[kind] = {i: json.loads((out / f"worker-{i}.json").read_text()) for i in (0, 1)}
    for i in (0, 1):
        stock, ours = results["stock"][i], results["tfpar"][i]
        assert {k: ours["properties"].get(k) for k in stock["properties"]} == stock["properties"]
        for key in ("gather", "reduce", "run", "local"):
            assert ours[key] == stock[key], key
    assert results["stock"][1]["properties"]["extended.should_checkpoint"] == ["returns", False]
    assert results["stock"][1]["properties"]["cluster_resolver"][1][1:3] == ["worker", 1]


# -- ZeRO across workers -----------------------------------------------------------------

SHARDED_WORKER = os.path.join(HERE, "workers", "sharded.py")


OPTIMIZERS = ("sgd_momentum", "adam", "adamw_clip")


def _resumes_under_other_strategies(path, shard, optimizer, one_device):
    """Resharding on load: the 2-worker checkpoint, loaded under another ZeRO stage on 4
    replicas of this process and into a 2-stage pipeline, trains one more epoch as one
    device does from it (weights and optimizer state both restored)."""
    import tfpar

    x, y = common.data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(common.GLOBAL_BATCH)
    one_device.fit(dataset, epochs=1, verbose=0)
    other = {"optimizer": "parameters", "gradients": "optimizer", "parameters": "gradients"}
    for strategy in (tfpar.DataParallelStrategy([f"/cpu:{i}" for i in range(4)],
                                                shard=other[shard]),
                     tfpar.PipelineStrategy(["/cpu:0", "/cpu:1"], num_micro_batches=2)):
        with strategy.scope():
            model = common.model()
            model.compile(common.optimizer(optimizer), common.loss())
            model.optimizer.build(model.trainable_variables)
        model.load_weights(path)
        model.fit(dataset, epochs=1, verbose=0)
        for got, expected in zip(model.get_weights(), one_device.get_weights()):
            np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=repr(strategy))


def _value_bytes(file):
    import h5py

    sizes = []
    with h5py.File(file, "r") as h5:
        h5.visititems(lambda _, item: sizes.append(item.nbytes)
                      if isinstance(item, h5py.Dataset) else None)
    return sum(sizes)


def _written_by_their_owners(directory, run, want):
    """Keras' sharded weights written by the 2 workers (each the state it owns, nothing
    twice) load in plain Keras on one device as the weights and optimizer state `want`."""
    import keras

    written = [0, 0]  # Bytes of values in each worker's files (file n: worker n % 2).
    for file in directory.glob(f"{run}_*.weights.h5"):
        written[int(file.name[len(run) + 1:][:5]) % 2] += _value_bytes(file)
    total = sum(np.asarray(w).nbytes for w in want)
    assert sum(written) == total, (written, total)
    # Each worker writes its share: its slots, and its weights (under stage 3 it holds
    # them; under stages 1 and 2 it owns their state); the chief also the step counter.
    assert all(0 < w < 0.75 * total for w in written), (written, total)
    loaded = common.model()
    loaded.compile(common.optimizer(run.split("-", 1)[1]), common.loss())
    loaded.optimizer.build(loaded.trainable_variables)
    loaded.load_weights(directory / f"{run}.weights.json")
    got = loaded.get_weights() + [v.numpy() for v in loaded.optimizer.variables]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5, err_msg=run)


def _each_loads_what_it_keeps(directory, shard):
    """Loading Keras' sharded weights under ZeRO across workers: each worker reads from
    disk about the bytes of the values it keeps (under stage 3 its share of the weights, not
    all of them), and the loaded model steps as the saved one."""
    reads = []
    for i in (0, 1):
        result = json.loads((directory / f"worker-{i}-mlp-{shard}.json").read_text())
        # Exactly its values (Adam's slots, its weights: all under stages 1-2, its share
        # under stage 3; the step counter, the learning rate) and nothing else ...
        assert result["values_read"] == result["load_kept"], (shard, result)
        # ... and from disk little more: the map, the files' metadata, HDF5's sieve
        # buffer (up to 64 KiB read for a small value).
        assert result["load_read"] < result["load_kept"] + 65536 * (result["values"] + 1), \
            (shard, result)
        reads.append(result["load_read"])
        weights = list(np.load(directory / f"worker-{i}-mlp-{shard}.npz").values())
        half = len(weights) // 2
        for saved, loaded in zip(weights[:half], weights[half:]):
            np.testing.assert_allclose(loaded, saved, atol=1e-6, err_msg=shard)
    assert min(reads) > 0.3 * max(reads), reads  # (Both read: neither took it all.)


def _one_process_run(optimizer):
    """Weights after 2 epochs, the optimizer state then, and weights after a third."""
    x, y = common.data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(common.GLOBAL_BATCH)
    reference = common.model()
    reference.compile(common.optimizer(optimizer), common.loss())
    reference.fit(dataset, epochs=2, verbose=0)
    want = reference.get_weights()
    state = [v.numpy() for v in reference.optimizer.variables]
    weight_bytes = sum(w.nbytes for w in want)
    slot_bytes = sum(v.nbytes for v in state if v.shape)
    reference.fit(dataset, epochs=1, verbose=0)
    predictions = reference.predict(x, batch_size=common.GLOBAL_BATCH, verbose=0)
    return (want, state, reference.get_weights() + [predictions], weight_bytes, slot_bytes,
            reference.evaluate(dataset, verbose=0))


# One pair of worker processes per stage (~10-15 s each here), both optimizers in it.
@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
def test_two_workers_sharded_train_save_and_resume_as_one_process(cluster, tmp_path, shard):
    """ZeRO stages 1-3 over 2 workers, with SGD momentum and Adam: the optimizer state
    (and under stage 3 the weights) split between them, weights equal to one process, a
    checkpoint holding the full state, a resume from the backup, then evaluate and
    predict as one process."""
    import keras

    # Buckets of 64 bytes: both kernels are larger than a bucket, and
    # there are 4 buckets for 2 workers (ZeRO-1 and -2 used to hang there).
    sizes = [w.nbytes for w in common.model().get_weights()]
    assert sum(s > 64 for s in sizes) == 2 and len(sizes) == 4
    workers = cluster(2)
    workers.start([SHARDED_WORKER, f"--out={tmp_path}", f"--backups={tmp_path / 'backups'}",
                   f"--shard={shard}", f"--optimizers={','.join(OPTIMIZERS)}",
                   "--bytes_per_pack=64"])
    assert workers.wait(["worker:0", "worker:1"], timeout=300) == [0, 0], \
        workers.output()[-4000:]
    _each_loads_what_it_keeps(tmp_path, shard)
    for optimizer in OPTIMIZERS:
        run = f"{shard}-{optimizer}"
        want, state, want_resumed, weight_bytes, slot_bytes, loss = _one_process_run(optimizer)
        held, weights_held = [], []
        for i in (0, 1):
            result = json.loads((tmp_path / f"worker-{i}-{run}.json").read_text())
            assert result["strategy"] == (f"DataParallelStrategy(workers=2, replicas=2, "
                                          f"communication='ring', shard='{shard}')")
            assert result["resumed_iterations"] == 3 * 128 // common.GLOBAL_BATCH
            np.testing.assert_allclose(result["resumed_loss"], loss, rtol=1e-5, err_msg=run)
            held.append(result["optimizer_bytes"][0])
            weights_held.append(result["weight_bytes"][0])
            weights = list(np.load(tmp_path / f"worker-{i}-{run}.npz").values())
            assert len(weights) == len(want + want_resumed)
            for got, expected in zip(weights, want + want_resumed):
                np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=run)
        # Each worker holds part of the state (+ its step counter and learning rate), and
        # under stage 3 part of the weights.
        assert all(h < 0.75 * slot_bytes for h in held) and sum(held) >= slot_bytes, held
        if shard == "parameters":
            assert all(0 < h < 0.75 * weight_bytes for h in weights_held), weights_held
            assert sum(weights_held) == weight_bytes, weights_held
        else:
            assert weights_held == [weight_bytes] * 2, weights_held
        one_device = common.model()
        one_device.compile(common.optimizer(optimizer), common.loss())
        one_device.optimizer.build(one_device.trainable_variables)
        one_device.load_weights(tmp_path / f"{run}.weights.h5")
        for got, expected in zip(one_device.get_weights(), want):
            np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=run)
        for got, expected in zip(one_device.optimizer.variables, state):
            np.testing.assert_allclose(got.numpy(), expected, atol=1e-5, err_msg=run)
        # model.save and ModelCheckpoint (the chief's files; the others wrote elsewhere)
        # load without any strategy: the weights and the state after 2 epochs.
        for saved in (f"{run}.keras", f"{run}-2.keras"):
            loaded = keras.models.load_model(tmp_path / saved)
            for got, expected in zip(loaded.get_weights() + [
                    v.numpy() for v in loaded.optimizer.variables], want + state):
                np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=saved)
        assert sorted(p.name for p in tmp_path.glob(f"{run}-*.keras")) == [
            f"{run}-{epoch}.keras" for epoch in (1, 2, 3)]
        _written_by_their_owners(tmp_path, run, want + state)
        if optimizer == OPTIMIZERS[-1]:
            _resumes_under_other_strategies(tmp_path / f"{run}.weights.json", shard, optimizer,
                                            one_device)
