"""The local cluster launcher: TF_CONFIG per task, prefixes, failure propagation, cleanup."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tfpar.cluster import parse_tf_config
from tfpar.cluster.launcher import Launcher, free_ports, make_cluster

PY = sys.executable


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def _launch(tmp_path, code, workers=2, ps=0, server="import time; time.sleep(600)", **kwargs):
    lines = []
    launcher = Launcher([PY, "-c", code], workers, ps, output=lines.append,
                        server_command=[PY, "-c", server], **kwargs)
    return launcher.run(), lines, launcher


def test_free_ports_are_distinct():
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(1024 < p < 65536 for p in ports)


def test_make_cluster():
    cluster = make_cluster(2, 1)
    assert [(job, len(a)) for job, a in cluster.items()] == [("chief", 1), ("worker", 2), ("ps", 1)]
    assert all(a.startswith("127.0.0.1:") for addresses in cluster.values() for a in addresses)
    assert list(make_cluster(3)) == ["worker"]
    with pytest.raises(ValueError, match="--workers must be an integer >= 1"):
        make_cluster(0)


def test_each_task_gets_its_tf_config_and_prefixed_output(tmp_path):
    code = ("import os, json; c = json.loads(os.environ['TF_CONFIG']);"
            "print(json.dumps(c))")
    exit_code, lines, launcher = _launch(tmp_path, code, workers=3)
    assert exit_code == 0
    by_task = {}
    for line in lines:
        prefix, _, rest = line.partition(" ")
        by_task[prefix] = parse_tf_config(rest)
    assert sorted(by_task) == ["[worker:0]", "[worker:1]", "[worker:2]"]
    for name, config in by_task.items():
        assert name == f"[{config.task_name}]"
        assert config.cluster == launcher.cluster


def test_with_ps_the_chief_runs_the_command_and_servers_are_stopped(tmp_path):
    code = "import os, json; print(json.loads(os.environ['TF_CONFIG'])['task']['type'])"
    exit_code, lines, launcher = _launch(tmp_path, code, workers=2, ps=1)
    assert exit_code == 0
    assert lines == ["[chief:0] chief"]
    assert all(t.process.poll() is not None for t in launcher.tasks)  # servers stopped


def test_a_failing_task_stops_all_and_its_code_is_returned(tmp_path):
    pid_file = tmp_path / "pids"
    code = ("import os, json, sys, time, subprocess;"
            "i = json.loads(os.environ['TF_CONFIG'])['task']['index'];"
            # every task starts a grandchild: it must be cleaned up too
            f"p = subprocess.Popen([{PY!r}, '-c', 'import time; time.sleep(600)']);"
            f"open({str(pid_file)!r}, 'a').write(f'{{os.getpid()}} {{p.pid}}\\n');"
            "print('started', flush=True); time.sleep(1.0);"
            "sys.exit(7) if i == 1 else time.sleep(600)")
    start = time.monotonic()
    exit_code, lines, _ = _launch(tmp_path, code, workers=3, grace_seconds=2)
    assert exit_code == 7
    assert time.monotonic() - start < 30
    assert "[launcher] worker:1 exited with code 7: stopping all tasks" in lines
    pids = [int(p) for line in pid_file.read_text().split("\n") if line for p in line.split()]
    assert len(pids) == 6
    time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], "processes left behind"


def test_after_a_ps_dies_the_chief_gets_time_to_explain(tmp_path):
    # Servers (workers and the ps here) exit with code 3 after half a second.
    dying_server = "import time, sys; time.sleep(0.5); sys.exit(3)"
    chief = "import time; time.sleep(2); print('lost ps:0, resume from the checkpoint'); exit(5)"
    start = time.monotonic()
    exit_code, lines, launcher = _launch(tmp_path, chief, workers=1, ps=1, server=dying_server,
                                         report_seconds=30)
    assert exit_code == 5, lines
    assert time.monotonic() - start < 20
    assert lines[0] == "[launcher] ps:0 exited with code 3: waiting up to 30s for the chief to stop"
    assert "[chief:0] lost ps:0, resume from the checkpoint" in lines
    assert lines[-1] == "[launcher] chief:0 exited with code 5: stopping all tasks"
    # A chief that says nothing is stopped once its time is up; the ps's code is returned.
    exit_code, lines, launcher = _launch(tmp_path, "import time; time.sleep(600)", workers=1, ps=1,
                                         server=dying_server, report_seconds=1, grace_seconds=2)
    assert exit_code == 3, lines
    assert lines[-1] == ("[launcher] the chief still runs 1s after ps:0 exited: "
                         "stopping all tasks")
    assert all(t.process.poll() is not None for t in launcher.tasks)


@pytest.mark.slow
def test_ctrl_c_stops_everything():
    code = ("import os, time; open(os.environ['PID_FILE'], 'a').write(f'{os.getpid()}\\n');"
            "time.sleep(600)")
    pid_file = f"/tmp/tfpar-launch-test-{os.getpid()}"
    env = dict(os.environ, PID_FILE=pid_file)
    launcher = subprocess.Popen([PY, "-m", "tfpar.launch", "--workers=2", "--", PY, "-c", code],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if os.path.exists(pid_file) and len(open(pid_file).read().split()) == 2:
                break
            time.sleep(0.1)
        pids = [int(p) for p in open(pid_file).read().split()]
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=30) == 128 + signal.SIGINT
        time.sleep(0.2)
        assert not [p for p in pids if _alive(p)]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if os.path.exists(pid_file):
            os.remove(pid_file)


def test_launch_without_command_is_an_error():
    result = subprocess.run([PY, "-m", "tfpar.launch", "--workers=2"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert "No command to launch" in result.stderr
