"""TF_CONFIG parsing and validation: pure Python, each error names its field and value."""

import json
import subprocess
import sys

import pytest

from tfpar.cluster import TFConfigError, parse_tf_config

CLUSTER = {"chief": ["127.0.0.1:2000"], "worker": ["127.0.0.1:2001", "localhost:2002"],
           "ps": ["127.0.0.1:2003"]}


def _config(**task):
    return json.dumps({"cluster": CLUSTER, "task": task})


def test_parses_a_cluster():
    config = parse_tf_config(_config(type="worker", index=1))
    assert config.cluster["worker"] == ("127.0.0.1:2001", "localhost:2002")
    assert (config.task_type, config.task_index, config.task_name) == ("worker", 1, "worker:1")
    assert (config.num_workers, config.num_ps, config.is_chief) == (3, 1, False)
    assert parse_tf_config(_config(type="chief", index=0)).is_chief
    assert parse_tf_config(json.loads(config.to_json())) == config


def test_worker_0_is_chief_without_a_chief_job():
    text = json.dumps({"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 0}})
    assert parse_tf_config(text).is_chief


def test_unset_means_no_cluster():
    assert parse_tf_config(environ={}) is None
    assert parse_tf_config("  ") is None
    assert parse_tf_config(environ={"TF_CONFIG": _config(type="ps", index=0)}).task_type == "ps"


@pytest.mark.parametrize("value,message", [
    ('{"cluster": ', r"not valid JSON .*line 1"),
    ("[1, 2]", r"must be a JSON object"),
    (json.dumps({"task": {"type": "worker", "index": 0}}), r"no 'cluster' field"),
    (json.dumps({"cluster": CLUSTER}), r"no 'task' field"),
    (_config(type="evaluator", index=0), r"'task.type' is 'evaluator'.*chief, ps, worker"),
    (_config(type="worker", index=2), r"'task.index' is 2, out of range for job 'worker' .*0..1"),
    (_config(type="worker", index=-1), r"'task.index' is -1"),
    (_config(type="worker", index="one"), r"'task.index' must be an integer.*'one'"),
    (json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:1"]},
                 "task": {"type": "worker", "index": 0}}),
     r"'127.0.0.1:1' is used by both cluster.worker\[0\] and cluster.worker\[1\]"),
    (json.dumps({"cluster": {"worker": ["127.0.0.1"]}, "task": {"type": "worker", "index": 0}}),
     r"'cluster.worker\[0\]' must be 'host:port'.*'127.0.0.1'"),
    (json.dumps({"cluster": {"worker": ["h:99999"]}, "task": {"type": "worker", "index": 0}}),
     r"'cluster.worker\[0\]'.*'h:99999'"),
    (json.dumps({"cluster": {"worker": [":80"]}, "task": {"type": "worker", "index": 0}}),
     r"'cluster.worker\[0\]'.*':80'"),
    (json.dumps({"cluster": {"worker": []}, "task": {"type": "worker", "index": 0}}),
     r"'cluster.worker' must be a non-empty list"),
    (json.dumps({"cluster": [], "task": {}}), r"'cluster' must map job names"),
])
def test_malformed_tf_config(value, message):
    with pytest.raises(TFConfigError, match=message):
        parse_tf_config(value)


def test_parser_does_not_import_tensorflow():
    code = ("import sys, tfpar.cluster.tf_config;"
            "assert 'tensorflow' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
