"""The legacy path spmd.tensor.parallel holds the very objects of spmd.tensor_parallel."""

from __future__ import annotations

import subprocess
import sys

import spmd.tensor.parallel as legacy
import spmd.tensor_parallel as tp


def test_same_objects() -> None:
    assert legacy.ColwiseParallel is tp.ColwiseParallel
    assert legacy.__all__ == tp.__all__
    for name in tp.__all__:
        assert getattr(legacy, name) is getattr(tp, name), name


def test_legacy_path_imports_first() -> None:
    """The legacy path imported first, in a fresh interpreter: no import cycle through spmd.tensor."""
    code = "import spmd.tensor.parallel as a, spmd.tensor_parallel as b; assert a.RowwiseParallel is b.RowwiseParallel"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
