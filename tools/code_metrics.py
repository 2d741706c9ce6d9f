"""Code-health figures for spmd/: import circles, late-bound slots, long files and long functions.

    python tools/code_metrics.py [PACKAGE_DIR=spmd]

Every import is an edge: at module level, inside functions and under ``if TYPE_CHECKING:`` alike
(the rule of ../shared/tools/import_circles.py, so ``circles: N`` agrees with it). A circle broken
only by a late import is still a circle.

A late-bound slot is a module-level name whose value another module supplies after import:

* what it is: a one-element box (a list literal of at most one element that is read as ``x[0]``),
  a None-initialised global (``x: T | None = None``), or an instance of a class of the same module
  that declares a field defaulting to None (a board of hooks, like spmd/hooks.py's ``HOOKS``);
* who fills it: another module stores into it (``mod.x = v``, ``mod.x[:] = [v]``, ``x.attr = v``
  or ``x.append(v)`` after ``from mod import x``), or calls a function of its module that stores one
  of its own parameters there (``global x; x = v``, ``x[0] = v``, ``x.attr = v``) and does not clear
  it again in the same call (a value scoped to one call, as a context manager sets it, binds nothing).

A slot's reason is the docstring under its assignment (else the comment above it).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

LONG_FILE_LINES = 500
LONG_FUNCTION_LINES = 60
FILE_EXCEPTIONS = {"spmd.testing.op_sweep": "the op sweep's tables, for file length only"}
DISPATCH = "spmd.tensor.dispatch.dispatcher.Dispatcher.dispatch"
_FILLING_METHODS = frozenset({"append", "extend", "insert"})
FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass
class Module:
    """One source file: its name, tree, lines and the names its imports bind."""

    name: str
    path: Path
    tree: ast.Module
    lines: list[str]
    is_package: bool
    aliases: dict[str, str] = field(default_factory=dict)
    """Local name -> the dotted module or ``module.name`` it was imported as."""

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


@dataclass
class Slot:
    """A late-bound slot: where it is, what kind, who fills it, and why it exists."""

    module: str
    name: str
    kind: str
    reason: str
    fillers: set[str] = field(default_factory=set)


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def load(root: Path) -> dict[str, Module]:
    modules = {}
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        name = module_name(root, path)
        modules[name] = Module(name, path, ast.parse(text), text.splitlines(), path.name == "__init__.py")
    for module in modules.values():
        module.aliases = _aliases(module)
    return modules


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    up = module.package.split(".")
    up = up[: len(up) - (node.level - 1)]
    return ".".join(up + ([node.module] if node.module else []))


def _aliases(module: Module) -> dict[str, str]:
    aliases: dict[str, str] = {}
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            aliases.update({a.asname or a.name: f"{base}.{a.name}" for a in node.names if a.name != "*"})
    return aliases


# ----- import circles ------------------------------------------------------------------------------
def import_edges(modules: dict[str, Module]) -> dict[str, set[str]]:
    """Module -> the modules it imports, every import counted; ``from pkg import sub`` is an edge to pkg.sub."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, module in modules.items():
        for node in ast.walk(module.tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


def circles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan); a package's __init__ is left out."""
    graph = {
        m: {d for d in deps if not modules[d].is_package}
        for m, deps in import_edges(modules).items()
        if not modules[m].is_package
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
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


# ----- late-bound slots ----------------------------------------------------------------------------
def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` -> ["a", "b", "c"]; None for anything but names and attributes."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _resolve(module: Module, node: ast.expr, modules: dict[str, Module]) -> tuple[str, list[str]] | None:
    """The (module, [global, attributes...]) a name chain refers to, through the file's imports."""
    parts = _chain(node)
    if parts is None:
        return None
    if parts[0] not in module.aliases:
        return module.name, parts
    dotted = module.aliases[parts[0]].split(".") + parts[1:]
    for cut in range(len(dotted) - 1, 0, -1):
        if ".".join(dotted[:cut]) in modules:
            return ".".join(dotted[:cut]), dotted[cut:]
    return None


def _slot_kind(module: Module, value: ast.expr | None) -> str | None:
    """What a module-level value is as a slot candidate (see the module docstring), or None."""
    if isinstance(value, ast.Constant) and value.value is None:
        return "None-initialised"
    if isinstance(value, ast.List) and len(value.elts) <= 1:
        return "box"
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
        for node in module.tree.body:
            if isinstance(node, ast.ClassDef) and node.name == value.func.id:
                fields = [s for s in node.body if isinstance(s, ast.AnnAssign)]
                if any(isinstance(f.value, ast.Constant) and f.value.value is None for f in fields):
                    return "board: " + ", ".join(f.target.id for f in fields if isinstance(f.target, ast.Name))
    return None


def _reason(module: Module, index: int, node: ast.stmt) -> str:
    after = module.tree.body[index + 1] if index + 1 < len(module.tree.body) else None
    if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
        return " ".join(after.value.value.split())
    above: list[str] = []
    for line in reversed(module.lines[: node.lineno - 1]):
        if not line.lstrip().startswith("#"):
            break
        above.insert(0, line.strip().lstrip("# "))
    return " ".join(above) or "no reason written: put a docstring under the assignment"


def slot_candidates(module: Module) -> Iterator[Slot]:
    """Module-level boxes, None-initialised globals and boards of ``module`` (not yet known to be filled)."""
    for index, node in enumerate(module.tree.body):
        if not isinstance(node, (ast.Assign, ast.AnnAssign)):
            continue
        kind = _slot_kind(module, node.value)
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
            if kind and isinstance(target, ast.Name):
                yield Slot(module.name, target.id, kind, _reason(module, index, node))


def _is_indexed(name: str, modules: dict[str, Module], owner: str) -> bool:
    """Whether some module reads ``owner.name`` as ``x[constant]`` (how a box is used)."""
    for module in modules.values():
        for node in ast.walk(module.tree):
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.slice, ast.Constant)
                and _resolve(module, node.value, modules) == (owner, [name])
            ):
                return True
    return False


@dataclass(frozen=True)
class Store:
    """One store into a module global after import: by another module, or by a function of its own."""

    owner: str
    name: str
    by: str
    function: str | None
    from_parameter: bool
    clears: bool


def _targets(node: ast.stmt) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        found = [node.target]
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        func = node.value.func  # x.append(v) fills a box as x[0] = v does
        found = []
        if isinstance(func, ast.Attribute) and func.attr in _FILLING_METHODS:
            found = [ast.Subscript(func.value, ast.Constant(0), ast.Store())]
    else:
        return []
    flat: list[ast.expr] = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        else:
            flat.append(target.value if isinstance(target, ast.Starred) else target)
    return flat


def _stored_value(node: ast.stmt) -> ast.expr | None:
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        return node.value.args[0] if node.value.args else None
    return getattr(node, "value", None)


def _stored(
    module: Module, target: ast.expr, modules: dict[str, Module], declared: set[str], local: set[str]
) -> tuple[str, str] | None:
    """The (module, global) a store target writes into; None for locals."""
    if isinstance(target, ast.Name):
        return (module.name, target.id) if target.id in declared else None
    inner = target.value if isinstance(target, ast.Subscript) else target
    parts = _chain(inner)
    if parts is None or parts[0] in local:
        return None
    resolved = _resolve(module, inner, modules)
    return None if resolved is None else (resolved[0], resolved[1][0])


def stores(module: Module, modules: dict[str, Module]) -> Iterator[Store]:
    """Every store ``module`` makes into a global of its own (inside a function) or of another module."""
    functions = [t for t in module.tree.body if isinstance(t, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for function in functions:
        yield from _stores(module, modules, list(ast.walk(function)), function)
    rest = [n for t in module.tree.body if t not in functions for n in ast.walk(t)]
    yield from _stores(module, modules, rest, None)


def _stores(
    module: Module, modules: dict[str, Module], nodes: list[ast.AST], function: FunctionNode | None
) -> Iterator[Store]:
    """The stores among ``nodes``: one module-level function's (nested code included), or the module's other code."""
    arguments = function.args if function else None
    params = {a.arg for a in (arguments.posonlyargs + arguments.args + arguments.kwonlyargs)} if arguments else set()
    declared = {n for g in nodes if isinstance(g, ast.Global) for n in g.names}
    assigned = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    local = (params | assigned) - declared if function else set()
    for node in nodes:
        if not isinstance(node, ast.stmt):
            continue
        value = _stored_value(node)
        for target in _targets(node):
            where = _stored(module, target, modules, declared, local)
            if where is None or (where[0] == module.name and function is None):
                continue  # a local, or the module's own import-time code
            yield Store(
                owner=where[0],
                name=where[1],
                by=module.name,
                function=function.name if function else None,
                from_parameter=isinstance(value, ast.Name) and value.id in params,
                clears=isinstance(value, ast.Constant) and value.value is None,
            )


def references(modules: dict[str, Module]) -> dict[tuple[str, str], set[str]]:
    """(module, global) -> the other modules that name it (imported, or read through the module)."""
    found: dict[tuple[str, str], set[str]] = {}
    for module in modules.values():
        for target in module.aliases.values():
            owner, _, name = target.rpartition(".")
            if owner in modules and owner != module.name:
                found.setdefault((owner, name), set()).add(module.name)
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                resolved = _resolve(module, node, modules)
                if resolved and resolved[0] != module.name and len(resolved[1]) == 1:
                    found.setdefault((resolved[0], resolved[1][0]), set()).add(module.name)
    return found


def late_bound_slots(modules: dict[str, Module]) -> list[Slot]:
    """The slots (module docstring) another module fills, with who fills each."""
    all_stores = [s for m in modules.values() for s in stores(m, modules)]
    referenced = references(modules)
    slots = []
    for module in modules.values():
        for slot in slot_candidates(module):
            if slot.kind == "box" and not _is_indexed(slot.name, modules, slot.module):
                continue  # a list that is iterated (observers), not read as one value
            mine = [s for s in all_stores if (s.owner, s.name) == (slot.module, slot.name)]
            for store in mine:
                if store.by != slot.module:
                    slot.fillers.add(store.by)
                elif store.from_parameter and not any(s.function == store.function and s.clears for s in mine):
                    callers = referenced.get((slot.module, store.function or ""), set())
                    slot.fillers.update(f"{slot.module}.{store.function} from {c}" for c in sorted(callers))
            if slot.fillers:
                slots.append(slot)
    return slots


# ----- lengths -------------------------------------------------------------------------------------
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


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "spmd").resolve()
    modules = load(root)
    total = sum(len(m.lines) for m in modules.values())
    lengths = sorted((n for m in modules.values() for n in function_lengths(m.tree, m.name)), reverse=True)
    print(f"{root.name}/: {len(modules)} files, {total} lines")
    found = circles(modules)
    print(f"circles: {len(found)}" + "".join(f"\n  {' <-> '.join(c)}" for c in found))
    slots = late_bound_slots(modules)
    print(f"late-bound slots: {len(slots)}")
    for slot in slots:
        print(f"  {slot.module}.{slot.name} ({slot.kind}), filled by {'; '.join(sorted(slot.fillers))}")
        print(f"    why: {slot.reason}")
    long_files = sorted(
        ((len(m.lines), m.name) for m in modules.values() if len(m.lines) > LONG_FILE_LINES), reverse=True
    )
    listed = [
        f"{name} {n}" + (f" (excepted: {FILE_EXCEPTIONS[name]})" if name in FILE_EXCEPTIONS else "")
        for n, name in long_files
    ]
    print(f"files over {LONG_FILE_LINES} lines: " + (", ".join(listed) or "none"))
    long_functions = [f"{name} {n}" for n, name in lengths if n > LONG_FUNCTION_LINES]
    print(f"functions over {LONG_FUNCTION_LINES} lines: " + (", ".join(long_functions) or "none"))
    print("longest functions: " + ", ".join(f"{name} {n}" for n, name in lengths[:5]))
    for n, name in lengths:
        if name == DISPATCH:
            print(f"dispatch function: {name} {n} lines")


if __name__ == "__main__":
    main()
