"""`tfpar launch`: run a local TF_CONFIG cluster on 127.0.0.1, like torchrun for TensorFlow.

    tfpar launch --workers 2 -- python -m tfpar.cli.train --strategy=data
    tfpar launch --workers 2 --ps 1 -- python examples/parameter_server.py
    tfpar launch --workers 2 --coordinator -- python my_pipeline.py

Every task gets its TF_CONFIG and free ports (held by the launcher until the run
ends); output lines are prefixed with the task name; if a task fails, all are stopped
and its exit code is returned; Ctrl-C stops everything; tasks die with the launcher.
By default (--network=auto) the tasks run in a private network namespace with only
loopback: TensorFlow's servers listen on all interfaces without authentication, and
nothing outside can reach them there (--network=host to share the machine's network).

    tfpar launch --workers 2 --max_restarts 10 --timeout 3600 -- python train.py
    tfpar launch --workers 2 --ps 1 --max_restarts 3 -- python examples/parameter_server.py
    tfpar launch --workers 2 --ps 1 --data_service -- python my_training.py

--coordinator: a chief task runs the command and the worker tasks only serve (`python -m
tfpar.cluster.server`), running what the chief places on their devices: the stages of
`tfpar.PipelineStrategy(cluster_resolver=tf.distribute.cluster_resolver.
TFConfigClusterResolver())`, one per worker. A worker that dies ends the run: the chief
gets --report_seconds to fail with its own error (which names the lost stage), then
every task is stopped. (--ps implies a chief too.)

--max_restarts N: with --ps, a worker server that exits is started again with the same
TF_CONFIG, at most N times per worker task (the chief and ps tasks never are); without
--ps (collective training, or --coordinator), the whole job is started again after a
task fails, at most N times, resuming from the chief's last BackupAndRestore backup.
--timeout S: stop everything after S seconds (exit 124). --data_service: also run a tf.data service (a dispatcher and one worker per
training worker); every task finds the dispatcher's address in $TFPAR_DATA_SERVICE.

On Slurm, every srun task runs the launcher with --slurm, and the launcher runs the
command as that one task (no ports to pick, no other processes):

    srun --ntasks-per-node=1 tfpar launch --slurm -- python train.py

--slurm builds this task's TF_CONFIG with TensorFlow's SlurmClusterResolver: every Slurm
task is a worker (SLURM_PROCID r is worker:r; worker 0 is the chief), at node:PORT where
PORT is --slurm_port_base (8888) plus the task's index on its node. The GPUs of a node
(CUDA_VISIBLE_DEVICES, else nvidia-smi, else none; or --slurm_gpus_per_node, 0 for no
assignment) are shared among its tasks through CUDA_VISIBLE_DEVICES (--slurm_gpus_per_task
each, default an even share). SIGTERM and SIGINT are forwarded to the command (killed
--grace_seconds later if it still runs), it dies with the launcher, and its exit code is
returned. The task count comes from Slurm (--workers, if given, must equal it); --ps and
the other local-only flags are refused with --slurm (see tfpar.cluster.slurm).
"""

import sys

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("workers", 2, "Worker tasks.")
flags.DEFINE_integer("ps", 0, "Parameter-server tasks (adds a chief that runs the command).")
flags.DEFINE_bool("coordinator", False,
                  "Add a chief task that runs the command while the workers serve (python -m "
                  "tfpar.cluster.server) and run what it places on their devices, e.g. the stages of "
                  "tfpar.PipelineStrategy(cluster_resolver=...). Implied by --ps.")
flags.DEFINE_string("host", "127.0.0.1", "Address the tasks bind to.")
flags.DEFINE_float("grace_seconds", 5.0, "Seconds between SIGTERM and SIGKILL when stopping.")
flags.DEFINE_float("report_seconds", 60.0,
                   "After a ps task (or, with --coordinator, a worker) dies, seconds the chief "
                   "gets to fail with its own error before all tasks are stopped.")
flags.DEFINE_integer("max_restarts", 0,
                     "With --ps: times each worker server is started again (same TF_CONFIG) "
                     "after it exits; the chief and ps tasks are never restarted. Without "
                     "--ps (also with --coordinator): times the whole job is started again "
                     "after a task fails; it resumes from the chief's last "
                     "keras.callbacks.BackupAndRestore backup.")
flags.DEFINE_bool("data_service", False,
                  "Also run a tf.data service: a dispatcher and one tf.data service worker per "
                  "training worker; tasks get the dispatcher's address in $TFPAR_DATA_SERVICE.")
flags.DEFINE_enum("network", "auto", ["auto", "private", "host"],
                  "private: the tasks run in a private network namespace with loopback only, "
                  "unreachable from outside (TensorFlow's servers listen on all interfaces "
                  "without authentication) and without outside network; host: the machine's "
                  "network; auto: private when --host is loopback and the system allows it.")
flags.DEFINE_float("timeout", 0.0,
                   "Seconds the whole run may take; then every task is stopped and the "
                   "launcher exits with code 124. 0: no limit.")
flags.DEFINE_string("memory_cap", None,
                    "Cap each cluster task's memory (e.g. 1.8GiB): every task runs in a memory "
                    "cgroup of its own (Linux, root, the v1 memory controller), the kernel "
                    "kills a task over its cap, and the launcher says so and prints every "
                    "task's peak at the end. Where no cgroup can be made, the launcher says "
                    "so and runs uncapped.")
flags.DEFINE_list("memory_cap_jobs", None,
                  "The jobs whose tasks --memory_cap caps (default: all), e.g. worker: with "
                  "--coordinator the chief runs the program and holds no device, like a "
                  "host beside its accelerators.")
flags.DEFINE_integer("gpus_per_task", None,
                     "GPUs each worker task sees (CUDA_VISIBLE_DEVICES, round-robin over "
                     "this host's: CUDA_VISIBLE_DEVICES, else nvidia-smi's list); the chief, "
                     "ps and tf.data service tasks see none. Default: the GPUs split evenly "
                     "over the workers. 0: leave CUDA_VISIBLE_DEVICES as it is.")
flags.DEFINE_integer("hosts", 1,
                     "Simulate this many hosts on this machine: each a network namespace with "
                     "its own address (10.77.x.x), joined to the others by virtual links; the "
                     "workers are split over them in blocks (the chief, tf.data service on "
                     "the first), so collectives between hosts cross a network interface. "
                     "Linux, iproute2's `ip`; implies --network=private.")
flags.DEFINE_float("link_mbit", None,
                   "With --hosts: each end of a link between simulated hosts sends at most "
                   "this many Mbit/s (tc's token bucket), as a network card does; default: "
                   "as fast as memory.")
flags.DEFINE_bool("slurm", False,
                  "Run the command as this Slurm task (under srun), with the TF_CONFIG that "
                  "TensorFlow's SlurmClusterResolver builds from the Slurm environment.")
flags.DEFINE_integer("slurm_port_base", 8888,
                     "With --slurm: the port of the first task on each node (the k-th task "
                     "of a node gets slurm_port_base + k).")
flags.DEFINE_integer("slurm_gpus_per_node", None,
                     "With --slurm: GPUs of a node to share among its tasks (default: counted "
                     "from CUDA_VISIBLE_DEVICES, else nvidia-smi, else none). 0: assign none, "
                     "leave CUDA_VISIBLE_DEVICES as Slurm set it.")
flags.DEFINE_integer("slurm_gpus_per_task", None,
                     "With --slurm: GPUs per task (default: an even share of the node's).")

_SLURM_FLAGS = ("slurm_port_base", "slurm_gpus_per_node", "slurm_gpus_per_task")


def main(argv):
    from tfpar.cluster.launcher import Launcher

    command = argv[1:]
    if command and command[0] == "--":
        command = command[1:]
    if FLAGS.slurm:
        return _main_slurm(command)
    given = [f"--{name}" for name in _SLURM_FLAGS if FLAGS[name].present]
    if given:
        print(f"tfpar launch: {', '.join(given)}: for --slurm only. Add --slurm or remove "
              f"them.", file=sys.stderr)
        return 2
    from tfpar.cluster.network import choose_network

    from tfpar.cluster import memory_cgroup
    from tfpar.plan.units import parse_bytes

    try:
        memory_cap = None if FLAGS.memory_cap is None else parse_bytes(FLAGS.memory_cap)
        # Before any task (or thread) starts: the tasks inherit the namespace.
        if FLAGS.hosts != 1 and FLAGS.network == "host":
            raise ValueError("--hosts simulates hosts in private networks: drop "
                             "--network=host.")
        if FLAGS.hosts != 1 and FLAGS["host"].present:
            raise ValueError(f"--hosts simulates hosts on this machine, each with an address "
                             f"of its own: --host={FLAGS.host} cannot be given with it.")
        _, note = choose_network("private" if FLAGS.hosts != 1 else FLAGS.network,
                                 FLAGS.host)
        if FLAGS.hosts != 1:
            note = (f"tasks run on {FLAGS.hosts} simulated hosts, private networks joined "
                    f"by virtual links: nothing outside can reach their servers, and they "
                    f"cannot reach the network")
        launcher = Launcher(command, FLAGS.workers, FLAGS.ps, FLAGS.host, FLAGS.grace_seconds,
                            report_seconds=FLAGS.report_seconds,
                            max_restarts=FLAGS.max_restarts, data_service=FLAGS.data_service,
                            timeout_seconds=FLAGS.timeout or None,
                            coordinator=FLAGS.coordinator, memory_cap=memory_cap,
                            memory_cap_jobs=FLAGS.memory_cap_jobs,
                            gpus_per_task=FLAGS.gpus_per_task, hosts=FLAGS.hosts,
                            link_mbit=FLAGS.link_mbit)
    except (ValueError, OSError) as error:
        print(f"tfpar launch: {error}", file=sys.stderr)
        return 2
    print(f"[launcher] {note}", flush=True)
    if memory_cap is not None and not memory_cgroup.available():
        print(f"[launcher] --memory_cap: no memory cgroup can be made here (root and "
              f"{memory_cgroup.ROOT} needed): the tasks run uncapped", flush=True)
    return launcher.run()


def _main_slurm(command):
    from tfpar.cluster import slurm

    try:
        if not command:
            raise ValueError(f"No command to launch: give it after '--', e.g. {slurm.EXAMPLE}")
        slurm.check_flags([name for name in slurm.LOCAL_FLAGS
                           if name in FLAGS and FLAGS[name].present])
        task = slurm.resolve(FLAGS.slurm_port_base, FLAGS.slurm_gpus_per_node,
                             FLAGS.slurm_gpus_per_task,
                             workers=FLAGS.workers if FLAGS["workers"].present else None)
    except ValueError as error:
        print(f"tfpar launch: {error}", file=sys.stderr)
        return 2
    return slurm.run(task, command, FLAGS.grace_seconds)


def entry():
    app.run(main)


if __name__ == "__main__":
    entry()
