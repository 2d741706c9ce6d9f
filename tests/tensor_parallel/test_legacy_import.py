"""The legacy path spmd.tensor.parallel holds the very objects of spmd.tensor_parallel, with a warning."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

import spmd.tensor_parallel as tp

# old module -> new module; every name in the new module's __all__ must resolve to the same object
LEGACY_PATHS = {"spmd.tensor.parallel": "spmd.tensor_parallel"}


@pytest.mark.parametrize(("old", "new"), sorted(LEGACY_PATHS.items()))
def test_legacy_path_gives_same_objects_and_warns(old: str, new: str) -> None:
    legacy, current = importlib.import_module(old), importlib.import_module(new)
    assert legacy.__all__ == current.__all__
    for name in current.__all__:
        with pytest.warns(DeprecationWarning, match=rf"import it from {new}\b") as record:
            obj = getattr(legacy, name)
        assert obj is getattr(current, name), name
        assert f"{old}.{name}" in str(record[0].message)


def test_from_import_warns_and_points_at_caller() -> None:
    with pytest.warns(DeprecationWarning, match=re.escape("spmd.tensor_parallel")) as record:
        from spmd.tensor.parallel import ColwiseParallel
    assert ColwiseParallel is tp.ColwiseParallel
    assert record[0].filename == __file__


def test_unknown_name_names_new_path() -> None:
    legacy = importlib.import_module("spmd.tensor.parallel")
    with pytest.raises(AttributeError, match=re.escape("spmd.tensor_parallel")):
        _ = legacy.NoSuchStyle


def test_legacy_path_imports_first() -> None:
    """The legacy path imported first, in a fresh interpreter: no import cycle, and the warning fires."""
    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        "import spmd.tensor.parallel as a, spmd.tensor_parallel as b\n"
        "try:\n    a.RowwiseParallel\nexcept DeprecationWarning as w:\n    assert 'spmd.tensor_parallel' in str(w)\n"
        "else:\n    raise SystemExit('no DeprecationWarning')\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "assert a.RowwiseParallel is b.RowwiseParallel\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
