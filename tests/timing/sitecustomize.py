"""Logs, when each Python process exits, its CPU time, whether it imported TensorFlow and
the test that started it (pytest's PYTEST_CURRENT_TEST, which child processes inherit): where
the suite's CPU goes beyond the pytest processes. Put this folder on PYTHONPATH:

    PYTHONPATH=<clone>:<clone>/tests/timing PROCLOG=/tmp/proclog.tsv python -m pytest -q

(A process killed by a signal logs nothing.)
"""

import atexit
import os
import sys
import time

_START = time.time()


def _log():
    try:
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        with open(os.environ.get("PROCLOG", "/tmp/proclog.tsv"), "a") as log:
            log.write(f"{os.getpid()}\t{usage.ru_utime + usage.ru_stime:.1f}\t"
                      f"{time.time() - _START:.1f}\t{int('tensorflow' in sys.modules)}\t"
                      f"{os.environ.get('PYTEST_CURRENT_TEST', '-')}\t"
                      f"{' '.join(sys.argv)[:200]}\n")
    except Exception:  # noqa: BLE001 - a timing aid never fails the process it watches
        pass


atexit.register(_log)
