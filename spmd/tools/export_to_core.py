"""Mirror this repository into a PyTorch checkout's layout, rewriting imports; rsync-like.

The path map (a file layout, not ``spmd/compat/module_map.py``'s import map) lives in ``core_paths.json``
next to this file: old module -> new module, where ``{root}`` stands for the destination's root package.
File paths follow module names (``spmd/tensor/x.py`` is module ``spmd.tensor.x``); the longest
mapped prefix wins, so ``spmd.testing.common_dtensor`` can move apart from the rest of ``spmd.testing``.

Imports are found with ``ast`` and rewritten at the exact token spans ``tokenize`` reports, so
formatting and comments survive. Module names inside string literals, docstrings and comments
(``logging.getLogger("spmd.tensor.dispatch")``, ``"see spmd/tensor/ops/"``) are rewritten too.

    python -m spmd.tools.export_to_core DEST [--root torch] [--dry-run | --check]
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import keyword
import os
import re
import sys
import tokenize
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "ExportError",
    "ExportPlan",
    "ModuleMap",
    "apply_plan",
    "load_module_map",
    "main",
    "plan_export",
    "rewrite_source",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
PATHS_FILE = Path(__file__).with_name("core_paths.json")
MANIFEST_NAME = ".spmd_export_manifest.json"
SKIPPED_DIRS = frozenset({"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"})
SKIPPED_SUFFIXES = (".pyc", ".pyo")

LINE_LENGTH = 120  # [tool.ruff] line-length: long rewritten imports are wrapped as isort would

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


class ExportError(Exception):
    """The source cannot be exported as is; the message names the file, line and the fix."""


@dataclass(frozen=True)
class ModuleMap:
    """Old dotted module prefixes -> new ones; the longest matching prefix wins."""

    modules: tuple[tuple[str, str], ...]

    @property
    def owned_roots(self) -> frozenset[str]:
        """Top-level packages whose every submodule must be mapped (``spmd``, ``tests``)."""
        return frozenset(old.split(".")[0] for old, _ in self.modules)

    def map_module(self, name: str) -> str | None:
        """``spmd.tensor.dispatch`` -> ``torch.distributed._tensor.dispatch``; None when unmapped."""
        best: tuple[str, str] | None = None
        for old, new in self.modules:
            if (name == old or name.startswith(old + ".")) and (best is None or len(old) > len(best[0])):
                best = (old, new)
        if best is None:
            return None
        return best[1] + name[len(best[0]) :]

    def map_path(self, relpath: str) -> str | None:
        """``spmd/tensor/ops/x.py`` -> ``torch/distributed/_tensor/ops/x.py``; None when unmapped."""
        stem, dot, suffix = relpath.rpartition(".") if relpath.endswith(".py") else (relpath, "", "")
        new = self.map_module(stem.strip("/").replace("/", "."))
        if new is None:
            return None
        trailing = "/" if relpath.endswith("/") else ""
        return new.replace(".", "/") + trailing + dot + suffix

    def dest_dirs(self) -> list[str]:
        """The destination folders (or single files) this export owns."""
        return [new.replace(".", "/") for _, new in self.modules]


def load_module_map(root: str | None = None, paths_file: Path = PATHS_FILE) -> ModuleMap:
    """Read ``core_paths.json``, substituting ``{root}`` (default: the file's ``root``, ``torch``)."""
    data = json.loads(paths_file.read_text())
    root = root or data["root"]
    if not re.fullmatch(rf"{_IDENT}(\.{_IDENT})*", root):
        raise ExportError(f"--root {root!r} is not a dotted package name; use e.g. 'torch' or 'coretorch'")
    return ModuleMap(tuple((old, new.format(root=root)) for old, new in data["modules"].items()))


# ----- the rewriter ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Edit:
    start: int
    end: int
    text: str


class _Source:
    """Offsets into one file's text, from ast (utf-8 byte columns) or tokenize (char columns)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = text.splitlines(keepends=True)
        self.line_starts = [0]
        for line in self.lines:
            self.line_starts.append(self.line_starts[-1] + len(line))
        self.tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))

    def offset(self, lineno: int, col: int) -> int:
        return self.line_starts[lineno - 1] + col

    def ast_offset(self, lineno: int, byte_col: int) -> int:
        line = self.lines[lineno - 1] if lineno - 1 < len(self.lines) else ""
        return self.offset(lineno, len(line.encode()[:byte_col].decode(errors="replace")))

    def node_span(self, node: ast.AST) -> tuple[int, int]:
        start = self.ast_offset(node.lineno, node.col_offset)  # type: ignore[attr-defined]
        end = self.ast_offset(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]
        return start, end

    def tokens_in(self, start: int, end: int) -> list[tokenize.TokenInfo]:
        return [
            t
            for t in self.tokens
            if start <= self.offset(*t.start) and self.offset(*t.end) <= end
            and t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)
        ]

    def tok_start(self, tok: tokenize.TokenInfo) -> int:
        return self.offset(*tok.start)

    def tok_end(self, tok: tokenize.TokenInfo) -> int:
        return self.offset(*tok.end)


def _dotted_span(src: _Source, toks: Sequence[tokenize.TokenInfo]) -> tuple[int, int]:
    """Span of the leading dotted name (dots and names) in ``toks``, up to ``as`` / ``import`` / ``,``."""
    taken: list[tokenize.TokenInfo] = []
    for tok in toks:
        is_name = tok.type == tokenize.NAME and not keyword.iskeyword(tok.string)
        if is_name or (tok.type == tokenize.OP and set(tok.string) == {"."}):
            taken.append(tok)
        else:
            break
    if not taken:
        raise ExportError(f"line {toks[0].start[0] if toks else '?'}: no module name where one was expected")
    return src.tok_start(taken[0]), src.tok_end(taken[-1])


def _resolve_relative(package: str, level: int, module: str | None) -> str:
    parts = package.split(".") if package else []
    if level - 1 > len(parts):
        raise ExportError(f"relative import beyond the top-level package {package!r}")
    base = parts[: len(parts) - (level - 1)]
    return ".".join([*base, *([module] if module else [])])


def _dotted_name(node: ast.expr) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return parts[::-1]
    return None


@dataclass
class _Rewriter:
    src: _Source
    mapping: ModuleMap
    module: str
    is_package: bool
    known_modules: frozenset[str]
    filename: str
    edits: list[_Edit] = field(default_factory=list)
    bound_roots: set[str] = field(default_factory=set)
    line_length: int = LINE_LENGTH

    def fail(self, node: ast.AST, why: str) -> ExportError:
        return ExportError(f"{self.filename}:{getattr(node, 'lineno', '?')}: {why}")

    def owned(self, name: str) -> bool:
        return name.split(".")[0] in self.mapping.owned_roots

    def map_or_fail(self, node: ast.AST, name: str) -> str:
        new = self.mapping.map_module(name)
        if new is None:
            raise self.fail(node, f"{name!r} has no destination; add it to {PATHS_FILE.name} or stop importing it")
        return new

    def visit_import(self, node: ast.Import) -> None:
        for alias in node.names:
            if not self.owned(alias.name):
                continue
            new = self.map_or_fail(node, alias.name)
            start, end = self.src.node_span(alias)
            name_start, name_end = _dotted_span(self.src, self.src.tokens_in(start, end))
            self.edits.append(_Edit(name_start, name_end, new))
            if alias.asname is None:
                self.bound_roots.add(alias.name.split(".")[0])

    def visit_import_from(self, node: ast.ImportFrom) -> None:
        package = self.module if self.is_package else self.module.rpartition(".")[0]
        target = _resolve_relative(package, node.level, node.module) if node.level else (node.module or "")
        if not self.owned(target):
            return
        names_are_modules = all(f"{target}.{a.name}" in self.known_modules for a in node.names)
        new_target = self.mapping.map_module(target) if names_are_modules else self.map_or_fail(node, target)
        # Names that are submodules moving somewhere other than under new_target must be split out.
        groups: dict[str | None, list[ast.alias]] = {}
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            new_sub = self.mapping.map_module(sub) if sub in self.known_modules else None
            home = new_sub.rpartition(".")[0] if new_sub and new_sub != f"{new_target}.{alias.name}" else new_target
            if home is None:
                raise self.fail(node, f"{target}.{alias.name} has no destination; add it to {PATHS_FILE.name}")
            if new_sub and new_sub.rpartition(".")[2] != alias.name:
                raise self.fail(node, f"{sub} is renamed to {new_sub}; import it as `import {target}.{alias.name}`")
            groups.setdefault(home, []).append(alias)
        start, end = self.src.node_span(node)
        if len(groups) > 1 or new_target not in groups:
            statements = [
                f"from {home} import "
                + ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in aliases)
                for home, aliases in groups.items()
                if home is not None
            ]
            self.edits.append(_Edit(start, end, "; ".join(statements)))
            return
        if new_target is None:
            raise self.fail(node, f"{target!r} has no destination; add it to {PATHS_FILE.name}")
        if node.level:
            new_module = self.mapping.map_module(self.module) or self.module
            new_package = new_module if self.is_package else new_module.rpartition(".")[0]
            try:
                if _resolve_relative(new_package, node.level, node.module) == new_target:
                    return  # the relative import stays inside one moved package: keep it
            except ExportError:
                pass
        toks = self.src.tokens_in(start, end)
        if self.wrap_long_import(node, start, end, new_target):
            return
        after_from = next(i for i, t in enumerate(toks) if t.type == tokenize.NAME and t.string == "from") + 1
        mod_start, mod_end = _dotted_span(self.src, toks[after_from:])
        self.edits.append(_Edit(mod_start, mod_end, new_target))

    def wrap_long_import(self, node: ast.ImportFrom, start: int, end: int, new_target: str) -> bool:
        """Rewrite a one-line ``from X import a, b`` that grows past the line length as isort wraps it."""
        line = self.src.lines[node.lineno - 1]
        if node.end_lineno != node.lineno or "(" in line or "#" in line or line[: node.col_offset].strip():
            return False
        names = [a.name + (f" as {a.asname}" if a.asname else "") for a in node.names]
        one_line = f"from {new_target} import {', '.join(names)}"
        if node.col_offset + len(one_line) <= self.line_length:
            return False
        indent = line[: node.col_offset]
        body = "".join(f"{indent}    {n},\n" for n in names)
        self.edits.append(_Edit(start, end, f"from {new_target} import (\n{body}{indent})"))
        return True

    def visit_names(self, tree: ast.AST) -> None:
        """``spmd.tensor.DTensor`` after ``import spmd.tensor``: rewrite the module part of the chain."""
        if not self.bound_roots:
            return
        stack: list[ast.AST] = [tree]
        while stack:
            node = stack.pop()
            if isinstance(node, ast.Attribute | ast.Name):
                parts = _dotted_name(node)
                if parts and parts[0] in self.bound_roots:
                    self.rewrite_chain(node, parts)
                    continue
            if isinstance(node, ast.Import | ast.ImportFrom):
                continue
            stack.extend(ast.iter_child_nodes(node))

    def rewrite_chain(self, node: ast.expr, parts: list[str]) -> None:
        # Mapping is by prefix, so the whole chain maps as its module part does.
        if len(parts) == 1:
            raise self.fail(node, f"`{parts[0]}` is used bare; name a mapped module such as `{parts[0]}.tensor`")
        start, end = self.src.node_span(node)
        self.edits.append(_Edit(start, end, self.map_or_fail(node, ".".join(parts))))

    def visit_text_tokens(self) -> None:
        """Module names and repo paths inside strings, docstrings and comments."""
        text_types = {tokenize.STRING, tokenize.COMMENT}
        text_types.update({getattr(tokenize, "FSTRING_MIDDLE", -1), getattr(tokenize, "TSTRING_MIDDLE", -1)})
        roots = "|".join(sorted(re.escape(r) for r in self.mapping.owned_roots))
        dotted = re.compile(rf"(?<![\w.])(?:{roots})(?:\.{_IDENT})+")
        slashed = re.compile(rf"(?<![\w/.])(?:{roots})(?:/{_IDENT})+(?:\.py|/)?")
        # ``from spmd import checkpoint`` in a docstring example: the package and the name together
        from_import = re.compile(rf"\bfrom\s+((?:{roots})(?:\.{_IDENT})*)\s+import\s+({_IDENT})\b")
        for tok in self.src.tokens:
            if tok.type not in text_types:
                continue
            base = self.src.tok_start(tok)
            taken: list[tuple[int, int]] = []
            for match in from_import.finditer(tok.string):
                new = self.mapping.map_module(f"{match.group(1)}.{match.group(2)}")
                if new is not None and "." in new and new.rpartition(".")[0] != self.mapping.map_module(match.group(1)):
                    package, _, name = new.rpartition(".")
                    self.edits.append(
                        _Edit(base + match.start(), base + match.end(), f"from {package} import {name}")
                    )
                    taken.append(match.span())
            for pattern, mapper in ((dotted, self.mapping.map_module), (slashed, self.mapping.map_path)):
                for match in pattern.finditer(tok.string):
                    if any(start <= match.start() < end for start, end in taken):
                        continue
                    new = mapper(match.group(0))
                    if new is not None and new != match.group(0):
                        self.edits.append(_Edit(base + match.start(), base + match.end(), new))


def rewrite_source(
    text: str,
    *,
    module: str,
    mapping: ModuleMap,
    is_package: bool = False,
    known_modules: frozenset[str] = frozenset(),
    filename: str = "<string>",
) -> str:
    """Rewrite one Python file's imports and module-name strings from old to new names.

    ``module`` is the file's own (old) dotted name, used to resolve relative imports;
    ``known_modules`` is every old module in the export, used to tell submodules from names.
    """
    try:
        tree = ast.parse(text, filename=filename)
    except SyntaxError as err:
        raise ExportError(f"{filename}: cannot parse ({err}); fix the syntax error first") from err
    rewriter = _Rewriter(_Source(text), mapping, module, is_package, known_modules, filename)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            rewriter.visit_import(node)
        elif isinstance(node, ast.ImportFrom):
            rewriter.visit_import_from(node)
    rewriter.visit_names(tree)
    rewriter.visit_text_tokens()
    out = text
    last_start = len(text) + 1
    for edit in sorted(set(rewriter.edits), key=lambda e: e.start, reverse=True):
        if edit.end > last_start:
            raise ExportError(f"{filename}: overlapping rewrites at offset {edit.start}; report this as a bug")
        out = out[: edit.start] + edit.text + out[edit.end :]
        last_start = edit.start
    return out


# ----- planning and applying -------------------------------------------------------------------


@dataclass(frozen=True)
class ExportPlan:
    """What an export would do to DEST: relative paths added, changed and deleted."""

    dest: Path
    files: dict[str, bytes]
    added: tuple[str, ...]
    changed: tuple[str, ...]
    deleted: tuple[str, ...]

    @property
    def is_noop(self) -> bool:
        return not (self.added or self.changed or self.deleted)

    def summary(self) -> str:
        lines = [f"added   {p}" for p in self.added]
        lines += [f"changed {p}" for p in self.changed]
        lines += [f"deleted {p}" for p in self.deleted]
        return "\n".join(lines) if lines else "up to date"


def _source_files(repo: Path, mapping: ModuleMap) -> Iterator[Path]:
    seen: set[Path] = set()
    for old, _ in mapping.modules:
        base = repo / old.replace(".", "/")
        candidates = [base.with_suffix(".py")] if base.with_suffix(".py").is_file() else []
        if base.is_dir():
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS and not d.startswith("."))
                candidates += [Path(dirpath) / f for f in sorted(filenames) if not f.endswith(SKIPPED_SUFFIXES)]
        for path in candidates:
            if path not in seen:
                seen.add(path)
                yield path


def _module_name(relpath: str) -> tuple[str, bool]:
    stem = relpath.removesuffix(".py")
    if stem.endswith("/__init__"):
        return stem.removesuffix("/__init__").replace("/", "."), True
    return stem.replace("/", "."), False


def _read_manifest(dest: Path) -> list[str]:
    path = dest / MANIFEST_NAME
    if not path.is_file():
        return []
    return list(json.loads(path.read_text()).get("files", []))


def plan_export(dest: Path, *, mapping: ModuleMap, repo: Path = REPO_ROOT) -> ExportPlan:
    """Compute the exported bytes of every file and compare them with DEST (writes nothing)."""
    sources = {p.relative_to(repo).as_posix(): p for p in _source_files(repo, mapping)}
    known = frozenset(_module_name(rel)[0] for rel in sources if rel.endswith(".py"))
    files: dict[str, bytes] = {}
    for rel, path in sources.items():
        new_rel = mapping.map_path(rel)
        if new_rel is None:
            continue
        data = path.read_bytes()
        if rel.endswith(".py"):
            module, is_package = _module_name(rel)
            text = rewrite_source(
                data.decode(), module=module, mapping=mapping, is_package=is_package, known_modules=known, filename=rel
            )
            data = text.encode()
        if new_rel in files:
            raise ExportError(f"{rel} and another file both map to {new_rel}; fix {PATHS_FILE.name}")
        files[new_rel] = data
    manifest = {"generated_by": "spmd.tools.export_to_core", "files": sorted(files)}
    files[MANIFEST_NAME] = (json.dumps(manifest, indent=1) + "\n").encode()
    added, changed = [], []
    for rel, data in sorted(files.items()):
        target = dest / rel
        if not target.is_file():
            added.append(rel)
        elif target.read_bytes() != data:
            changed.append(rel)
    owned_dirs = mapping.dest_dirs()
    deleted = sorted(
        rel
        for rel in _read_manifest(dest)
        if rel not in files
        and (dest / rel).is_file()
        and any(rel == d + ".py" or rel.startswith(d + "/") for d in owned_dirs)
    )
    return ExportPlan(dest, files, tuple(added), tuple(changed), tuple(deleted))


def apply_plan(plan: ExportPlan) -> None:
    """Write added/changed files and delete the ones the manifest owns that are gone upstream."""
    for rel in (*plan.added, *plan.changed):
        target = plan.dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(plan.files[rel])
    for rel in plan.deleted:
        target = plan.dest / rel
        target.unlink()
        parent = target.parent
        while parent != plan.dest and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: export, ``--dry-run`` to list changes, ``--check`` to fail on drift."""
    parser = argparse.ArgumentParser(prog="python -m spmd.tools.export_to_core", description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, help="root of the PyTorch checkout (or any folder) to export into")
    parser.add_argument("--root", default=None, help="root package of the destination (default: torch)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="list what would be added/changed/deleted; write nothing")
    mode.add_argument("--check", action="store_true", help="exit 1 when DEST differs from a fresh export")
    args = parser.parse_args(argv)
    try:
        plan = plan_export(args.dest.resolve(), mapping=load_module_map(args.root))
    except ExportError as err:
        print(f"export_to_core: {err}", file=sys.stderr)
        return 2
    if args.check:
        if plan.is_noop:
            print(f"{args.dest}: up to date")
            return 0
        print(f"{args.dest} has drifted from the spmd sources; run export_to_core without --check:\n{plan.summary()}")
        return 1
    print(plan.summary())
    if not args.dry_run:
        apply_plan(plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
