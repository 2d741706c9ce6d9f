"""Code-health figures for spmd/: longest functions, long files, import cycles, the dispatch function.

Run ``python tools/code_metrics.py``. Imports are read from the source (module level and inside
functions alike), so a cycle broken only by a function-level import still counts as a cycle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "spmd"
LONG_FILE_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def function_lengths(tree: ast.AST, prefix: str) -> list[tuple[int, str]]:
    """(lines, qualified name) of every function, methods named through their class."""
    lengths = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}.{node.name}"
            lengths.append((node.end_lineno - node.lineno + 1, name))  # type: ignore[operator]
            lengths.extend(function_lengths(node, name))
        elif isinstance(node, ast.ClassDef):
            lengths.extend(function_lengths(node, f"{prefix}.{node.name}"))
    return lengths


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:`` (imports there never run)."""
    nodes: list[ast.AST] = []
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending.extend(node.orelse)
            continue
        nodes.append(node)
        pending.extend(ast.iter_child_nodes(node))
    return nodes


def imports_of(tree: ast.AST, module: str, modules: set[str]) -> set[str]:
    found: set[str] = set()
    for node in _runtime_nodes(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            if name in modules and name != module:
                found.add(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return components


def main() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    trees = {module_name(p): (p, ast.parse(p.read_text())) for p in files}
    modules = set(trees)
    # A package's __init__ re-exports; importing a package is not a use of every module in it.
    graph = {
        m: {d for d in imports_of(tree, m, modules) if trees[d][0].name != "__init__.py"}
        for m, (_, tree) in trees.items()
        if trees[m][0].name != "__init__.py"
    }
    graph = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    lengths = sorted((length for m, (_, tree) in trees.items() for length in function_lengths(tree, m)), reverse=True)
    long_files = sorted(
        ((len(p.read_text().splitlines()), module_name(p)) for p in files if len(p.read_text().splitlines()) > LONG_FILE_LINES),
        reverse=True,
    )
    dispatch = [n for n in lengths if n[1] == "spmd.tensor.dispatch.dispatcher.Dispatcher.dispatch"]
    total = sum(len(p.read_text().splitlines()) for p in files)
    print(f"spmd/: {len(files)} files, {total} lines")
    print("longest functions: " + ", ".join(f"{name} {n}" for n, name in lengths[:5]))
    print(f"files over {LONG_FILE_LINES} lines: " + (", ".join(f"{name} {n}" for n, name in long_files) or "none"))
    found = cycles(graph)
    print(f"import cycles: {len(found)}" + "".join(f"\n  {' <-> '.join(c)}" for c in found))
    for n, name in dispatch:
        print(f"dispatch function: {name} {n} lines")


if __name__ == "__main__":
    main()
