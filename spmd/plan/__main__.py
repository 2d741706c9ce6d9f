"""``python -m spmd.plan``: see spmd/plan/cli.py."""

import sys

from spmd.plan.cli import main

sys.exit(main())
