"""tfpar.PipelineStrategy with its stages on other processes: a chief and worker servers.

The end-to-end test runs as a user would: `tfpar launch --workers 2 --coordinator
--max_restarts 1 -- python tests/workers/pipeline_chief.py`, one stage per worker. It checks
the trained weights against one device, where each stage's variables live, the error when
a stage worker is killed, and the run the launcher starts again resuming from the backup.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from cluster_helper import alive, children_of, launch, stop_launcher, wait_for_line
from tfpar.cluster.launcher import Launcher, Task, cluster_jobs, free_ports, make_cluster
from tfpar.cluster.tf_config import ClusterConfig, TFConfigError, check_pipeline_cluster

HERE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHIEF = os.path.join(HERE, "workers", "pipeline_chief.py")
PY = sys.executable
WORKER = "/job:worker/replica:0/task:{}/device:CPU:0"


def _lose_worker_1(tmp_path, lose, then=None, launcher_flags=(), chief_flags=()):
    """Runs the chief of 2 stage workers under `tfpar launch --max_restarts=1`; after the
    first epoch (3 steps) and its backup the chief waits: `lose(pid)` is done to stage 1's
    worker, then the chief trains on, and `then(launcher, lines)` (if given) runs while the
    job goes on. Returns (the output, run 0's and run 1's results)."""
    command = [PY, "-m", "tfpar.cli.launch", "--workers=2", "--coordinator", "--max_restarts=1",
               *launcher_flags, "--timeout=300", "--",
               PY, CHIEF, f"--out={tmp_path}", "--pause_after=0", *chief_flags]
    launcher, lines, reader = launch(command)
    try:
        wait_for_line("[chief:0] PAUSED", launcher, lines, timeout=120)
        [worker] = children_of(launcher.pid, "worker", 1)
        lose(worker)
        (tmp_path / "killed").touch()
        if then is not None:
            then(launcher, lines)
        assert launcher.wait(timeout=180) == 0, "".join(lines)[-5000:]
    finally:
        stop_launcher(launcher)
    reader.join(10)
    return "".join(lines), *(json.loads((tmp_path / f"run{k}.json").read_text())
                             for k in (0, 1))


@pytest.mark.slow
def test_two_worker_pipeline_trains_as_one_device_and_resumes_after_a_lost_worker(tmp_path):
    def kill(worker):
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(worker)

    start = time.monotonic()
    out, first, rerun = _lose_worker_1(tmp_path, kill, launcher_flags=["--report_seconds=30"])

    # One stage per worker, each stage's variables (and their Adam slots) on its worker.
    stage_devices = [WORKER.format(0), WORKER.format(1)]
    for run in (first, rerun):
        assert run["stage_devices"] == stage_devices
        assert [len(layers) for layers in run["stages"]] == [1, 1]
        for layers, device in zip(run["stages"], stage_devices):
            assert all(run["layer_devices"][name] == [device] for name in layers), run
    assert rerun["optimizer_devices"] == stage_devices
    # K=2, M=4, Adam: the weights of the unsplit model trained on one device.
    assert first["start_iterations"] == 0 and first["start_difference"] == 0.0
    assert first["epoch_differences"]["0"] < 1e-5
    # R=2 across processes needs one logical CPU of the chief per replica; it has one.
    assert "Call tfpar.virtual_cpus(2)" in first["replicas_error"]

    # The killed worker ends training with an error that names it and says what to do.
    assert first["epochs_run"] == [0, 1]  # Epoch 1 started, and failed.
    assert first["error_type"] == "ClusterError"
    assert re.match(
        r"tfpar\.PipelineStrategy lost a stage worker: worker:1 \(127\.0\.0\.1:\d+\), which "
        r"held stage 1 on /job:worker/replica:0/task:1/device:CPU:0, stopped accepting "
        r"connections", first["error"]), first["error"]
    assert "keras.callbacks.BackupAndRestore it resumes from the last backup" in first["error"]
    assert first["error_seconds"] < 10
    assert "[chief:0] tfpar.errors.ClusterError: tfpar.PipelineStrategy lost a stage worker" in out
    assert re.search(r"\[launcher\] worker:1 exited with code -9: waiting up to 30s", out), out
    assert ("[launcher] chief:0 exited with code 1: restarting the job (restart 1 of 1)"
            in out), out[-4000:]

    # The rerun resumed from the backup of epoch 0: it ran epochs 1 and 2 only, starting
    # from the weights and Adam state of step 3, and ends where one device does after 9.
    assert rerun["epochs_run"] == [1, 2]
    assert rerun["start_iterations"] == 3
    assert rerun["start_difference"] < 1e-5
    assert rerun["epoch_differences"]["1"] < 1e-5 and rerun["epoch_differences"]["2"] < 1e-5
    assert "error" not in rerun
    assert time.monotonic() - start < 240


@pytest.mark.slow
def test_a_stopped_stage_worker_ends_the_chief_with_its_name_and_the_job_resumes(tmp_path):
    """SIGSTOP, not SIGKILL: the worker's kernel still accepts connections and TensorFlow
    waits for it without end. Before: the chief hung until `tfpar launch --timeout`."""
    timeout, stopped, noticed = 8, [], []

    def stop(worker):
        os.kill(worker, signal.SIGSTOP)
        stopped.append(time.monotonic())

    def wait_for_the_message(launcher, lines):
        wait_for_line("[chief:0] tfpar: worker:1", launcher, lines, timeout=timeout + 60)
        noticed.append(time.monotonic() - stopped[0])

    out, first, rerun = _lose_worker_1(tmp_path, stop, wait_for_the_message,
                                       launcher_flags=["--grace_seconds=2"],
                                       chief_flags=[f"--stage_timeout={timeout}"])
    assert first["probes"] == ["answers", "answers"]  # Live tfpar.cluster.server workers answer.
    assert re.search(
        r"\[chief:0\] tfpar: worker:1 \(127\.0\.0\.1:\d+\), which holds stage 1 of the "
        r"pipeline on /job:worker/replica:0/task:1/device:CPU:0, has not answered for \d+ s: "
        r"its process is stopped or hung", out), out[-4000:]
    assert timeout <= noticed[0] < timeout + 30
    assert (f"[launcher] chief:0 exited with code -{int(signal.SIGTERM)}: restarting the job "
            f"(restart 1 of 1)" in out), out[-4000:]
    # The rerun (on fresh workers) resumed from epoch 0's backup and ends as one device.
    assert first["epochs_run"] == [0]  # (Written at the pause: then it was ended.)
    assert rerun["epochs_run"] == [1, 2] and rerun["start_iterations"] == 3
    assert rerun["epoch_differences"]["2"] < 1e-5


@pytest.mark.slow
def test_the_training_binary_pipelines_across_workers_under_the_launcher():
    command = [PY, "-m", "tfpar.cli.launch", "--workers=2", "--coordinator", "--timeout=240", "--",
               PY, "-m", "tfpar.cli.train", "--strategy=pipeline", "--epochs=1",
               "--num_micro_batches=2", "--batch_size=128", "--verbose=2"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert run.returncode == 0, run.stdout[-4000:]
    assert re.search(r"\[chief:0\] final: loss=[\d.]+ accuracy=0\.9\d+ .* replicas=1",
                     run.stdout), run.stdout[-4000:]
    assert not re.search(r"^\[worker:\d\] (Epoch|final)", run.stdout, re.M)  # They serve.


# --- Hybrids across worker processes: R x K x T over 4 workers -------------------------

HYBRID_CHIEF = os.path.join(HERE, "workers", "hybrid_chief.py")


HYBRID_LAYOUTS = {"zero3": "2,2,1,parameters", "tp_zero1": "2,1,2,optimizer",
                  "tp_zero3": "2,1,2,parameters"}


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    """Runs hybrid_chief.py (the Megatron MLP, Adam, 2 epochs against one device) under
    `tfpar launch --workers=4 --coordinator --hosts=2`, once for all layouts; {name: its
    results}. Two simulated hosts (network namespaces, an address each, a virtual link):
    the chief and workers 0-1 on the first, workers 2-3 on the second, so each stage's
    replicas (tasks s and 2 + s) reduce and gather across the hosts' link, and each
    replica's stages (or tensor-parallel halves) talk inside a host."""
    out = tmp_path_factory.mktemp("hybrids") / "result.json"
    command = [PY, "-m", "tfpar.cli.launch", "--workers=4", "--coordinator", "--hosts=2",
               "--timeout=200",
               "--", PY, HYBRID_CHIEF, f"--out={out}",
               f"--layouts={';'.join(HYBRID_LAYOUTS.values())}"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=260,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert run.returncode == 0, run.stdout[-4000:]
    assert ("simulated hosts: host 0 at 10.77.1.1: chief:0, worker:0, worker:1; host 1 at "
            "10.77.1.2: worker:2, worker:3") in run.stdout, run.stdout[-4000:]
    results = dict(zip(HYBRID_LAYOUTS, json.loads(out.read_text())))
    for result in results.values():
        assert result["moved"] > 1e-3  # Training changed the weights: the comparison can tell.
    return results


def _task(device):
    return int(re.search(r"/task:(\d+)/", device)[1])


@pytest.mark.slow
def test_pipeline_replicas_with_zero_3_train_on_four_worker_processes_as_one_device(hybrids):
    """R=2 replicas x K=2 stages, one stage per worker process, shard='parameters': each
    weight and its Adam slots live on one worker, its owner among its stage's two."""
    result = hybrids["zero3"]
    assert result["difference"] < 1e-5, result
    # Each stage's two copies (on two processes) reduce by a ring of peer collectives, not
    # on one root device (issue 36).
    assert result["stage_communication"] == {"0": "ring", "1": "ring"}, result
    assert result["stage_devices"] == [[WORKER.format(0), WORKER.format(1)],
                                       [WORKER.format(2), WORKER.format(3)]]
    stage_tasks = [{0, 2}, {1, 3}]  # Stage s of replica r is on task 2r + s.
    owners = {}
    for path, devices in result["weights"].items():
        [device] = devices  # One copy: on its owner only.
        stage = 0 if _task(device) in stage_tasks[0] else 1
        owners.setdefault(stage, set()).add(_task(device))
        slots = [d for name, d in result["slots"].items()
                 if name.startswith("adam/" + path.replace("/", "_"))]
        assert slots and all(d == [device] for d in slots), (path, device, slots)
    assert owners == {0: {0, 2}, 1: {1, 3}}  # Both replicas own a share of each stage.


@pytest.mark.slow
def test_tensor_parallel_replicas_with_zero_1_train_on_four_worker_processes_as_one_device(
        hybrids):
    """R=2 replicas x T=2 (one stage split Megatron's way over two worker processes),
    shard='optimizer': a split kernel has a shard on every worker; an unsplit weight a copy
    on each replica's first; every Adam slot one owner."""
    result = hybrids["tp_zero1"]
    assert result["difference"] < 1e-5, result
    assert set(result["stage_communication"].values()) == {"ring"}, result
    # Each replica's T=2 devices are CPUs of two processes: the stage runs replicated, its
    # sums all-reduced by peer collectives across the processes.
    assert result["tensor_communication"] == [["all_reduce"]] * 2, result
    # Read off the traced step: each of the 4 workers' devices all-reduces its tensor group's
    # sums itself (M=2 micro-batches x the MLP's 2 Megatron pairs, forward and backward), and
    # no device sums for the others.
    reductions = result["tensor_reductions"]
    assert sorted(_task(d) for d in reductions) == [0, 1, 2, 3], reductions
    counts = {len(types) for types in reductions.values()}
    assert all(set(t) == {"CollectiveReduceV2"} for t in reductions.values()), reductions
    assert len(counts) == 1 and counts.pop() >= 4, reductions
    for path, devices in result["weights"].items():
        split = re.search(r"mlp_(in_\d/(kernel|bias)|out_\d/kernel)$", path)
        assert sorted(map(_task, devices)) == ([0, 1, 2, 3] if split else [0, 2]), path
    assert result["slots"] and all(len(d) == 1 for d in result["slots"].values())
    # Shard t lives on task t (replica 0) and task t + 2 (replica 1): its slots on one.
    owners = set()
    for name, [device] in result["slots"].items():
        shard = re.search(r"_shard(\d)_", name)
        allowed = {int(shard[1]), int(shard[1]) + 2} if shard else {0, 2}
        assert _task(device) in allowed, (name, device)
        owners.add(_task(device) // 2)
    assert owners == {0, 1}  # Both replicas own a share.


# --- The launcher's coordinator mode, with stand-in processes (no TensorFlow) -----------

def _launch_coordinator(code, server, **kwargs):
    lines = []
    launcher = Launcher([PY, "-c", code], 2, output=lines.append, coordinator=True,
                        server_command=[PY, "-c", server], **kwargs)
    return launcher.run(), lines, launcher


def test_coordinator_cluster_has_a_chief_that_runs_the_command_while_workers_serve(tmp_path):
    assert cluster_jobs(2, coordinator=True) == [("chief", 1), ("worker", 2)]
    assert list(make_cluster(2, coordinator=True)) == ["chief", "worker"]
    assert cluster_jobs(2, ps=1, coordinator=True) == cluster_jobs(2, ps=1)
    with pytest.raises(ValueError, match="coordinator must be True or False"):
        cluster_jobs(2, coordinator="yes")
    # Each server says which task it serves, then marks it done; the chief waits for both.
    server = ("import os, json, time; task = json.loads(os.environ['TF_CONFIG'])['task'];"
              "print('serving', task, flush=True);"
              f"open(os.path.join({str(tmp_path)!r}, str(task['index'])), 'w').close();"
              "time.sleep(600)")
    chief = ("import os, json, time; print(json.loads(os.environ['TF_CONFIG'])['task']);"
             f"[time.sleep(0.05) for _ in range(200) if len(os.listdir({str(tmp_path)!r})) < 2]")
    code, lines, launcher = _launch_coordinator(chief, server, grace_seconds=1)
    assert code == 0, lines
    assert "[chief:0] {'type': 'chief', 'index': 0}" in lines
    assert sorted(l for l in lines if "serving" in l) == [
        f"[worker:{i}] serving {{'type': 'worker', 'index': {i}}}" for i in (0, 1)]
    assert all(t.process.poll() is not None for t in launcher.tasks)  # Servers stopped.


def test_a_lost_coordinator_worker_lets_the_chief_fail_and_the_job_restarts(tmp_path):
    """A worker holds pipeline stages: when it dies the chief gets report_seconds to fail
    with its own error; with --max_restarts the whole job starts again (new servers too)."""
    runs, died = tmp_path / "runs", tmp_path / "died"
    # Worker 1 of the first job dies at once; every other server serves. The chief fails in
    # its first run, once the worker has died (as a pipeline's chief would).
    server = (f"import os, json, sys, time; i = json.loads(os.environ['TF_CONFIG'])['task']"
              f"['index']; dies = i == 1 and not os.path.exists({str(died)!r});"
              f"dies and open({str(died)!r}, 'w').close(); time.sleep(0.2);"
              "sys.exit(9) if dies else time.sleep(600)")
    chief = (f"import os, time, sys; f = open({str(runs)!r}, 'a'); f.write('run\\n'); f.close();"
             f"n = open({str(runs)!r}).read().count('run');"
             f"[time.sleep(0.05) for _ in range(200) if not os.path.exists({str(died)!r})];"
             "time.sleep(1.0); print('run', n, flush=True); sys.exit(1 if n == 1 else 0)")
    start = time.monotonic()
    code, lines, launcher = _launch_coordinator(chief, server, max_restarts=1,
                                                report_seconds=30, grace_seconds=1)
    assert code == 0, lines
    assert time.monotonic() - start < 30
    assert lines.index("[launcher] worker:1 exited with code 9: waiting up to 30s for the "
                       "chief to stop") < lines.index("[chief:0] run 1"), lines
    assert ("[launcher] chief:0 exited with code 1: restarting the job (restart 1 of 1); it "
            "resumes from its last backup") in lines
    assert "[chief:0] run 2" in lines
    assert launcher.job_restarts == 1
    assert sorted(t.name for t in launcher.replaced) == ["chief:0", "worker:0", "worker:1"]
    # Without restarts left, the chief's code ends the run.
    runs.unlink()
    died.unlink()
    code, lines, _ = _launch_coordinator(chief, server, report_seconds=30, grace_seconds=1)
    assert code == 1 and lines[-1] == "[launcher] chief:0 exited with code 1: stopping all tasks"


def test_coordinator_is_refused_under_slurm():
    from tfpar.cluster import slurm

    with pytest.raises(slurm.SlurmError, match="--coordinator is not supported with --slurm"):
        slurm.check_flags(["coordinator"])


# --- Bad input: clear errors, no cluster ------------------------------------------------

def test_the_pipeline_cluster_needs_workers_and_runs_on_the_chief():
    with pytest.raises(TFConfigError, match=r"A pipeline across workers needs a cluster, but "
                                            r"TF_CONFIG is not set\. Start the program with "
                                            r"`tfpar launch --workers N --coordinator"):
        check_pipeline_cluster(None)
    with pytest.raises(TFConfigError, match="needs at least one 'worker' task"):
        check_pipeline_cluster(ClusterConfig({"chief": ("127.0.0.1:1",)}, "chief", 0))
    config = ClusterConfig(make_cluster(2, coordinator=True), "worker", 1)
    with pytest.raises(TFConfigError, match=r"This process is worker:1, but a pipeline across "
                                            r"workers runs the program on the chief only"):
        check_pipeline_cluster(config)
    check_pipeline_cluster(ClusterConfig(make_cluster(2, coordinator=True), "chief", 0))
    check_pipeline_cluster(ClusterConfig(make_cluster(2)))  # Joins as the chief.


def test_unreachable_workers_fail_within_the_timeout():
    import tensorflow as tf

    import tfpar

    cluster = make_cluster(2, coordinator=True)  # Nothing listens on these ports.
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({job: list(a) for job, a in cluster.items()}), task_type="chief",
        task_id=0, rpc_layer="grpc")
    start = time.monotonic()
    with pytest.raises(tfpar.errors.ClusterError,
                       match=r"Cannot reach worker:0 \(127\.0\.0\.1:\d+\), worker:1 "
                             r"\(127\.0\.0\.1:\d+\) after 0\.5s\. Start `python -m "
                             r"tfpar\.cluster\.server` for each worker task"):
        tfpar.PipelineStrategy(cluster_resolver=resolver, connect_timeout_seconds=0.5)
    assert time.monotonic() - start < 10
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({job: list(a) for job, a in cluster.items()}), task_type="worker",
        task_id=0, rpc_layer="grpc")
    with pytest.raises(TFConfigError, match="This process is worker:0"):
        tfpar.PipelineStrategy(cluster_resolver=resolver)
    with pytest.raises(ValueError, match="connect_timeout_seconds must be a number > 0"):
        tfpar.PipelineStrategy(cluster_resolver=resolver, connect_timeout_seconds=0)


def test_another_tasks_device_needs_a_connection():
    from tfpar.devices import resolve_devices
    from tfpar.errors import DeviceError

    with pytest.raises(DeviceError, match=r"'/job:worker/task:1/device:CPU:0' is not a device of "
                                          r"this process or of a cluster it is connected to"):
        resolve_devices(["/cpu:0", "/job:worker/task:1/device:CPU:0"])


def test_a_lost_stage_worker_is_named_and_other_errors_are_left_alone():
    import tensorflow as tf

    from tfpar.distribute.pipeline.workers import StageWorkers

    [dead] = free_ports(1)  # Nothing listens there: the worker is gone.
    workers = StageWorkers({"/job:worker/replica:0/task:1": f"127.0.0.1:{dead}"})
    stages = ["/cpu:0", WORKER.format(1)]
    error = workers.explain(tf.errors.UnavailableError(None, None, "Socket closed"), stages)
    assert str(error).startswith(
        f"tfpar.PipelineStrategy lost a stage worker: worker:1 (127.0.0.1:{dead}), which held "
        f"stage 1 on {WORKER.format(1)}, stopped accepting connections (the process is gone).")
    assert str(error).endswith("TensorFlow said: UnavailableError: Socket closed")
    # Listening again: a restarted worker is lost too, but a failure of the model itself
    # is not a lost worker, and a pipeline in this process has no worker to lose.
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        workers = StageWorkers({"/job:worker/replica:0/task:1": f"127.0.0.1:{port}"})
        restarted = tf.errors.AbortedError(None, None, "Unable to find a context_id matching "
                                                       "the specified one (1).")
        assert (f"worker:1 (127.0.0.1:{port}), which held stage 1 on {WORKER.format(1)}, was "
                f"restarted or lost its connection to this process." in str(
                    workers.explain(restarted, stages)))
        bad = tf.errors.InvalidArgumentError(None, None, "Incompatible shapes: [4,3] vs. [4,2]")
        assert workers.explain(bad, stages) is None
    assert workers.explain(ValueError("bad shape"), stages) is None
    lost = tf.errors.UnavailableError(None, None, "Socket closed")
    assert workers.explain(lost, ["/cpu:0", "/cpu:1"]) is None


def test_answers_tells_a_serving_task_from_a_silent_one_and_a_gone_one():
    import threading

    from tfpar.cluster.probe import answers

    def http2_server(server):  # Sends a SETTINGS frame, as every gRPC server does first.
        connection, _ = server.accept()
        with connection:
            connection.recv(24)
            connection.sendall(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))

    with socket.create_server(("127.0.0.1", 0)) as serving, \
            socket.create_server(("127.0.0.1", 0)) as stopped:
        threading.Thread(target=http2_server, args=(serving,), daemon=True).start()
        assert answers(f"127.0.0.1:{serving.getsockname()[1]}", 5.0) == "answers"
        # A stopped process's kernel still accepts the connection; nothing answers.
        start = time.monotonic()
        assert answers(f"127.0.0.1:{stopped.getsockname()[1]}", 0.3) == "silent"
        assert 0.25 < time.monotonic() - start < 3
    [gone] = free_ports(1)
    assert answers(f"127.0.0.1:{gone}", 5.0) == "refuses"


def test_a_task_silent_for_the_timeout_gets_its_name_printed_and_the_process_ended():
    import io
    import threading

    from tfpar.cluster import silence_watch

    tasks = [["worker:0", "127.0.0.1:1000", "stage 0 of the pipeline on /cpu:0"],
             ["worker:1", "127.0.0.1:1001", "stage 1 of the pipeline on /cpu:1"]]
    silent = {"127.0.0.1:1000": "answers", "127.0.0.1:1001": "silent"}

    def watch(states, commands, timeout_seconds=0.4, end_after=None):
        """Runs the watch on a sleeping child; returns (what it returned, the child's exit
        code or None if it still runs, the printed text, seconds)."""
        child = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
        read, write = os.pipe()
        os.write(write, "".join(f"{c}\n" for c in commands).encode())
        if end_after is not None:
            threading.Timer(end_after, os.close, args=(write,)).start()
        out, start = io.StringIO(), time.monotonic()
        try:
            got = silence_watch.watch(child.pid, timeout_seconds, tasks, commands_fd=read,
                                      probe=lambda address, t: states[address], out=out)
            took = time.monotonic() - start
            code = child.wait(timeout=10) if got is not None else child.poll()
        finally:
            child.kill()
            child.wait()
            os.close(read)
            if end_after is None:
                os.close(write)
        return got, code, out.getvalue(), took

    got, code, text, took = watch(silent, ["watch"])
    assert (got, code) == ("worker:1", -signal.SIGTERM)
    assert 0.4 <= took < 5
    assert text.startswith("tfpar: worker:1 (127.0.0.1:1001), which holds stage 1 of the "
                           "pipeline on /cpu:1, has not answered for ")
    assert "BackupAndRestore" in text and "stage_timeout_seconds" in text
    # Not while idle; not for tasks that answer, or refuse (gone: TensorFlow names those).
    for states, commands in [(silent, ["watch", "idle"]),
                             ({a: "answers" for a in silent}, ["watch"]),
                             ({a: "refuses" for a in silent}, ["watch"])]:
        assert watch(states, commands, 0.2, end_after=1.5)[:3] == (None, None, ""), states


def test_stage_timeout_must_be_positive_or_none():
    import tfpar

    with pytest.raises(ValueError, match="stage_timeout_seconds must be a number of seconds"):
        tfpar.PipelineStrategy(["/cpu:0", "/cpu:1"], stage_timeout_seconds=0)


def test_trace_takes_a_profiler_for_each_worker_that_holds_a_stage_and_no_other():
    from tfpar.distribute.pipeline.workers import StageWorkers

    workers = StageWorkers({"/job:worker/replica:0/task:1": "127.0.0.1:1"})
    stages = ["/cpu:0", WORKER.format(1), WORKER.format(2)]
    assert workers.profiler_addresses(stages, {"worker:2": "h:2", "/job:worker/task:1": "h:1"}) \
        == ["h:1", "h:2"]
    with pytest.raises(ValueError, match=r"worker:2 \(stages \[2\]\) has none given\. .*"
                                         r"profilers=\{'worker:2': 'host:P'\}"):
        workers.profiler_addresses(stages, {"worker:1": "h:1"})
    with pytest.raises(ValueError, match=r"profilers names worker:0, which hold no stage of this "
                                         r"pipeline; stages on other tasks: worker:1, worker:2"):
        workers.profiler_addresses(stages, {"worker:0": "h", "worker:1": "h", "worker:2": "h"})
    with pytest.raises(ValueError, match=r"named like 'worker:1'. Received: 'worker'"):
        workers.profiler_addresses(stages, {"worker": "h"})


def _run_on_a_chief(probe, server_flags, *args):
    """Runs the Python code `probe` (with `args`) as the chief of a one-worker cluster
    whose worker serves (`tfpar.cluster.server` with `server_flags`, its pid the probe's first
    argument); returns the probe's last line of output."""
    cluster = make_cluster(1, coordinator=True)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    lines = []
    worker = Task(ClusterConfig(cluster, "worker", 0), [PY, "-m", "tfpar.cluster.server", *server_flags],
                  env, lines.append)
    try:
        chief = subprocess.run(
            [PY, "-c", probe, str(worker.process.pid), *map(str, args)], capture_output=True,
            text=True, timeout=120,
            env=dict(env, TF_CONFIG=ClusterConfig(cluster, "chief", 0).to_json()))
        assert chief.returncode == 0, chief.stderr[-3000:] + "\n".join(lines)
        return chief.stdout.splitlines()[-1]
    finally:
        worker.signal(signal.SIGKILL)
        worker.process.wait(10)


_CORES_PROBE = """
import json, os, sys, time
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)  # Reaches the worker's contexts.
resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
tf.config.experimental_connect_to_cluster(resolver.cluster_spec(), job_name="chief")
def cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
with tf.device("/job:worker/replica:0/task:0/device:CPU:0"):
    a, b = tf.random.normal([2048, 2048]), tf.random.normal([2048, 2048])
@tf.function
def two_products():  # Independent: run at once if the worker may run two ops at a time.
    with tf.device("/job:worker/replica:0/task:0/device:CPU:0"):
        return tf.reduce_sum(tf.matmul(a, b)) + tf.reduce_sum(tf.matmul(b, a))
two_products()
before, start = cpu(int(sys.argv[1])), time.perf_counter()
for _ in range(8):
    two_products().numpy()
print(json.dumps({"cores": (cpu(int(sys.argv[1])) - before) / (time.perf_counter() - start)}))
"""


@pytest.mark.slow
def test_a_worker_with_one_thread_per_op_and_a_chief_running_one_op_at_a_time_uses_one_core():
    """`tfpar.cluster.server --intra_op_threads=1` and the chief's inter-op setting, which reaches the
    contexts it opens on the workers (the pipeline benchmark relies on it), keep a worker on
    one core: its CPU time over wall time, from /proc (1.9 without the chief's setting)."""
    line = _run_on_a_chief(_CORES_PROBE, ["--intra_op_threads=1"])
    assert 0.5 < json.loads(line)["cores"] < 1.2, line


_TRACE_PROBE = """
import json, sys
import keras, numpy as np, tensorflow as tf
import tfpar
tf.config.threading.set_inter_op_parallelism_threads(2)  # (Sends go out at once.)
strategy = tfpar.PipelineStrategy(
    ["/job:chief/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:0/device:CPU:0"],
    num_micro_batches=2, schedule="1f1b",
    cluster_resolver=tf.distribute.cluster_resolver.TFConfigClusterResolver())
with strategy.scope():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="tanh"),
                              keras.layers.Dense(256, activation="tanh"), keras.layers.Dense(3)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x, y = np.random.rand(512, 64).astype("float32"), np.random.randint(0, 3, 512)
out = {}
try:
    strategy.trace(sys.argv[3] + "/step.json", model, x, y)
except ValueError as error:
    out["error"] = str(error)
events = strategy.trace(sys.argv[3] + "/step.json", model, x, y,
                        profilers={"worker:0": f"127.0.0.1:{sys.argv[2]}"})
out["spans"] = [(e["name"], e["tid"], e["ts"], e["dur"]) for e in events if e["ph"] == "X"]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_trace_records_a_stage_on_a_worker_through_its_profiler(tmp_path):
    """A pipeline with stage 0 on the chief and stage 1 on a worker served with
    `tfpar.cluster.server --profiler_port=P`: trace() records both (the worker's ops through its
    profiler), each in schedule order, on one clock: a forward starts only after the one that
    sent its input ended, across the processes. Without the worker's profiler, trace() says
    what to pass."""
    [port] = free_ports(1)
    out = json.loads(_run_on_a_chief(_TRACE_PROBE, [f"--profiler_port={port}"], port, tmp_path))
    assert ("worker:0 (stages [1]) has none given. Serve each worker with `python -m "
            "tfpar.cluster.server --profiler_port=P` and pass profilers={'worker:0': 'host:P'}"
            in out["error"]), out["error"]
    spans = {name: (row, start, start + length) for name, row, start, length in out["spans"]}
    rows = [sorted((n for n, (r, _, _) in spans.items() if r == row), key=lambda n: spans[n][1])
            for row in (0, 1)]
    assert rows == [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]], spans
    # (Microseconds.) A forward's activation is its last op; a backward sends the input
    # gradient while its weight gradients may still run.
    for sender, receiver in [("0F0", "1F0"), ("0F1", "1F1")]:
        assert spans[receiver][1] >= spans[sender][2] - 1, (sender, receiver, out["spans"])
    for sender, receiver in [("1B0", "0B0"), ("1B1", "0B1")]:
        assert spans[receiver][1] > spans[sender][1], (sender, receiver, out["spans"])


@pytest.mark.slow
@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_a_checkpoint_of_stages_on_workers_is_written_by_each_worker_and_loads_on_one_device(
        tmp_path, tensor_parallel):
    """`tf.train.Checkpoint(model=..., optimizer=...).write` from the chief of a 2-stage
    pipeline over 2 worker processes, or of one stage split over them (T=2): TensorFlow shards
    the save by host, so each worker writes its own stage's (its shards') weights and Adam
    slots (its bytes of variables, within 1%), at the same time as the other, and the chief
    writes only the index (nothing gathered, nothing written twice); a plain Keras model on
    one device reads it back exactly (a split variable is saved whole, as its shards'
    slices; issue 36 item 4), and a fresh pipeline restores it, weights and Adam's state,
    each worker reading its own share (split: each shard from its own slice;
    `result["difference"]` covers the fresh model too)."""
    out = tmp_path / "out"
    out.mkdir()
    run = subprocess.run([PY, "-m", "tfpar.cli.launch", "--workers=2", "--coordinator",
                          "--timeout=200", "--", PY,
                          os.path.join(HERE, "workers", "pipeline_checkpoint.py"),
                          f"--out={out}", f"--tensor_parallel={tensor_parallel}"],
                         capture_output=True, text=True, timeout=260,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert run.returncode == 0, run.stdout[-4000:]
    result = json.loads((out / "result.json").read_text())
    assert result["difference"] == 0.0 and result["moved"] > 1e-3, result
    stages = sorted(result["stage_bytes"].items())  # By device: task 0, then task 1.
    assert len(stages) == 2, stages
    for index, (device, held) in enumerate(stages):
        assert f"/task:{index}/" in device
        assert held <= result["written"][f"worker:{index}"] <= 1.01 * held, result
    assert result["written"]["chief:0"] < 0.01 * sum(held for _, held in stages), result
    assert len(list(out.glob("ckpt.data-*"))) == 3  # A shard per host, the chief's too.
    # Restored into a fresh model: each worker reads its own share from disk (at least the
    # bytes it keeps: nothing reaches it through the chief, which reads under 5%).
    # TensorFlow's RestoreV2 looks tensors up in name order through a 1 MiB buffer: a
    # pipeline's file is in that order, read once (5%); a split model's slices are not, and
    # each seek back refills the buffer (measured 1.41x and 1.24x), but never a whole other
    # share (2x and more).
    reread = 1.05 if tensor_parallel == 1 else 1.5
    for index, (device, held) in enumerate(stages):
        if tensor_parallel > 1:
            held = result["held"][device]
        assert held <= result["read"][f"worker:{index}"] <= reread * held + 2 ** 20, result
    assert result["read"]["chief:0"] < 0.05 * sum(held for _, held in stages), result


@pytest.mark.slow
def test_tensor_parallel_replicas_with_zero_3_run_replicated_across_worker_processes(hybrids):
    """R=2 replicas x T=2 over four worker processes, shard='parameters': each weight (each
    shard of a split one) lives on one owner, and each replica's two devices still run the
    stage replicated, summing by peer all-reduces on every worker (before session 30 ZeRO-3
    summed on each replica's first device)."""
    result = hybrids["tp_zero3"]
    assert result["difference"] < 1e-5, result
    assert result["tensor_communication"] == [["all_reduce"]] * 2, result
    reductions = result["tensor_reductions"]
    assert sorted(_task(d) for d in reductions) == [0, 1, 2, 3], reductions
    assert all(set(t) == {"CollectiveReduceV2"} for t in reductions.values()), reductions
    for path, devices in result["weights"].items():
        split = re.search(r"mlp_(in_\d/(kernel|bias)|out_\d/kernel)$", path)
        # A split weight: one owner per shard (shard t on task t or t + 2); else one owner.
        assert len(devices) == (2 if split else 1), (path, devices)
