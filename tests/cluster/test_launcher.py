"""The local cluster launcher: TF_CONFIG per task, prefixes, failure propagation, cleanup."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from cluster_helper import alive, stop_launcher
from tfpar.cluster import parse_tf_config
from tfpar.cluster.launcher import Launcher, free_ports, make_cluster

PY = sys.executable


def _launch(tmp_path, code, workers=2, ps=0, server="import time; time.sleep(600)", **kwargs):
    lines = []
    launcher = Launcher([PY, "-c", code], workers, ps, output=lines.append,
                        server_command=[PY, "-c", server], **kwargs)
    return launcher.run(), lines, launcher


def test_free_ports_are_distinct():
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(1024 < p < 65536 for p in ports)


@pytest.mark.slow
def test_cluster_ports_are_held_from_the_start_and_a_tf_server_still_binds_them(tmp_path):
    """free_ports closed its probe sockets, so any program could take a task's port before
    the task's server bound it ("Could not start gRPC server"). The launcher now holds
    every port for the whole run; only the task's TensorFlow server can bind it."""
    import socket

    code = ("import json, os, tensorflow as tf; c = json.loads(os.environ['TF_CONFIG']);"
            "s = tf.distribute.Server(tf.train.ClusterSpec(c['cluster']), job_name='worker',"
            " task_index=c['task']['index'], start=True); print('SERVING', s.target)")
    lines = []
    launcher = Launcher([PY, "-c", code], 1, output=lines.append)
    for address in launcher.cluster["worker"]:
        intruder = socket.socket()
        with pytest.raises(OSError, match="Address already in use"):
            intruder.bind(("127.0.0.1", int(address.rsplit(":", 1)[1])))
        intruder.close()
    assert launcher.run() == 0, lines
    assert f"[worker:0] SERVING grpc://{launcher.cluster['worker'][0]}" in lines, lines


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
    assert not [p for p in pids if alive(p)], "processes left behind"


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


@contextlib.contextmanager
def _two_sleeping_workers(stdout=subprocess.PIPE):
    """`tfpar launch --workers=2` of a command that starts a sleeping process of its own and
    sleeps; yields the launcher and the pids of the tasks and of what they started.

    On the way out, the launcher and the processes it started (only those) are killed.
    """
    code = ("import os, subprocess, sys, time;"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
            "open(os.environ['PID_FILE'], 'a').write(f'{os.getpid()} {p.pid}\\n');"
            "time.sleep(600)")
    pid_file = f"/tmp/tfpar-launch-test-{os.getpid()}"
    env = dict(os.environ, PID_FILE=pid_file)
    launcher = subprocess.Popen([PY, "-m", "tfpar.cli.launch", "--workers=2", "--", PY, "-c", code],
                                env=env, stdout=stdout, stderr=subprocess.STDOUT)
    pids = []
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if os.path.exists(pid_file) and len(open(pid_file).read().split()) == 4:
                break
            time.sleep(0.1)
        pids.extend(int(p) for p in open(pid_file).read().split())
        yield launcher, pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
        if os.path.exists(pid_file):
            os.remove(pid_file)


@pytest.mark.slow
def test_ctrl_c_stops_everything():
    with _two_sleeping_workers() as (launcher, pids):
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=30) == 128 + signal.SIGINT
        time.sleep(0.2)
        assert not [p for p in pids if alive(p)]


def test_tasks_and_what_they_started_die_with_a_killed_launcher():
    """SIGKILL (or the OOM killer) gives the launcher no chance to stop its tasks: they ran
    on, holding their ports (measured: both still running 20 s later). The tasks' own
    children outlived the parent-death signal; the watchdog kills their groups."""
    with _two_sleeping_workers(stdout=subprocess.DEVNULL) as (launcher, pids):
        assert len(pids) == 4
        launcher.kill()
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 5
        while [p for p in pids if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if alive(p)]


def test_launch_without_command_is_an_error():
    result = subprocess.run([PY, "-m", "tfpar.cli.launch", "--workers=2"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert "No command to launch" in result.stderr


# --max_restarts: worker servers of a parameter-server cluster are started again.

# A fake worker/ps server: records "pid<TAB>grandchild pid<TAB>TF_CONFIG" and sleeps. The
# grandchild (a process it started) must go with it.
_RECORDING_SERVER = (
    "import os, subprocess, sys, time;"
    f"p = subprocess.Popen([{PY!r}, '-c', 'import time; time.sleep(600)']);"
    "open(os.environ['PID_FILE'], 'a').write("
    "f\"{os.getpid()}\\t{p.pid}\\t{os.environ['TF_CONFIG']}\\n\");"
    "time.sleep(600)")

# The chief kills worker:1 with SIGKILL each time it is (re)started, `KILLS` times, then
# waits a second (no further start may come) and exits 0.
_KILLING_CHIEF = """
import json, os, signal, sys, time
def starts(name):
    rows = [l.split('\\t') for l in open(os.environ['PID_FILE']).read().splitlines() if l]
    return [r for r in rows
            if '{type}:{index}'.format(**json.loads(r[2])['task']) == name]
deadline = time.monotonic() + 20
for n in range(1, int(os.environ['KILLS']) + 1):
    while len(starts('worker:1')) < n:
        if time.monotonic() > deadline:
            sys.exit(9)
        time.sleep(0.05)
    os.kill(int(starts('worker:1')[-1][0]), signal.SIGKILL)
time.sleep(1.0)
print('worker:1 started', len(starts('worker:1')), 'times')
"""


def _starts(pid_file):
    rows = [line.split("\t") for line in pid_file.read_text().splitlines() if line]
    return [(int(pid), int(child), parse_tf_config(tf_config)) for pid, child, tf_config in rows]


def test_max_restarts_restarts_a_killed_worker_server_with_its_tf_config(tmp_path):
    pid_file = tmp_path / "starts"
    pid_file.write_text("")
    env = dict(os.environ, PID_FILE=str(pid_file), KILLS="3")
    start = time.monotonic()
    exit_code, lines, launcher = _launch(tmp_path, _KILLING_CHIEF, workers=2, ps=1,
                                         server=_RECORDING_SERVER, env=env, max_restarts=2,
                                         grace_seconds=2)
    assert exit_code == 0, lines
    assert time.monotonic() - start < 20
    assert "[chief:0] worker:1 started 3 times" in lines  # Killed 3 times, restarted twice.
    launcher_lines = [line for line in lines if line.startswith("[launcher]")]
    assert launcher_lines == [
        "[launcher] worker:1 exited with code -9: restarting it (restart 1 of 2)",
        "[launcher] worker:1 exited with code -9: restarting it (restart 2 of 2)",
        "[launcher] worker:1 exited with code -9: not restarting it any more "
        "(restarted 2 of 2 times); the chief decides whether the run goes on",
    ]
    starts = _starts(pid_file)
    by_task = {}
    for pid, child, config in starts:
        by_task.setdefault(config.task_name, []).append(config)
    # Only worker:1 was started again, each time with the same TF_CONFIG (same address).
    assert {name: len(c) for name, c in by_task.items()} == {"worker:0": 1, "worker:1": 3,
                                                            "ps:0": 1}
    first = by_task["worker:1"][0]
    assert all(c == first for c in by_task["worker:1"])
    assert first.cluster == launcher.cluster
    assert len(launcher.tasks) == 4 and len(launcher.replaced) == 2
    # stop() left nothing behind: not the servers, not what they started.
    time.sleep(0.2)
    pids = [p for pid, child, _ in starts for p in (pid, child)]
    assert not [p for p in pids if alive(p)], "processes left behind"
    assert all(t.process.poll() is not None for t in launcher.tasks + launcher.replaced)


def test_without_max_restarts_a_dead_worker_server_stays_dead(tmp_path):
    pid_file = tmp_path / "starts"
    pid_file.write_text("")
    env = dict(os.environ, PID_FILE=str(pid_file), KILLS="1")
    exit_code, lines, launcher = _launch(tmp_path, _KILLING_CHIEF, workers=2, ps=1,
                                         server=_RECORDING_SERVER, env=env, grace_seconds=2)
    assert exit_code == 0, lines
    assert lines == ["[chief:0] worker:1 started 1 times"]
    assert not launcher.replaced


def test_without_ps_max_restarts_restarts_the_whole_job(tmp_path):
    """Collective training cannot take one worker back: every task starts again (same
    TF_CONFIG); a task that fails once too often ends the run with its code."""
    log = tmp_path / "starts"
    code = ("import json, os, sys, time; c = json.loads(os.environ['TF_CONFIG']);"
            f"log = open({str(log)!r}, 'a'); log.write(f\"{{c['task']['index']}} {{os.getpid()}}\\n\");"
            "log.close(); starts = len(open(log.name).read().split(chr(10))) - 1;"
            "time.sleep(0.5); sys.exit(3 if c['task']['index'] == 1 and starts <= 4 else 0)")
    exit_code, lines, launcher = _launch(tmp_path, code, workers=2, max_restarts=2)
    # Starts 1-2 (first job), 3-4 (restart 1): worker 1 fails; 5-6: it succeeds.
    assert exit_code == 0, lines
    assert launcher.job_restarts == 2
    restarts = [line for line in lines if "restarting the job" in line]
    assert restarts == [f"[launcher] worker:1 exited with code 3: restarting the job (restart "
                        f"{i} of 2); it resumes from its last backup" for i in (1, 2)], lines
    starts = [line.split() for line in log.read_text().splitlines()]
    assert sorted(index for index, _ in starts) == ["0", "0", "0", "1", "1", "1"]
    assert len({pid for _, pid in starts}) == 6  # New processes each time.
    exit_code, lines, _ = _launch(tmp_path, "import sys; sys.exit(5)", workers=2, max_restarts=1)
    assert exit_code == 5 and sum("restarting the job" in line for line in lines) == 1, lines


def test_max_restarts_must_be_a_count():
    with pytest.raises(ValueError, match="--max_restarts must be an integer >= 0"):
        Launcher([PY, "-c", "pass"], 1, 1, max_restarts=-1)
    Launcher([PY, "-c", "pass"], 2, max_restarts=0)  # The default is fine everywhere.
    Launcher([PY, "-c", "pass"], 2, max_restarts=3)  # Whole-job restarts without ps.


def test_launch_max_restarts_flag():
    def launch(*flags):
        return subprocess.run([PY, "-m", "tfpar.cli.launch", *flags, "--", PY, "-c", "pass"],
                              capture_output=True, text=True, timeout=60)

    result = launch("--workers=1", "--ps=1", "--max_restarts=-1")
    assert result.returncode == 2
    assert "tfpar launch: --max_restarts must be an integer >= 0. Received: -1" in result.stderr


# --data_service

def test_data_service_processes_env_and_a_dead_dispatcher(tmp_path, monkeypatch):
    from tfpar.cluster import launcher as launcher_module
    from tfpar.cluster.data_service import DATA_SERVICE_ENV

    # A fake `python -m tfpar.cluster.data_service`: prints its flags; the dispatcher exits with 4
    # after a second.
    fake = ("import sys, time; print(' '.join(sys.argv[1:]), flush=True);"
            "'--role=dispatcher' in sys.argv and (time.sleep(1.0), sys.exit(4));"
            "time.sleep(600)")
    monkeypatch.setattr(launcher_module, "DATA_SERVICE_COMMAND", (PY, "-c", fake))
    chief = (f"import os, time; print(os.environ[{DATA_SERVICE_ENV!r}], flush=True);"
             "time.sleep(600)")
    start = time.monotonic()
    exit_code, lines, launcher = _launch(tmp_path, chief, workers=2, ps=1, data_service=True,
                                         grace_seconds=2)
    assert exit_code == 4, lines
    assert time.monotonic() - start < 15
    assert DATA_SERVICE_ENV == "TFPAR_DATA_SERVICE"
    address = launcher.data_service
    port = int(address.rsplit(":", 1)[1])
    assert address == f"grpc://127.0.0.1:{port}"
    assert f"[chief:0] {address}" in lines
    assert f"[data_service:dispatcher] --role=dispatcher --port={port}" in lines
    worker_lines = sorted(line for line in lines if line.startswith("[data_service:worker:"))
    assert len(worker_lines) == 2
    ports = {port}
    for index, line in enumerate(worker_lines):
        prefix, role, worker_port, dispatcher, host = line.split()
        assert (prefix, role) == (f"[data_service:worker:{index}]", "--role=worker")
        assert (dispatcher, host) == (f"--dispatcher=127.0.0.1:{port}", "--host=127.0.0.1")
        ports.add(int(worker_port.split("=")[1]))
    cluster_ports = {int(a.rsplit(":", 1)[1]) for a in sum(launcher.cluster.values(), ())}
    assert len(ports) == 3 and not ports & cluster_ports
    assert lines[-1] == ("[launcher] data_service:dispatcher exited with code 4: "
                         "the tf.data service is gone, stopping all tasks")
    assert len(launcher.tasks) == 3 + 4  # dispatcher, 2 data workers; chief, 2 workers, ps
    assert all(t.process.poll() is not None for t in launcher.tasks)


@pytest.mark.slow
def test_data_service_distributes_an_epoch_exactly_once():
    chief = (
        "import os, tensorflow as tf;"
        "address = os.environ['TFPAR_DATA_SERVICE'];"
        "ds = tf.data.Dataset.range(20).apply("
        "tf.data.experimental.service.distribute('distributed_epoch', address));"
        "print('elements', sorted(int(x) for x in ds.as_numpy_iterator()), flush=True)")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    launcher = subprocess.Popen(
        [PY, "-m", "tfpar.cli.launch", "--data_service", "--workers=2", "--ps=1", "--grace_seconds=2",
         "--", PY, "-c", chief],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGINT)  # The launcher stops its tasks.
            try:
                launcher.wait(timeout=60)
            except subprocess.TimeoutExpired:
                launcher.kill()
    assert launcher.returncode == 0, out[-4000:]
    [elements] = [line for line in out.splitlines() if line.startswith("[chief:0] elements ")]
    assert elements == f"[chief:0] elements {list(range(20))}", out[-4000:]
    assert "[data_service:dispatcher] tfpar.cluster.data_service: dispatcher serving at" in out
    assert "tfpar.cluster.data_service: worker serving at grpc://127.0.0.1:" in out


# --timeout and --network

def test_a_run_longer_than_its_timeout_is_stopped_with_code_124(tmp_path):
    """There was no overall limit: a stuck job ran until someone noticed."""
    start = time.monotonic()
    exit_code, lines, launcher = _launch(tmp_path, "import time; time.sleep(600)", workers=2,
                                         timeout_seconds=1.0, grace_seconds=1.0)
    assert exit_code == 124
    assert time.monotonic() - start < 10
    assert any("took longer than --timeout=1s (worker:0, worker:1 still running)" in line
               for line in lines), lines
    assert all(t.process.poll() is not None for t in launcher.tasks)
    with pytest.raises(ValueError, match="--timeout must be a number of seconds > 0"):
        Launcher([PY, "-c", "pass"], 1, timeout_seconds=-1)


# A task that listens on all interfaces at its TF_CONFIG port, as TensorFlow's server does.
_LISTENER = (
    "import json, os, socket, time; c = json.loads(os.environ['TF_CONFIG']);"
    "port = int(c['cluster']['worker'][0].rsplit(':', 1)[1]);"
    "s = socket.socket(socket.AF_INET6); s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0);"
    "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1); s.bind(('::', port)); s.listen();"
    "names = sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]);"
    "print('LISTENING', port, names, flush=True); time.sleep(600)")


def _reachable_from_outside(network):
    """Whether this test process can connect to a `--network=network` task's port."""
    import socket

    launcher = subprocess.Popen(
        [PY, "-m", "tfpar.cli.launch", "--workers=1", f"--network={network}", "--grace_seconds=1",
         "--", PY, "-c", _LISTENER], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in launcher.stdout:
            lines.append(line)
            if "LISTENING" in line:
                break
        assert "LISTENING" in lines[-1], "".join(lines)
        port = int(lines[-1].split()[2])
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            return True, "".join(lines)
        except OSError:
            return False, "".join(lines)
    finally:
        stop_launcher(launcher)


@pytest.mark.slow
def test_local_servers_are_unreachable_from_outside_in_the_private_network():
    """TensorFlow's servers listen on all interfaces without authentication, whatever the
    host: anyone reaching the port can run graphs. In the private network only the tasks
    reach each other."""
    reachable, output = _reachable_from_outside("host")
    assert reachable, output  # The probe can fail: on the host network it connects.
    try:  # The same check as `--network=auto`, in a throwaway process.
        subprocess.run([PY, "-c", "from tfpar.cluster.network import enter_private_network;"
                        "enter_private_network()"], check=True, timeout=30)
    except subprocess.CalledProcessError:
        pytest.fail("this machine allows no private network: --network=private cannot run")
    reachable, output = _reachable_from_outside("private")
    assert not reachable, output
    assert "['lo']" in output and "tasks run in a private network" in output, output


_HOST_PROBE = """
import json, os, socket, time
config = json.loads(os.environ["TF_CONFIG"])
me = config["task"]["index"]
addresses = config["cluster"]["worker"]
ip, port = addresses[me].rsplit(":", 1)
others = [a.rsplit(":", 1)[0] for a in addresses if a.rsplit(":", 1)[0] != ip]
local = []
for address in sorted({a.rsplit(":", 1)[0] for a in addresses}):
    with socket.socket() as s:
        try:
            s.bind((address, 0))
            local.append(address)
        except OSError:
            pass
if me == len(addresses) - 1:  # The last worker listens on its TF_CONFIG address.
    server = socket.create_server((ip, int(port)))
    connection, peer = server.accept()
    print("HEARD", connection.recv(16).decode(), "FROM", peer[0], flush=True)
else:
    target = addresses[-1].rsplit(":", 1)
    for _ in range(100):
        try:
            with socket.create_connection((target[0], int(target[1])), timeout=2) as c:
                c.sendall(f"worker{me}".encode())
                break
        except OSError:
            time.sleep(0.1)
print("TASK", me, "AT", ip, "LOCAL", ",".join(local), flush=True)
if me == 0:  # Host 0's ends of the links, as tc shows them.
    import subprocess
    for link in ("tfpar1", "tfpar2"):
        shown = subprocess.run(["tc", "qdisc", "show", "dev", link], capture_output=True,
                               text=True).stdout.split()
        print("LINK", link, "RATE", shown[shown.index("rate") + 1], flush=True)
"""


@pytest.mark.slow
def test_simulated_hosts_give_tasks_their_own_addresses_joined_by_a_link():
    """`--hosts 3`: each host a network namespace with an address of its own; the workers
    in blocks over them (2, 1, 1 of 4). A task can bind its own host's address only, and
    reaches the others' over the virtual links (host 1 through host 0), which send at most
    `--link_mbit`."""
    done = subprocess.run([PY, "-m", "tfpar.cli.launch", "--hosts=3", "--workers=4",
                           "--link_mbit=500", "--timeout=60", "--", PY, "-c", _HOST_PROBE],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert ("[launcher] simulated hosts: host 0 at 10.77.1.1: worker:0, worker:1; host 1 at "
            "10.77.1.2: worker:2; host 2 at 10.77.2.2: worker:3") in out, out
    for index, ip in enumerate(["10.77.1.1", "10.77.1.1", "10.77.1.2", "10.77.2.2"]):
        assert f"[worker:{index}] TASK {index} AT {ip} LOCAL {ip}\n" in out, out
    assert "[worker:0] LINK tfpar1 RATE 500Mbit" in out and \
        "[worker:0] LINK tfpar2 RATE 500Mbit" in out, out
    # The first connection to reach the last worker came over a link (from host 0 or 1).
    assert re.search(r"\[worker:3\] HEARD worker[012] FROM 10\.77\.[12]\.[12]\n", out), out


def test_simulated_hosts_are_refused_with_what_cannot_go_with_them():
    for flags, message in ((["--hosts=2", "--network=host"], "drop --network=host"),
                           (["--hosts=2", "--host=10.0.0.5"], "cannot be given with it"),
                           (["--hosts=0"], "--hosts must be an integer from 1 to 250"),
                           (["--link_mbit=100"], "--link_mbit limits the links between "
                                                 "simulated hosts: give --hosts too"),
                           (["--hosts=2", "--link_mbit=-1"], "--link_mbit must be a rate")):
        done = subprocess.run([PY, "-m", "tfpar.cli.launch", *flags, "--", PY, "-c", "0"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, (flags, done.stderr)


def test_network_choice():
    from tfpar.cluster.network import choose_network

    entered = []

    def unavailable():
        raise OSError(1, "cannot create a user and network namespace: Operation not permitted")

    assert choose_network("auto", "127.0.0.1", enter=lambda: entered.append(1))[0] == "private"
    assert entered == [1]
    assert choose_network("host", "127.0.0.1", enter=lambda: entered.append(2))[0] == "host"
    mode, note = choose_network("auto", "10.1.2.3", enter=lambda: entered.append(3))
    assert (mode, entered) == ("host", [1]) and "listen on all interfaces" in note
    mode, note = choose_network("auto", "localhost", enter=unavailable)
    assert mode == "host" and note.startswith("no private network (")
    with pytest.raises(ValueError, match="--network=private: .*Operation not permitted"):
        choose_network("private", "127.0.0.1", enter=unavailable)
    with pytest.raises(ValueError, match="--host=10.1.2.3 is meant to be reached from elsewhere"):
        choose_network("private", "10.1.2.3", enter=unavailable)
    with pytest.raises(ValueError, match="--network must be one of auto, private, host"):
        choose_network("on", "127.0.0.1")


def test_the_watchdog_kills_listed_groups_only_when_its_input_ends_without_exit():
    from tfpar.cluster.watchdog import watch

    def sleeping_group():
        return subprocess.Popen([PY, "-c", "import time; time.sleep(600)"],
                                start_new_session=True)

    first, second, third = sleeping_group(), sleeping_group(), sleeping_group()
    try:
        assert watch([f"+{first.pid}", f"+{second.pid}", f"-{second.pid}", "exit"]) == []
        assert first.poll() is None and second.poll() is None
        assert watch([f"+{first.pid}", f"+{third.pid}"]) == sorted([first.pid, third.pid])
        assert first.wait(5) == -signal.SIGKILL and third.wait(5) == -signal.SIGKILL
        assert second.poll() is None  # Forgotten: not killed.
    finally:
        for process in (first, second, third):
            process.kill()
            process.wait()


# --memory_cap

def test_memory_cap_names_the_task_the_kernel_killed_and_prints_every_peak(tmp_path):
    """Worker 1 allocates 400 MB under a 200 MiB cap and is killed by the kernel; worker 0
    allocates 20 MB and would run on. Without memory cgroups here the cap cannot be set:
    then the launcher must say so (and this test says it checked only that)."""
    from tfpar.cluster import memory_cgroup

    if not memory_cgroup.available():
        result = subprocess.run([PY, "-m", "tfpar.cli.launch", "--workers=1",
                                 "--memory_cap=200MiB", "--", PY, "-c", "pass"],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0
        assert "--memory_cap: no memory cgroup can be made here" in result.stdout
        print("no memory cgroups here: checked only that the launcher says the cap is not set")
        return
    code = ("import os, json, time;"
            "i = json.loads(os.environ['TF_CONFIG'])['task']['index'];"
            "b = bytearray((400 if i == 1 else 20) * 10**6);"
            "print('allocated', flush=True); time.sleep(600)")
    exit_code, lines, _ = _launch(tmp_path, code, grace_seconds=2, memory_cap=200 * 2**20)
    assert exit_code == -9, lines
    assert ("[launcher] worker:1 exited with code -9 (killed by the kernel: over its "
            "--memory_cap of 0.20 GiB, peak 0.20 GiB): stopping all tasks") in lines, lines
    peaks = [line for line in lines if line.startswith("[launcher] memory peaks")]
    assert len(peaks) == 1, lines
    # Worker 0's peak (its 20 MB and Python) is well under the cap; worker 1 reached it.
    worker0 = float(peaks[0].split("worker:0 ")[1].split(" GiB")[0])
    assert worker0 < 0.1 and "worker:1 0.20 GiB, 1 killed" in peaks[0], peaks
    assert not [d for d in os.listdir(memory_cgroup.ROOT) if f"tfpar_launch_{os.getpid()}_" in d]


def test_memory_cap_jobs_caps_only_the_tasks_of_those_jobs(tmp_path):
    """With --coordinator the chief runs the program (a host process, no device); the
    workers are the devices. --memory_cap_jobs=worker caps them alone: the chief's 400 MB
    under a 200 MiB cap for the workers runs on."""
    from tfpar.cluster import memory_cgroup

    with pytest.raises(ValueError, match=r"--memory_cap_jobs names jobs of this cluster "
                                         r"\(chief, worker\). Received: 'ps'"):
        Launcher([PY, "-c", "pass"], 2, coordinator=True, memory_cap=2**30,
                 memory_cap_jobs=["ps"])
    if not memory_cgroup.available():
        print("no memory cgroups here: checked only that unknown jobs are refused")
        return
    code = "b = bytearray(400 * 10**6); print('chief allocated', flush=True)"
    exit_code, lines, _ = _launch(tmp_path, code, coordinator=True, grace_seconds=2,
                                  memory_cap=200 * 2**20, memory_cap_jobs=["worker"])
    assert exit_code == 0, lines
    assert "[chief:0] chief allocated" in lines
    [peaks] = [line for line in lines if line.startswith("[launcher] memory peaks")]
    assert "worker:0" in peaks and "worker:1" in peaks and "chief" not in peaks, peaks


def test_memory_cap_must_be_a_size():
    with pytest.raises(ValueError, match="--memory_cap must be a size > 0"):
        Launcher([PY, "-c", "pass"], 2, memory_cap=0)
    result = subprocess.run([PY, "-m", "tfpar.cli.launch", "--memory_cap=lots", "--", PY, "-c",
                             "pass"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "Cannot read 'lots' as bytes" in result.stderr


@pytest.mark.parametrize("given", [None, "8"])
def test_tasks_keep_two_malloc_arenas_unless_the_environment_says(tmp_path, given):
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    if given:
        env["MALLOC_ARENA_MAX"] = given
    lines = []
    code = "import os; print('arenas', os.environ.get('MALLOC_ARENA_MAX'))"
    launcher = Launcher([PY, "-c", code], 1, output=lines.append, env=env)
    assert launcher.run() == 0
    assert [line for line in lines if "arenas" in line] == [f"[worker:0] arenas {given or 2}"]


@pytest.mark.parametrize("use_bfc", [None, "false"])
def test_tasks_keep_allocator_statistics_on_any_cpu_unless_the_environment_says(use_bfc):
    # oneDNN off, as TensorFlow defaults on CPUs without AVX-512 (an AMD EPYC): its default
    # CPU allocator keeps no statistics. The task asks TensorFlow itself, not tfpar.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_CPU_")}
    env.update(TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2")
    if use_bfc:
        env["TF_CPU_ALLOCATOR_USE_BFC"] = use_bfc
    code = ("import tensorflow as tf\n"
            "try: print('stats', sorted(tf.config.experimental.get_memory_info('CPU:0')))\n"
            "except ValueError as e: print('stats', e)")
    lines = []
    launcher = Launcher([PY, "-c", code], 1, output=lines.append, env=env)
    assert launcher.run() == 0
    said = [line for line in lines if "stats" in line]
    assert said == ([f"[worker:0] stats ['current', 'peak']"] if use_bfc is None else
                    ["[worker:0] stats Allocator stats not available for device 'CPU:0'"])


def test_the_tasks_on_a_host_share_its_cores_unless_the_environment_says_otherwise(tmp_path):
    """TensorFlow gives each process an op thread per core: N tasks on one host ran N x
    cores threads per op. The launcher gives each task cores / tasks (at least 1), as
    torchrun sets OMP_NUM_THREADS=1; one that is set is kept."""
    from tfpar.cluster.launcher import INTRA_OP_THREADS_ENV, host_cores

    code = f"import os; print('threads', os.environ.get({INTRA_OP_THREADS_ENV!r}))"
    base = {k: v for k, v in os.environ.items() if k != INTRA_OP_THREADS_ENV}
    exit_code, lines, _ = _launch(tmp_path, code, workers=3, env=base)
    assert exit_code == 0, lines
    want = max(1, host_cores() // 3)
    assert sorted(line for line in lines if "threads" in line) == [
        f"[worker:{i}] threads {want}" for i in range(3)], lines
    exit_code, lines, _ = _launch(tmp_path, code, workers=2,
                                  env=dict(base, **{INTRA_OP_THREADS_ENV: "7"}))
    assert exit_code == 0 and sorted(line for line in lines if "threads" in line) == [
        "[worker:0] threads 7", "[worker:1] threads 7"], lines
    from tfpar.cluster.launcher import task_environment

    assert INTRA_OP_THREADS_ENV not in task_environment(base, tasks=1)
    assert task_environment(base, tasks=16, cores=8)[INTRA_OP_THREADS_ENV] == "1"
    assert task_environment(base, tasks=4, cores=64)[INTRA_OP_THREADS_ENV] == "16"


def test_docstrings():
    import doctest

    from tfpar.cluster import launcher

    assert doctest.testmod(launcher).failed == 0


# -- GPUs per task -----------------------------------------------------------------------------

def test_gpus_are_shared_out_to_the_workers_and_hidden_from_the_others():
    from tfpar.cluster.gpu_assignment import assign

    names = ["chief:0", "worker:0", "worker:1", "ps:0"]
    assert assign(names, list("0123")) == {"chief:0": "", "worker:0": "0,1",
                                           "worker:1": "2,3", "ps:0": ""}
    assert assign(names, list("0123"), gpus_per_task=1) == {
        "chief:0": "", "worker:0": "0", "worker:1": "1", "ps:0": ""}
    # Fewer GPUs than workers: round-robin, shared.
    assert assign(["worker:0", "worker:1", "worker:2"], ["4", "5"]) == {
        "worker:0": "4", "worker:1": "5", "worker:2": "4"}
    # No GPU, or 0 asked: nothing set (CUDA_VISIBLE_DEVICES left as it is).
    assert assign(names, []) == {} and assign(names, list("01"), gpus_per_task=0) == {}
    with pytest.raises(ValueError, match="needs 6 GPUs; this host has 4 .0,1,2,3."):
        assign(["worker:0", "worker:1", "worker:2"], list("0123"), gpus_per_task=2)
    with pytest.raises(ValueError, match="no GPU to assign"):
        assign(names, [], gpus_per_task=1)
    with pytest.raises(ValueError, match="must be an integer >= 0"):
        assign(names, list("01"), gpus_per_task=-1)


def test_the_visible_gpus_come_from_cuda_visible_devices_else_nvidia_smi():
    from tfpar.cluster.gpu_assignment import visible_gpus

    listed = lambda: ["GPU 0: NVIDIA A100 (UUID: GPU-a)", "GPU 1: NVIDIA A100 (UUID: GPU-b)"]  # noqa: E731
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3, 5"}, listed) == ["3", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, listed) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, listed) == []
    assert visible_gpus({}, listed) == ["0", "1"]
    assert visible_gpus({}, lambda: []) == []


@pytest.mark.slow
def test_each_task_starts_with_its_gpus(tmp_path):
    """The environment each task of a parameter-server cluster gets, read in the tasks."""
    record = ("import json, os, pathlib, time; t = json.loads(os.environ['TF_CONFIG'])['task'];"
              f" d = pathlib.Path({str(tmp_path)!r});"
              " (d / f\"{t['type']}:{t['index']}\").write_text("
              "os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'));")
    names = ["chief:0", "worker:0", "worker:1", "ps:0"]
    chief = record + (f" deadline = time.time() + 60\n"
                      f"while not all((d / n).exists() for n in {names!r}) and "
                      f"time.time() < deadline: time.sleep(0.1)")
    code, lines, launcher = _launch(tmp_path, chief, workers=2, ps=1,
                                    server=record + " time.sleep(600)",
                                    gpus=["0", "1", "2", "3"])
    assert code == 0, lines
    seen = {name: (tmp_path / name).read_text() for name in names}
    assert seen == {"chief:0": "", "worker:0": "0,1", "worker:1": "2,3", "ps:0": ""}
    assert ("[launcher] CUDA_VISIBLE_DEVICES per task: chief:0=(none), worker:0=0,1, "
            "worker:1=2,3, ps:0=(none)") in lines, lines
    # No GPU on the host: nothing is set.
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    code, lines, _ = _launch(tmp_path / "none", "import os; assert 'CUDA_VISIBLE_DEVICES' not "
                             "in os.environ", workers=2, gpus=[], env=env)
    assert code == 0, lines
