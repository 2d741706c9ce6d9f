#!/usr/bin/env python3
"""Thin wrapper: ``tools/export_to_core.py DEST`` runs ``python -m spmd.tools.export_to_core DEST``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spmd.tools.export_to_core import main

if __name__ == "__main__":
    sys.exit(main())
