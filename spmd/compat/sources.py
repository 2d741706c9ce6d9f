"""A package's Python source files and their module names, found without importing anything of it.

An installed package is found with ``importlib.util.find_spec`` on its top-level name only (asking for
``a.b`` would import ``a``), then its directory is walked; a dotted name (``spmd_types._dtensor``)
narrows the walk to that subpackage or module. A directory (an unpacked wheel, a checkout) is walked
as it is; module names are relative to it, or to its parent when it is itself a package.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SourceFile", "SourceNotFoundError", "Sources", "find_sources"]


class SourceNotFoundError(LookupError):
    """The target is neither a directory nor the name of an installed package or module."""


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One Python file: its path, the path shown in reports (relative to the base) and its module name."""

    path: Path
    shown: str
    module: str


@dataclass(frozen=True, slots=True)
class Sources:
    """What a target names: a label (the package, or the directory's name), the root walked, its files and
    its version when known (installed metadata, or a ``*.dist-info`` in the folder; else empty)."""

    label: str
    root: str
    files: tuple[SourceFile, ...]
    version: str = ""


def _module_name(relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _walk(root: Path, base: Path) -> list[SourceFile]:
    """Every ``.py`` file at or under ``root``, sorted, skipping hidden folders and ``__pycache__``."""
    if root.is_file():
        found = [root]
    else:
        found = []
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = sorted(s for s in subfolders if not s.startswith(".") and s != "__pycache__")
            found += [Path(folder) / name for name in sorted(names) if name.endswith(".py")]
    return [SourceFile(path, path.relative_to(base).as_posix(), _module_name(path.relative_to(base))) for path in found]


def _installed(name: str) -> list[tuple[Path, Path]]:
    """The roots to walk for the installed ``name``, each with the folder its module names are relative to."""
    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError) as error:
        raise SourceNotFoundError(f"cannot locate {top!r}: {error}") from None
    if spec is None:
        raise SourceNotFoundError(
            f"{name!r} is neither a directory nor an installed package: install it, or give the folder "
            f"holding its source (an unpacked wheel)"
        )
    if spec.submodule_search_locations:
        tops = [Path(location) for location in spec.submodule_search_locations]
    elif spec.origin and spec.origin.endswith(".py"):
        tops = [Path(spec.origin)]
    else:
        raise SourceNotFoundError(f"{top!r} has no Python source to read (it is {spec.origin or 'built in'})")
    roots: list[tuple[Path, Path]] = []
    for location in tops:
        candidate = location.joinpath(*rest)
        found = next((p for p in (candidate, candidate.with_suffix(".py")) if p.exists()), None) if rest else location
        if found is not None:
            roots.append((found, location.parent))
    if not roots:
        raise SourceNotFoundError(f"{name!r}: {top!r} is installed at {tops[0]}, but has no {'.'.join(rest)!r}")
    return roots


def _folder_version(folder: Path) -> str:
    """The version in an unpacked wheel's ``*.dist-info/METADATA``, when the folder holds exactly one."""
    found = sorted(folder.glob("*.dist-info/METADATA")) if folder.is_dir() else []
    if len(found) != 1:
        return ""
    for line in found[0].read_text(errors="replace").splitlines():
        if line.startswith("Version:"):
            return line.partition(":")[2].strip()
    return ""


def _installed_version(top: str) -> str:
    try:
        return importlib.metadata.version(top)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return ""


def find_sources(target: str | os.PathLike[str]) -> Sources:
    """The Python files of ``target``: a directory or file path when one exists, otherwise an installed
    package or module name (dotted names allowed)."""
    path = Path(target)
    if path.exists():
        path = path.resolve()
        base = path.parent if path.is_file() or (path / "__init__.py").exists() else path
        return Sources(path.stem, str(path), tuple(_walk(path, base)), _folder_version(path))
    name = os.fspath(target)
    if not all(part.isidentifier() for part in name.split(".")):
        raise SourceNotFoundError(f"{name!r} is neither an existing path nor a package name")
    roots = _installed(name)
    files = [file for root, base in roots for file in _walk(root, base)]
    roots_shown = os.pathsep.join(str(root) for root, _ in roots)
    return Sources(name, roots_shown, tuple(files), _installed_version(name.partition(".")[0]))
