"""A pytest plugin that logs each test's duration as it ends, for timing the suite.

    PYTHONPATH=<clone>:<clone>/tests/timing DURLOG=/tmp/durlog.tsv python -m pytest -q -p durlog

Each line: seconds since the start, the call's duration, phase, outcome, the xdist worker
(empty on the worker's own line, its id on the controller's), the test id. Only calls and
failures are logged.
"""

import os
import time

_START = time.time()


def pytest_runtest_logreport(report):
    if report.when != "call" and report.outcome == "passed":
        return
    node = getattr(report, "node", None)
    worker = node.gateway.id if node is not None else ""
    with open(os.environ.get("DURLOG", "/tmp/durlog.tsv"), "a") as log:
        log.write(f"{time.time() - _START:.0f}\t{report.duration:.1f}\t{report.when}\t"
                  f"{report.outcome}\t{worker}\t{report.nodeid}\n")
