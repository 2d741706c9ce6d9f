"""A fixture that writes small third-party packages into ``tmp_path``: stand-ins for code we cannot edit."""

from __future__ import annotations

import importlib
import re
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import spmd.compat

MakePackage = Callable[..., str]


@pytest.fixture
def third_party(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MakePackage]:
    """``third_party({"__init__.py": src, "model.py": src}, redirect=True)`` writes a package with a name
    unique to the test, puts it on ``sys.path``, redirects it unless told not to, and returns its name.
    Afterwards the packages are undone and forgotten."""
    made: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(files: dict[str, str], *, redirect: bool = True) -> str:
        name = re.sub(r"\W", "_", f"thirdparty{len(made)}_{tmp_path.name}")
        for path, source in files.items():
            target = tmp_path / name / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(textwrap.dedent(source).lstrip("\n"))
        importlib.invalidate_caches()
        made.append(name)
        if redirect:
            spmd.compat.redirect(name)
        return name

    yield make
    spmd.compat.undo(*made)
