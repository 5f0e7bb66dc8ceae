"""`tfpar launch --slurm`: TF_CONFIG from SlurmClusterResolver in a faked Slurm step on 127.0.0.1.

TensorFlow 2.21's SlurmClusterResolver expands SLURM_STEP_NODELIST itself (it does not run
`scontrol show hostnames`), so the fake step names nodes directly; GPUs are faked with
CUDA_VISIBLE_DEVICES, a fake `nvidia-smi` on PATH, or the --slurm_gpus_per_* values.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from cluster_helper import alive
from tfpar.cluster import parse_tf_config
from tfpar.cluster import slurm
from tfpar.cluster.slurm import SlurmError

PY = sys.executable
HERE = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
FIT_WORKER = os.path.join(HERE, "workers", "fit.py")


def _step(rank, num_tasks, nodelist, tasks_per_node, node=None, local_id=None):
    """The variables srun sets for task `rank` of a step (those the launcher reads)."""
    env = {"SLURM_JOB_ID": "42", "SLURM_PROCID": str(rank),
           "SLURM_STEP_NUM_TASKS": str(num_tasks), "SLURM_STEP_NODELIST": nodelist,
           "SLURM_STEP_TASKS_PER_NODE": tasks_per_node}
    if node is not None:
        env.update(SLURMD_NODENAME=node, SLURM_LOCALID=str(local_id))
    return env


@pytest.fixture
def fake_bin(tmp_path):
    path = tmp_path / "bin"
    path.mkdir()
    return path


@pytest.fixture
def in_step(monkeypatch, fake_bin):
    """Makes this process a task of a faked Slurm step: in_step(**_step(...))."""
    for name in list(os.environ):
        if name.startswith("SLURM") or name == "CUDA_VISIBLE_DEVICES":
            monkeypatch.delenv(name)
    monkeypatch.setenv("PATH", str(fake_bin))  # No nvidia-smi unless a test writes one.

    def enter(**env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    return enter


def _fake_nvidia_smi(fake_bin, gpus):
    script = fake_bin / "nvidia-smi"
    lines = "\\n".join(f"GPU {i}: Fake GPU (UUID: GPU-{i})" for i in range(gpus))
    script.write_text(f"#!/bin/sh\nprintf '{lines}\\n'\n")
    script.chmod(0o755)


# --- Unit: the TF_CONFIG and GPUs of each task ------------------------------------------

def test_importing_the_launcher_does_not_import_tensorflow():
    code = ("import sys, tfpar.cli.launch, tfpar.cluster.slurm;"
            "assert 'tensorflow' not in sys.modules, 'tensorflow imported'")
    subprocess.run([PY, "-c", code], check=True, timeout=60)


TWO_NODES = [f"node{n}:{p}" for n in (1, 2) for p in (8888, 8889)]


@pytest.mark.parametrize("nodelist, tasks_per_node, port_base, nodes, workers", [
    # Two nodes with two tasks each (one task per GPU, say): ports count per node.
    ("node[1-2]", "2(x2)", 8888, ["node1"] * 2 + ["node2"] * 2, TWO_NODES),
    # One task per node on three nodes, another port base.
    ("gpu-a,gpu-b,gpu-c", "1(x3)", 9100, ["gpu-a", "gpu-b", "gpu-c"],
     ["gpu-a:9100", "gpu-b:9100", "gpu-c:9100"]),
    # The test cluster: one node, 127.0.0.1, two tasks.
    ("127.0.0.1", "2", 8888, ["127.0.0.1"] * 2, ["127.0.0.1:8888", "127.0.0.1:8889"]),
])
def test_each_slurm_task_gets_its_tf_config(in_step, nodelist, tasks_per_node, port_base,
                                           nodes, workers):
    for rank, node in enumerate(nodes):
        local_id = nodes[:rank].count(node)
        in_step(**_step(rank, len(nodes), nodelist, tasks_per_node, node, local_id))
        task = slurm.resolve(port_base=port_base)
        config = parse_tf_config(task.config.to_json())
        assert config.cluster == {"worker": tuple(workers)}
        assert (config.task_type, config.task_index) == ("worker", rank)
        assert config.is_chief == (rank == 0)
        assert (task.rank, task.num_tasks) == (rank, len(nodes))
        assert task.cuda_visible_devices is None  # No GPUs here: CUDA_VISIBLE_DEVICES untouched.
        assert "CUDA_VISIBLE_DEVICES" not in os.environ


def _gpus_of_every_task(in_step, nodelist="node[1-2]", tasks_per_node="2(x2)", num_tasks=4,
                        **kwargs):
    gpus = []
    for rank in range(num_tasks):
        in_step(**_step(rank, num_tasks, nodelist, tasks_per_node))
        gpus.append(slurm.resolve(**kwargs).cuda_visible_devices)
    return gpus


def test_several_gpus_per_node_are_shared_among_its_tasks(in_step, fake_bin, monkeypatch):
    # Given: 4 GPUs per node, 2 tasks per node: 2 each, counted from 0 on each node.
    assert _gpus_of_every_task(in_step, gpus_per_node=4) == ["0,1", "2,3", "0,1", "2,3"]
    assert _gpus_of_every_task(in_step, gpus_per_node=4, gpus_per_task=1) == ["0", "1"] * 2
    # Counted by nvidia-smi, as the resolver does when CUDA_VISIBLE_DEVICES is not set.
    _fake_nvidia_smi(fake_bin, 4)
    assert _gpus_of_every_task(in_step) == ["0,1", "2,3", "0,1", "2,3"]
    assert _gpus_of_every_task(in_step, "node[1-4]", "1(x4)") == ["0,1,2,3"] * 4
    # Slurm gave the job GPUs 4-7 of each node: the tasks get those, not 0-3.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert _gpus_of_every_task(in_step) == ["4,5", "6,7", "4,5", "6,7"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"  # The launcher's own is kept.
    # 0: no assignment (Slurm binds GPUs to tasks itself, e.g. srun --gpus-per-task).
    assert _gpus_of_every_task(in_step, gpus_per_node=0) == [None] * 4


def test_gpus_that_do_not_go_round_are_refused(in_step, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # One GPU, two tasks per node.
    with pytest.raises(SlurmError, match=r"1 GPU\(s\) per node is fewer than the tasks on a "
                                         r"node.*--slurm_gpus_per_node=0"):
        _gpus_of_every_task(in_step)
    with pytest.raises(SlurmError, match="Requested more GPUs per node than available"):
        _gpus_of_every_task(in_step, gpus_per_node=4, gpus_per_task=3)
    with pytest.raises(SlurmError, match="sees only CUDA_VISIBLE_DEVICES=0"):
        _gpus_of_every_task(in_step, gpus_per_node=4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(SlurmError, match="--slurm_gpus_per_task=1, but there are no GPUs"):
        _gpus_of_every_task(in_step, gpus_per_task=1)


def test_missing_slurm_variables_are_named():
    with pytest.raises(SlurmError, match=r"SLURM_PROCID, SLURM_STEP_NUM_TASKS, "
                                         r"SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE, which "
                                         r"are not set: this is not a Slurm task. Start it with "
                                         r"srun"):
        slurm.check_environment({})
    # In an sbatch script, outside srun: the job is there, the step is not.
    with pytest.raises(SlurmError, match=r"variable\(s\) SLURM_PROCID, .* in Slurm job 7 but not "
                                         r"in a job step"):
        slurm.check_environment({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1"})
    step = _step(1, 2, "node[1-2]", "1(x2)")
    assert slurm.check_environment(step) == (1, 2)
    del step["SLURM_STEP_TASKS_PER_NODE"]
    with pytest.raises(SlurmError, match=r"variable\(s\) SLURM_STEP_TASKS_PER_NODE, which"):
        slurm.check_environment(step)
    with pytest.raises(SlurmError, match="SLURM_PROCID=2 is out of range"):
        slurm.check_environment(_step(2, 2, "node[1-2]", "1(x2)"))


def test_a_task_given_another_nodes_address_is_refused(in_step):
    # node9 and node10 sort as text to node10, node9: the resolver would give task 0 (on
    # node9) the address of node10, where task 1 runs.
    in_step(**_step(0, 2, "node[9-10]", "1(x2)", node="node9", local_id=0))
    with pytest.raises(SlurmError, match=r"gives this task \(worker:0, SLURM_PROCID=0\) the "
                                         r"address node10:8888, but Slurm runs it on node node9"):
        slurm.resolve()
    # Cyclic distribution: task 1 runs on node2 as its local task 0.
    in_step(**_step(1, 4, "node[1-2]", "2(x2)", node="node2", local_id=0))
    with pytest.raises(SlurmError, match="address node1:8889, but Slurm runs it on node node2"):
        slurm.resolve()


def test_workers_must_agree_with_the_slurm_task_count(in_step):
    in_step(**_step(0, 2, "127.0.0.1", "2"))
    with pytest.raises(SlurmError, match=r"--workers=3, but this Slurm step has 2 task\(s\)"):
        slurm.resolve(workers=3)
    assert slurm.resolve(workers=2).config.num_workers == 2


def _launch(args, env, timeout=60, **kwargs):
    """Runs `python -m tfpar.cli.launch *args` to the end; returns (exit code, stderr)."""
    process = subprocess.Popen([PY, "-m", "tfpar.cli.launch", *args], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               **kwargs)
    try:
        out, err = process.communicate(timeout=timeout)
        return process.returncode, out, err
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM") and k not in ("TF_CONFIG", "CUDA_VISIBLE_DEVICES")}
    return dict(env, TF_CPP_MIN_LOG_LEVEL="2", **extra)


def test_the_binary_fails_fast_outside_slurm_and_on_flags_that_do_not_apply():
    start = time.monotonic()
    code, _, err = _launch(["--slurm", "--", PY, "-c", "pass"], _clean_env())
    assert code == 2
    assert "--slurm needs the Slurm step variable(s) SLURM_PROCID" in err
    step = _clean_env(**_step(0, 2, "127.0.0.1", "2"))
    code, _, err = _launch(["--slurm", "--ps=1", "--", PY, "-c", "pass"], step)
    assert code == 2 and "--ps is not supported with --slurm" in err, err
    code, _, err = _launch(["--slurm", "--host=0.0.0.0", "--data_service", "--", "true"], step)
    assert code == 2 and "--host, --data_service: for the local launcher only" in err, err
    code, _, err = _launch(["--slurm", "--workers=3", "--", "true"], step)
    assert code == 2 and "--workers=3, but this Slurm step has 2 task(s)" in err, err
    code, _, err = _launch(["--slurm_port_base=9000", "--", "true"], _clean_env())
    assert code == 2 and "--slurm_port_base: for --slurm only" in err, err
    code, _, err = _launch(["--slurm"], step)
    assert code == 2 and "No command to launch" in err, err
    assert time.monotonic() - start < 30  # All before TensorFlow is imported.


# --- Real processes -------------------------------------------------------------------

def _consecutive_free_ports(count, host="127.0.0.1"):
    """A port p such that p .. p + count - 1 are free on `host` now."""
    for _ in range(100):
        with contextlib.ExitStack() as stack:
            first = stack.enter_context(socket.socket())
            first.bind((host, 0))
            base = first.getsockname()[1]
            if base + count > 65535:
                continue
            try:
                for port in range(base + 1, base + count):
                    stack.enter_context(socket.socket()).bind((host, port))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


@contextlib.contextmanager
def _launchers(steps, args, command, tmp_path):
    """Starts `tfpar launch --slurm *args -- command` once per environment in `steps`.

    Yields the processes; on the way out each launcher still running gets SIGTERM (which
    it forwards to its command), then SIGKILL (its command dies with it).
    """
    processes = []
    try:
        for i, env in enumerate(steps):
            with open(tmp_path / f"launcher-{i}.log", "w") as log:
                processes.append(subprocess.Popen(
                    [PY, "-m", "tfpar.cli.launch", "--slurm", "--grace_seconds=2", *args, "--",
                     *command], env=env, stdout=log, stderr=subprocess.STDOUT))
        yield processes
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _logs(tmp_path, count):
    return "\n".join((tmp_path / f"launcher-{i}.log").read_text()[-3000:] for i in range(count))


def _wait(processes, timeout):
    deadline = time.monotonic() + timeout
    return [p.wait(max(0.1, deadline - time.monotonic())) for p in processes]


@pytest.mark.slow
def test_two_slurm_tasks_train_one_model(tmp_path, fake_bin):
    base = _consecutive_free_ports(2)
    steps = [_clean_env(PATH=str(fake_bin), **_step(rank, 2, "127.0.0.1", "2", "127.0.0.1", rank))
             for rank in (0, 1)]
    out = tmp_path / "out"
    out.mkdir()
    command = [PY, FIT_WORKER, f"--out={out}", "--epochs=2", "--examples=64"]
    start = time.monotonic()
    with _launchers(steps, [f"--slurm_port_base={base}"], command, tmp_path) as processes:
        assert _wait(processes, timeout=120) == [0, 0], _logs(tmp_path, 2)
    elapsed = time.monotonic() - start
    logs = _logs(tmp_path, 2)
    for rank in (0, 1):
        assert f"Slurm task {rank} of 2 is worker:{rank} at 127.0.0.1:{base + rank}" in logs
        result = json.loads((out / f"worker-{rank}.json").read_text())
        # One cluster of two workers, not two lone processes training the same model.
        assert result["strategy"].startswith("DataParallelStrategy(workers=2, replicas=2"), result
        assert result["iterations"] == 2 * 64 // 16
    weights = [list(np.load(out / f"worker-{rank}.npz").values()) for rank in (0, 1)]
    assert len(weights[0]) == 4
    for w0, w1 in zip(*weights):
        np.testing.assert_allclose(w0, w1, atol=1e-6)
    assert elapsed < 90, elapsed


def _one_task(tmp_path, fake_bin):
    return [_clean_env(PATH=str(fake_bin), **_step(0, 1, "127.0.0.1", "1"))]


@pytest.mark.slow
def test_the_commands_exit_code_is_returned(tmp_path, fake_bin):
    check_env = ("import os, sys, json;"
                 "c = json.loads(os.environ['TF_CONFIG']);"
                 "assert c['task'] == {'type': 'worker', 'index': 0}, c;"
                 "assert os.environ['PYTHONUNBUFFERED'] == '1';"
                 "sys.exit(7)")
    with _launchers(_one_task(tmp_path, fake_bin), [], [PY, "-c", check_env],
                    tmp_path) as processes:
        assert _wait(processes, timeout=60) == [7], _logs(tmp_path, 1)
    killed = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    with _launchers(_one_task(tmp_path, fake_bin), [], [PY, "-c", killed],
                    tmp_path) as processes:
        assert _wait(processes, timeout=60) == [128 + signal.SIGKILL], _logs(tmp_path, 1)


def _wait_for_file(path, process, timeout=60):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None and time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)
    return int(path.read_text().split()[0])


@pytest.mark.slow
def test_sigterm_is_forwarded_to_the_command(tmp_path, fake_bin):
    ready, got = tmp_path / "ready", tmp_path / "got"
    # The command runs in its own session: only the launcher can pass the signal on.
    command = [PY, "-c", (
        "import os, signal, sys, time\n"
        "def on_term(signum, frame):\n"
        f"    open({str(got)!r}, 'w').write(str(signum)); sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        f"open({str(ready)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(600)\n")]
    with _launchers(_one_task(tmp_path, fake_bin), [], command, tmp_path) as (launcher,):
        _wait_for_file(ready, launcher)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(30) == 3, _logs(tmp_path, 1)
    assert got.read_text() == str(int(signal.SIGTERM))
    # A command that ignores it is killed --grace_seconds (2) later.
    ready.unlink()
    ignoring = [PY, "-c", (
        "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        f"open({str(ready)!r}, 'w').write(str(os.getpid())); time.sleep(600)")]
    with _launchers(_one_task(tmp_path, fake_bin), [], ignoring, tmp_path) as (launcher,):
        pid = _wait_for_file(ready, launcher)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(30) == 128 + signal.SIGKILL, _logs(tmp_path, 1)
        assert not alive(pid)
        assert "still runs 2s after the signal: killing it" in _logs(tmp_path, 1)


@pytest.mark.slow
def test_the_command_dies_with_the_launcher(tmp_path, fake_bin):
    ready = tmp_path / "ready"
    command = [PY, "-c", f"import os, time; open({str(ready)!r}, 'w').write(str(os.getpid()));"
                         "time.sleep(600)"]
    pid = None
    try:
        with _launchers(_one_task(tmp_path, fake_bin), [], command, tmp_path) as (launcher,):
            pid = _wait_for_file(ready, launcher)
            launcher.kill()
            launcher.wait(10)
            deadline = time.monotonic() + 10
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not alive(pid), "the command outlived its launcher"
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
