"""``python -m spmd.simulate``: see spmd/simulate/cli.py."""

import sys

from spmd.simulate.cli import main

sys.exit(main())
