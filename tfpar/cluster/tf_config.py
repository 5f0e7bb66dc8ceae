"""Parse and validate TF_CONFIG into plain data. Pure Python: no TensorFlow.

    >>> config = parse_tf_config('{"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},'
    ...                          ' "task": {"type": "worker", "index": 1}}')
    >>> config.num_workers, config.is_chief
    (2, False)
"""

import dataclasses
import json
import os

ENV_VAR = "TF_CONFIG"
CLUSTER = "cluster"
TASK = "task"
TYPE = "type"
INDEX = "index"
RPC_LAYER = "rpc_layer"

# Task types that train (and so count as workers for synchronous all-reduce).
TRAINING_JOBS = ("chief", "worker")
KNOWN_JOBS = ("chief", "worker", "ps", "evaluator")


class TFConfigError(ValueError):
    """TF_CONFIG is malformed or inconsistent."""


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """A validated TF_CONFIG: the cluster's addresses per job and this process's task."""

    cluster: dict  # job name -> tuple of "host:port"
    task_type: str = None
    task_index: int = None
    rpc_layer: str = None

    @property
    def num_workers(self):
        """Tasks that train synchronously: chief plus workers."""
        return sum(len(self.cluster.get(job, ())) for job in TRAINING_JOBS)

    @property
    def num_ps(self):
        return len(self.cluster.get("ps", ()))

    @property
    def is_chief(self):
        """The chief task, or worker 0 when there is no chief."""
        if self.task_type == "chief":
            return True
        return (self.task_type == "worker" and self.task_index == 0
                and "chief" not in self.cluster)

    @property
    def task_name(self):
        return f"{self.task_type}:{self.task_index}"

    def to_json(self):
        config = {CLUSTER: {job: list(addresses) for job, addresses in self.cluster.items()}}
        if self.task_type is not None:
            config[TASK] = {TYPE: self.task_type, INDEX: self.task_index}
        if self.rpc_layer:
            config[RPC_LAYER] = self.rpc_layer
        return json.dumps(config)


def parse_tf_config(value=None, environ=None):
    """Parses TF_CONFIG (a JSON string or dict; by default the environment variable).

    Returns None when TF_CONFIG is unset or empty (no cluster: one process).

    Raises:
      TFConfigError: naming the field and the value that is wrong.
    """
    if value is None:
        value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise TFConfigError(
                f"TF_CONFIG is not valid JSON ({error.msg} at line {error.lineno} column "
                f"{error.colno}). Received: {value!r}") from None
    if not isinstance(value, dict):
        raise TFConfigError(f"TF_CONFIG must be a JSON object. Received: {value!r}")
    if not value:
        return None
    if CLUSTER not in value:
        raise TFConfigError(
            f"TF_CONFIG has no '{CLUSTER}' field: give the address of every task, e.g. "
            f'{{"cluster": {{"worker": ["host:port", ...]}}, "task": {{"type": "worker", '
            f'"index": 0}}}}. Received: {json.dumps(value)}')
    cluster = _parse_cluster(value[CLUSTER])
    if TASK not in value:
        raise TFConfigError(
            f"TF_CONFIG has no '{TASK}' field: say which task this process is, e.g. "
            f'"task": {{"type": "worker", "index": 0}}. Received: {json.dumps(value)}')
    task_type, task_index = _parse_task(value[TASK], cluster)
    rpc_layer = value.get(RPC_LAYER)
    if rpc_layer is not None and not isinstance(rpc_layer, str):
        raise TFConfigError(f"TF_CONFIG field '{RPC_LAYER}' must be a string. Received: {rpc_layer!r}")
    return ClusterConfig(cluster, task_type, task_index, rpc_layer)


def _parse_cluster(cluster):
    if not isinstance(cluster, dict) or not cluster:
        raise TFConfigError(
            f"TF_CONFIG field 'cluster' must map job names to address lists, e.g. "
            f'{{"worker": ["127.0.0.1:2222"]}}. Received: {cluster!r}')
    parsed = {}
    seen = {}
    for job, addresses in cluster.items():
        if not isinstance(job, str) or not job:
            raise TFConfigError(f"TF_CONFIG cluster job names must be strings. Received: {job!r}")
        if isinstance(addresses, dict):  # sparse form {"0": "host:port"}
            try:
                addresses = [addresses[k] for k in sorted(addresses, key=int)]
            except (ValueError, TypeError):
                raise TFConfigError(
                    f"TF_CONFIG field 'cluster.{job}' keys must be task indices. "
                    f"Received: {cluster[job]!r}") from None
        if not isinstance(addresses, list) or not addresses:
            raise TFConfigError(
                f"TF_CONFIG field 'cluster.{job}' must be a non-empty list of 'host:port'. "
                f"Received: {addresses!r}")
        for i, address in enumerate(addresses):
            _check_address(address, f"cluster.{job}[{i}]")
            if address in seen:
                raise TFConfigError(
                    f"TF_CONFIG address {address!r} is used by both {seen[address]} and "
                    f"cluster.{job}[{i}]: every task needs its own host:port.")
            seen[address] = f"cluster.{job}[{i}]"
        parsed[job] = tuple(addresses)
    return parsed


def _check_address(address, field):
    if not isinstance(address, str):
        raise TFConfigError(f"TF_CONFIG field '{field}' must be a 'host:port' string. "
                            f"Received: {address!r}")
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TFConfigError(
            f"TF_CONFIG field '{field}' must be 'host:port' with a port in 1..65535. "
            f"Received: {address!r}")


def _parse_task(task, cluster):
    if not isinstance(task, dict):
        raise TFConfigError(f"TF_CONFIG field 'task' must be an object like "
                            f'{{"type": "worker", "index": 0}}. Received: {task!r}')
    task_type = task.get(TYPE)
    if task_type not in cluster:
        raise TFConfigError(
            f"TF_CONFIG field 'task.type' is {task_type!r}, which is not a job in the cluster "
            f"({', '.join(sorted(cluster))}). Use one of those.")
    index = task.get(INDEX, 0)
    if isinstance(index, str) and index.isdigit():
        index = int(index)
    if not isinstance(index, int) or isinstance(index, bool):
        raise TFConfigError(f"TF_CONFIG field 'task.index' must be an integer. Received: {index!r}")
    size = len(cluster[task_type])
    if not 0 <= index < size:
        raise TFConfigError(
            f"TF_CONFIG field 'task.index' is {index}, out of range for job {task_type!r} "
            f"with {size} task(s): use 0..{size - 1}.")
    return task_type, index


def check_parameter_server_cluster(config):
    """Checks that `config` describes a parameter-server cluster seen from its coordinator.

    Parameter-server training needs at least one worker and one ps task. The program
    (the coordinator) runs on the chief; a cluster spec without a 'chief' job is
    accepted as TensorFlow accepts it: the program joins the cluster as its chief.

    Raises:
      TFConfigError: saying which job is missing or which task this is instead.
    """
    _check_coordinated_cluster(
        config, "Parameter-server training",
        {"worker": "workers run the steps", "ps": "ps tasks hold the variables"},
        ("tfpar launch --workers N --ps K", "tfpar launch --workers 2 --ps 1"),
        "workers and ps tasks")


def check_pipeline_cluster(config):
    """Checks that `config` describes a cluster for pipeline stages on worker tasks, seen
    from the process that runs the program.

    The program runs on the chief (a cluster spec without a 'chief' job is accepted: the
    program joins it as its chief); each worker task serves (`python -m tfpar.cluster.server`) and
    runs the stages placed on its devices.

    Raises:
      TFConfigError: saying what is missing or which task this is instead.
    """
    _check_coordinated_cluster(
        config, "A pipeline across workers", {"worker": "workers hold the stages"},
        ("tfpar launch --workers N --coordinator", "tfpar launch --workers 2 --coordinator"),
        "the worker tasks")


def _check_coordinated_cluster(config, training, jobs, launch, servers):
    """The checks shared by clusters whose program runs on the chief alone while the other
    tasks serve: `jobs` {job: why it is needed}, `launch` the command that starts one
    (general, and an example), `servers` the tasks that run `python -m tfpar.cluster.server`."""
    if config is None:
        *first, last = [f"'{job}'" for job in ("chief", *jobs)]
        raise TFConfigError(
            f"{training} needs a cluster, but TF_CONFIG is not set. Start the program with "
            f"`{launch[0]} -- python train.py`, or set TF_CONFIG with {', '.join(first)} "
            f"and {last} jobs.")
    for job, why in jobs.items():
        if not config.cluster.get(job):
            raise TFConfigError(
                f"{training} needs at least one '{job}' task ({why}), but the cluster has "
                f"jobs {', '.join(sorted(config.cluster))}. Add '{job}' to TF_CONFIG's "
                f"cluster, e.g. `{launch[1]}`.")
    if config.task_type not in (None, "chief"):
        raise TFConfigError(
            f"This process is {config.task_name}, but {training[0].lower()}{training[1:]} "
            f"runs the program on the chief only. Run `python -m tfpar.cluster.server` on "
            f"{servers} (tfpar launch does this).")
