"""``spmd.compat.audit``: before redirecting a package, list the torch DTensor names it uses and what the
redirect would do with each.

>>> report = spmd.compat.audit("accelerate")  # an installed package; nothing of it is imported  # doctest: +SKIP
>>> report = spmd.compat.audit("/tmp/src/accelerate")  # or a folder: an unpacked wheel  # doctest: +SKIP
>>> print(report.table())  # doctest: +SKIP
>>> report.fails  # True when some name the package uses would fail under the redirect  # doctest: +SKIP

From a shell: ``python -m spmd.compat.audit PKG_OR_DIR [...] [--json | --markdown] [--keep-torch MODULE]``.

The source is read, never imported: each file is rewritten by the redirect's own rewrite
(``spmd.compat.uses``) and each use judged by the redirect's own resolver (``spmd.compat.verdicts``),
so the audit says what ``spmd.compat.redirect`` will do, not a second opinion.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from spmd.compat.module_map import classify
from spmd.compat.sources import SourceFile, SourceNotFoundError, find_sources
from spmd.compat.uses import Guard, find_uses
from spmd.compat.verdicts import Outcome, Verdict, judge

__all__ = ["Audit", "NameReport", "PackageAudit", "Place", "audit", "main"]

_ORDER: dict[Outcome, int] = {"missing": 0, "kept": 1, "torch": 2, "spmd": 3}
_SHOWN = 3
"""Locations a table shows per name (the JSON has them all)."""

LEGEND = (
    "path: default = runs when the module is imported; function = only when that function runs; "
    "try = inside a try whose except catches the failure; TYPE_CHECKING = only for type checkers; "
    "annotation = never evaluated"
)


@dataclass(frozen=True, slots=True)
class Place:
    """Where a name is used, and what guards that use (none: it runs when the module is imported)."""

    file: str
    line: int
    guards: tuple[Guard, ...]

    @property
    def path(self) -> str:
        """``default``, or the guards joined outermost first (``function+try``)."""
        return "+".join(self.guards) or "default"

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True, slots=True)
class NameReport:
    """One torch name a package uses, what the redirect gives for it, and every place it is used."""

    name: str
    outcome: Outcome
    target: str
    error: str
    places: tuple[Place, ...]

    @property
    def fails(self) -> bool:
        """Whether the redirect raises where the name is used."""
        return self.outcome == "missing"

    @property
    def on_default_path(self) -> bool:
        """Whether some use runs when its module is imported."""
        return any(not place.guards for place in self.places)

    @property
    def paths(self) -> str:
        """Uses per path, ``default`` first: ``default 2, function 1``."""
        counts = Counter(place.path for place in self.places)
        ordered = sorted(counts.items(), key=lambda item: (item[0] != "default", -item[1], item[0]))
        return ", ".join(f"{path} {count}" for path, count in ordered)

    @property
    def redirect(self) -> str:
        """What the redirect does, in a few words."""
        if self.outcome == "spmd":
            return self.target
        if self.outcome == "torch":
            return "torch's, on purpose (not DTensor code)"
        if self.outcome == "kept":
            return "torch's (keep_torch)"
        return f"FAILS: {self.target} ({self.error.partition(':')[0]})"

    def where(self, shown: int = _SHOWN) -> str:
        """The first ``shown`` places, those on the default path first, and how many more there are."""
        places = sorted(self.places, key=lambda place: (bool(place.guards), place.file, place.line))
        more = f" (+{len(places) - shown})" if len(places) > shown else ""
        return ", ".join(str(place) for place in places[:shown]) + more


@dataclass(frozen=True, slots=True)
class PackageAudit:
    """The audit of one package or folder."""

    package: str
    root: str
    files: int
    """Python files read."""
    names: tuple[NameReport, ...]
    """Failing names first, then by name."""
    unreadable: tuple[str, ...]
    """``file: why`` for each file that does not parse (it is not audited)."""
    version: str = ""
    """The package's version, when its metadata says."""

    @property
    def failing(self) -> tuple[NameReport, ...]:
        """The names whose use the redirect would fail."""
        return tuple(name for name in self.names if name.fails)

    def summary(self) -> str:
        """One line: what was read, how many names, how many fail and how many of those on the default path."""
        failing = self.failing
        default = sum(name.on_default_path for name in failing)
        version = f" {self.version}" if self.version else ""
        return (
            f"{self.package}{version} ({self.root}, {self.files} files): {len(self.names)} torch DTensor names used; "
            f"{len(failing)} would fail, {default} of them on the default path"
        )


@dataclass(frozen=True, slots=True)
class Audit:
    """What ``spmd.compat.audit`` found: one ``PackageAudit`` per target."""

    packages: tuple[PackageAudit, ...]
    keep_torch: tuple[str, ...] = ()

    @property
    def fails(self) -> bool:
        """Whether some used name, in any package, would fail under the redirect."""
        return any(package.failing for package in self.packages)

    def table(self) -> str:
        """A plain-text table per package, for people."""
        blocks = []
        for package in self.packages:
            rows = [[n.name, n.redirect, str(len(n.places)), n.paths, n.where()] for n in package.names]
            blocks.append(package.summary())
            if rows:
                blocks.append(_aligned(["name", "redirect", "uses", "path", "where"], rows))
            blocks += [f"not read: {line}" for line in package.unreadable]
        return "\n\n".join([*blocks, LEGEND])

    def markdown(self) -> str:
        """Markdown for docs: one package, its table; several, a table of the packages, one of every name
        with the packages that use it, then the failing names with their places."""
        if len(self.packages) == 1:
            (package,) = self.packages
            headers = ["name", "what the redirect does", "uses", "path", "where"]
            rows = [
                [f"`{n.name}`", _md(n.redirect), str(len(n.places)), n.paths, _md(n.where())] for n in package.names
            ]
            return f"{package.summary()}\n\n{_markdown(headers, rows)}"
        by_name: dict[tuple[str, str], list[tuple[str, NameReport]]] = {}
        for package in self.packages:
            for n in package.names:
                by_name.setdefault((n.name, n.redirect), []).append((package.package, n))
        order = sorted(by_name, key=lambda key: (_ORDER[by_name[key][0][1].outcome], key[0]))
        rows = [
            [
                f"`{name}`",
                _md(redirect),
                "; ".join(f"{p} {len(n.places)} ({n.paths})" for p, n in by_name[name, redirect]),
            ]
            for name, redirect in order
        ]
        failing = [[f"`{n.name}`", p.package, n.paths, _md(n.where())] for p in self.packages for n in p.failing]
        overview = [
            [f"{p.package} {p.version}".strip(), str(p.files), str(len(p.names)), str(len(p.failing)),
             str(sum(n.on_default_path for n in p.failing))]
            for p in self.packages
        ]  # fmt: skip
        tables = [
            _markdown(["package", "files read", "names used", "would fail", "of them on the default path"], overview),
            _markdown(["name", "what the redirect does", "used by: uses (path)"], rows),
        ]
        if failing:
            tables.append(_markdown(["fails", "in", "path", "where"], failing))
        return "\n\n".join(tables)

    def as_json(self) -> dict[str, Any]:
        """Everything, every place included, as plain JSON data."""
        return {
            "fails": self.fails,
            "keep_torch": list(self.keep_torch),
            "packages": [
                {
                    "package": package.package,
                    "root": package.root,
                    "version": package.version,
                    "files": package.files,
                    "unreadable": list(package.unreadable),
                    "names": [
                        {
                            "name": n.name,
                            "outcome": n.outcome,
                            "target": n.target,
                            "error": n.error,
                            "fails": n.fails,
                            "default_path": n.on_default_path,
                            "uses": [{"file": p.file, "line": p.line, "guards": list(p.guards)} for p in n.places],
                        }
                        for n in package.names
                    ],
                }
                for package in self.packages
            ],
        }


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def _aligned(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [headers, *rows])


def _markdown(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _audit_file(file: SourceFile, keep_torch: tuple[str, ...]) -> list[tuple[Verdict, Place]]:
    """Each use in ``file`` with its verdict; raises ``SyntaxError`` or ``ValueError`` when it does not parse."""
    data = file.path.read_bytes()
    if b"distributed" not in data:  # every torch DTensor module and alias spells it
        return []
    uses = find_uses(data, str(file.path), file.module, keep_torch)
    return [(judge(use, file.module), Place(file.shown, use.line, use.guards)) for use in uses]


def _audit_package(target: str | os.PathLike[str], keep_torch: tuple[str, ...]) -> PackageAudit:
    sources = find_sources(target)
    by_name: dict[tuple[str, Outcome, str], tuple[Verdict, list[Place]]] = {}
    unreadable = []
    for file in sources.files:
        try:
            found = _audit_file(file, keep_torch)
        except (SyntaxError, ValueError, RecursionError) as error:
            unreadable.append(f"{file.shown}: {type(error).__name__}: {error}")
            continue
        for verdict, place in found:
            by_name.setdefault((verdict.name, verdict.outcome, verdict.target), (verdict, []))[1].append(place)
    names = [
        NameReport(verdict.name, verdict.outcome, verdict.target, verdict.error, tuple(places))
        for verdict, places in by_name.values()
    ]
    names.sort(key=lambda n: (_ORDER[n.outcome], n.name))
    return PackageAudit(
        sources.label, sources.root, len(sources.files), tuple(names), tuple(unreadable), sources.version
    )


def audit(*targets: str | os.PathLike[str], keep_torch: Iterable[str] = ()) -> Audit:
    """List the torch DTensor names each target uses and what ``spmd.compat.redirect`` does with each.

    A target is an installed package or module name (``"accelerate"``, ``"spmd_types._dtensor"``) or a
    folder or file path (an unpacked wheel); its source is read, never imported. ``keep_torch`` is
    ``redirect``'s: the audit then says what ``redirect(..., keep_torch=keep_torch)`` does. Raises
    ``spmd.compat.sources.SourceNotFoundError`` for a target it cannot find.
    """
    kept = tuple(dict.fromkeys(keep_torch))
    for module in kept:
        if classify(module) is None:
            raise ValueError(f"keep_torch={module!r}: not a torch DTensor module the redirect changes; drop it")
    return Audit(tuple(_audit_package(target, kept) for target in targets), kept)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m spmd.compat.audit",
        description="List the torch DTensor names a package uses and what spmd.compat.redirect does with each.",
    )
    parser.add_argument("targets", nargs="+", metavar="PKG_OR_DIR", help="installed package name or source folder")
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="every use, as JSON, for tools")
    form.add_argument("--markdown", action="store_true", help="a Markdown table, for docs")
    parser.add_argument(
        "--keep-torch",
        action="append",
        default=[],
        metavar="MODULE[,MODULE]",
        help="torch modules kept torch's, as redirect(keep_torch=...) keeps them",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the audit command; returns the exit status."""
    parser = _parser()
    options = parser.parse_args(argv)
    keep_torch = [module for value in options.keep_torch for module in value.split(",") if module]
    try:
        report = audit(*options.targets, keep_torch=keep_torch)
    except (SourceNotFoundError, ValueError) as error:
        parser.error(str(error))
    if options.json:
        print(json.dumps(report.as_json(), indent=2))
    elif options.markdown:
        print(report.markdown())
    else:
        print(report.table())
    return 1 if report.fails else 0
