"""The programs' old names (before the package's relayout) still run them, and say where
they moved."""

import subprocess
import sys

import pytest

from tfpar.cli import moved


# A flag only the new program has, to tell that it is the one that ran.
FLAGS = {"tfpar.train": "--num_devices", "tfpar.launch": "--workers",
         "tfpar.server": "--profiler_port"}


@pytest.mark.parametrize("old", sorted(moved.MOVED))
def test_an_old_program_name_runs_the_new_one_with_a_warning(old):
    assert set(FLAGS) == set(moved.MOVED)
    result = subprocess.run([sys.executable, "-W", "default", "-m", old, "--helpshort"],
                            capture_output=True, text=True, timeout=60)
    # (absl's help flags exit with status 1 after printing.)
    assert FLAGS[old] in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]
    assert (f"FutureWarning: `python -m {old}` is deprecated and goes in the next release: "
            f"run `python -m {moved.MOVED[old]}` (same flags).") in result.stderr, result.stderr
