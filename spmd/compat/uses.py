"""Where one module's source uses torch's DTensor modules, as the import redirect sees them, and what guards each use.

The source is parsed and rewritten by the redirect's own ``rewrite_imports``; nothing is imported or
run. Every call the rewrite put in place of an import statement or an attribute chain is one use, so
the audit lists exactly what the redirect would change. Two more kinds are added: attribute chains on
a name bound to a redirected module (``tp.ColwiseParallel`` after ``import torch.distributed.tensor.
parallel as tp``), which the rewrite leaves alone because ``tp`` is already spmd's module, and imports
left as written because the caller keeps them torch's (``keep_torch``).

A use is guarded when it does not run, or cannot fail, as the module is imported:

* ``try``: inside the body of a ``try`` whose handlers catch the error the redirect would raise there
  (``ImportError`` for import statements, ``AttributeError`` for attribute chains; ``except
  ModuleNotFoundError`` does not catch ``NoSpmdEquivalentError``);
* ``TYPE_CHECKING``: inside ``if TYPE_CHECKING:``;
* ``function``: inside a function or lambda body, run only when it is called;
* ``annotation``: in an annotation that is never evaluated (``from __future__ import annotations``).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from spmd.compat.module_map import MODULES, NAMES, classify
from spmd.compat.rewrite import RESOLVER, rewrite_imports

__all__ = ["Guard", "Use", "UseKind", "find_uses"]

UseKind = Literal["module", "names", "reexported", "star", "kept"]
"""Which resolve call the redirect makes for the use (``kept``: none, the import stays torch's)."""

Guard = Literal["try", "TYPE_CHECKING", "function", "annotation"]

_CATCH_ALL = frozenset({"Exception", "BaseException"})


@dataclass(frozen=True, slots=True)
class Use:
    """One place a module uses a torch DTensor module or name.

    ``torch_module`` and ``name`` are what the redirect resolves (``names``: ``from torch_module import
    name``; ``reexported``: ``torch_module.name`` of a re-exported DTensor name; ``module`` and ``star``:
    the module, ``name`` empty; ``kept``: the module or, when set, its name); ``attributes`` are looked up
    on the result, an attribute chain's rest (``DTensor`` in ``torch.distributed.tensor.DTensor``).
    """

    kind: UseKind
    torch_module: str
    name: str
    attributes: tuple[str, ...]
    line: int
    guards: tuple[Guard, ...]
    """Outermost first, each once."""


def find_uses(source: bytes | str, filename: str, importer: str, keep_torch: Collection[str] = ()) -> list[Use]:
    """The uses in ``source`` (the module ``importer``), in source order; raises ``SyntaxError`` for
    source that does not parse."""
    tree = ast.parse(source, filename=filename)
    kept = frozenset(keep_torch)
    rewrite_imports(tree, importer, kept)
    scanner = _Scanner(_module_aliases(tree, kept), _lazy_annotations(tree), kept)
    scanner.visit(tree)
    return sorted(scanner.uses, key=lambda use: use.line)


def _resolver_call(node: ast.expr) -> tuple[str, list[str]] | None:
    """``__spmd_compat__.f("a", ..., importer)`` as ``("f", ["a", ...])``: the rewrite's call and its
    constant string arguments (a tuple argument, ``names``' wanted names, is flattened)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    if not (isinstance(node.func.value, ast.Name) and node.func.value.id == RESOLVER):
        return None
    strings: list[str] = []
    for argument in node.args:
        elements = argument.elts if isinstance(argument, ast.Tuple) else [argument]
        strings += [e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return node.func.attr, strings


def _module_aliases(tree: ast.Module, keep_torch: frozenset[str]) -> dict[str, str]:
    """Names the rewritten module binds to a redirected torch module: ``tp`` in ``tp =
    __spmd_compat__.module("torch.distributed.tensor.parallel", ...)``, ``parallel`` in ``from
    torch.distributed.tensor import parallel``."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        call = _resolver_call(node.value)
        target = node.targets[0]
        if call is None:
            continue
        function, strings = call
        if function == "module" and isinstance(target, ast.Name):
            aliases[target.id] = strings[0]
        elif function == "names" and isinstance(target, ast.Tuple):
            module, wanted = strings[0], strings[1:-1]
            for bound, name in zip(target.elts, wanted):
                submodule = f"{module}.{name}"
                is_module = submodule in MODULES or submodule in NAMES
                if isinstance(bound, ast.Name) and is_module and classify(submodule, keep_torch) is not None:
                    aliases[bound.id] = submodule
    return aliases


def _lazy_annotations(tree: ast.Module) -> bool:
    """Whether annotations in this module are never evaluated at import (``from __future__ import
    annotations``, or Python 3.14's deferred annotations)."""
    if sys.version_info >= (3, 14):
        return True
    return any(
        isinstance(node, ast.ImportFrom)
        and node.module == "__future__"
        and any(alias.name == "annotations" for alias in node.names)
        for node in tree.body
    )


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _caught(handlers: list[ast.ExceptHandler]) -> frozenset[str]:
    """The exception class names the handlers name (``"*"`` for a bare ``except:``)."""
    names: set[str] = set()
    for handler in handlers:
        if handler.type is None:
            names.add("*")
            continue
        for kind in handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]:
            if isinstance(kind, ast.Name):
                names.add(kind.id)
            elif isinstance(kind, ast.Attribute):
                names.add(kind.attr)
    return frozenset(names)


class _Scanner(ast.NodeVisitor):
    """Walks a rewritten module, keeping the stack of enclosing guards, and records each use."""

    def __init__(self, aliases: dict[str, str], lazy_annotations: bool, keep_torch: frozenset[str]) -> None:
        self.aliases = aliases
        self.lazy_annotations = lazy_annotations
        self.keep_torch = keep_torch
        # each entry: a guard, or for a try the exception names its handlers catch
        self.stack: list[Guard | frozenset[str]] = []
        self.uses: list[Use] = []

    def _guards(self, error: str) -> tuple[Guard, ...]:
        found: list[Guard] = []
        for entry in self.stack:
            if isinstance(entry, frozenset):
                if not entry.isdisjoint({error, "*", *_CATCH_ALL}):
                    found.append("try")
            else:
                found.append(entry)
        return tuple(dict.fromkeys(found))

    def _record(
        self, kind: UseKind, node: ast.AST, module: str, name: str = "", attributes: tuple[str, ...] = ()
    ) -> None:
        error = "AttributeError" if attributes or kind == "reexported" else "ImportError"
        self.uses.append(Use(kind, module, name, attributes, getattr(node, "lineno", 0), self._guards(error)))

    def _visit_under(self, guard: Guard | frozenset[str], nodes: Sequence[ast.AST]) -> None:
        self.stack.append(guard)
        for node in nodes:
            self.visit(node)
        self.stack.pop()

    # guards

    def visit_Try(self, node: ast.Try) -> None:
        self._visit_under(_caught(node.handlers), list(node.body))
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(part)

    visit_TryStar = visit_Try

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self._visit_under("TYPE_CHECKING", list(node.body))
        for statement in node.orelse:
            self.visit(statement)

    def _annotations(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.expr]:
        arguments = node.args
        every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
        every += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
        found = [a.annotation for a in every if a.annotation is not None]
        return found + ([node.returns] if node.returns is not None else [])

    def _visit_annotations(self, annotations: list[ast.expr]) -> None:
        if self.lazy_annotations:
            self._visit_under("annotation", list(annotations))
        else:
            for annotation in annotations:
                self.visit(annotation)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for decorator in node.decorator_list:
            self.visit(decorator)
        for default in [*node.args.defaults, *node.args.kw_defaults]:
            if default is not None:
                self.visit(default)
        self._visit_annotations(self._annotations(node))
        self._visit_under("function", list(node.body))

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for default in [*node.args.defaults, *node.args.kw_defaults]:
            if default is not None:
                self.visit(default)
        self._visit_under("function", [node.body])

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.visit(node.target)
        self._visit_annotations([node.annotation])
        if node.value is not None:
            self.visit(node.value)

    # uses

    def visit_Attribute(self, node: ast.Attribute) -> None:
        attributes: list[str] = []
        base: ast.expr = node
        while isinstance(base, ast.Attribute):
            attributes.append(base.attr)
            base = base.value
        attributes.reverse()
        if not isinstance(node.ctx, ast.Load):
            attributes.pop()  # `chain.x = value` looks up the chain, then sets x on it
        call = _resolver_call(base)
        if call is not None and call[0] in ("module", "reexported"):
            function, strings = call
            if function == "module":
                self._record("module", node, strings[0], "", tuple(attributes))
            else:
                self._record("reexported", node, strings[0], strings[1], tuple(attributes))
        elif isinstance(base, ast.Name) and base.id in self.aliases and attributes:
            self._record("module", node, self.aliases[base.id], "", tuple(attributes))
        else:
            self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        call = _resolver_call(node)
        if call is None:
            self.generic_visit(node)
            return
        function, strings = call
        if function == "names":
            for name in strings[1:-1]:
                self._record("names", node, strings[0], name)
        elif function == "reexported":
            self._record("reexported", node, strings[0], strings[1])
        elif function in ("module", "star"):
            self._record("module" if function == "module" else "star", node, strings[0])

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if self._kept(alias.name):
                self._record("kept", node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level != 0 or node.module is None:
            return
        for alias in node.names:
            if self._kept(node.module):
                self._record("kept", node, node.module, alias.name)
            elif self._kept(f"{node.module}.{alias.name}"):
                self._record("kept", node, f"{node.module}.{alias.name}")

    def _kept(self, torch_module: str) -> bool:
        """An import the rewrite left as written only because the caller keeps it torch's."""
        return classify(torch_module, self.keep_torch) is None and classify(torch_module) is not None
