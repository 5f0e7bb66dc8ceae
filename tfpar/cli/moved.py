"""Programs that moved: their old `python -m` names still run them, with a warning."""

import runpy
import warnings

# Old module -> new module. The old names go in the release after
# the one that warns.
MOVED = {"tfpar.train": "tfpar.cli.train", "tfpar.launch": "tfpar.cli.launch",
         "tfpar.server": "tfpar.cluster.server"}


def run(old):
    new = MOVED[old]
    warnings.warn(f"`python -m {old}` is deprecated and goes in the next release: run "
                  f"`python -m {new}` (same flags).", FutureWarning, stacklevel=2)
    # Run as `python -m new` runs it: its flags and help are the main module's.
    runpy.run_module(new, run_name="__main__", alter_sys=True)
