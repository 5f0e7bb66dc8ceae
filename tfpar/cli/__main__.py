"""`python -m tfpar.cli`: the `tfpar` console script."""

import sys

from tfpar.cli import main

sys.exit(main())
