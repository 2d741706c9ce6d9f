"""Rewrite one module's syntax tree so that its imports of torch's DTensor modules reach spmd's.

Each statement that names a redirected torch module becomes a call into ``spmd.compat.resolve``,
bound as ``__spmd_compat__`` by one import the rewrite adds after the docstring and ``__future__``
imports::

    from torch.distributed.tensor import DTensor, Shard as S   ->  (DTensor, S) = __spmd_compat__.names(...)
    import torch.distributed.tensor.parallel as tp              ->  tp = __spmd_compat__.module(...)
    import torch.distributed.tensor                             ->  import torch.distributed; __spmd_compat__.module(...)
    torch.distributed.tensor.DTensor  (in code)                 ->  __spmd_compat__.module(...).DTensor
    from torch.distributed import init_device_mesh              ->  (init_device_mesh,) = __spmd_compat__.names(...)
    dist.init_device_mesh  (in code, a re-exported name)        ->  __spmd_compat__.reexported(...)

New nodes take the location of the statement or expression they replace, so tracebacks and
``linecache`` point at the real source. Relative imports and every other import stay as written.
"""

from __future__ import annotations

import ast

from spmd.compat.module_map import MODULES, NAMES, SHADOWED, TORCH_FALLBACK, ModuleKind, classify, reexport

__all__ = ["RESOLVER", "rewrite_imports"]

RESOLVER = "__spmd_compat__"
"""The global a rewritten module binds to ``spmd.compat.resolve`` (a dunder name: never mangled in a class)."""


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything that is not a plain name chain."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def _is_torch(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


def _torch_aliases(tree: ast.Module, keep_torch: frozenset[str]) -> dict[str, str]:
    """Names bound to torch or to a torch package that is not redirected (``import torch.distributed as
    dist``), whose attribute chains may reach a redirected module (``dist.tensor.DTensor``)."""
    aliases = {"torch": "torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and _is_torch(alias.name) and classify(alias.name, keep_torch) is None:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _is_torch(node.module):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if alias.name != "*" and classify(full, keep_torch) is None:
                    aliases[alias.asname or alias.name] = full
    return aliases


class _ImportRewriter(ast.NodeTransformer):
    def __init__(self, importer: str, keep_torch: frozenset[str], aliases: dict[str, str]) -> None:
        self.importer = importer
        self.keep_torch = keep_torch
        self.aliases = aliases
        self.changed = False

    def _call(self, function: str, *args: ast.expr) -> ast.Call:
        self.changed = True
        attribute = ast.Attribute(value=ast.Name(id=RESOLVER, ctx=ast.Load()), attr=function, ctx=ast.Load())
        return ast.Call(func=attribute, args=[*args, ast.Constant(self.importer)], keywords=[])

    def _kept(self, torch_module: str) -> bool:
        return any(torch_module == k or torch_module.startswith(k + ".") for k in self.keep_torch)

    def _kind(self, torch_module: str) -> ModuleKind | None:
        return classify(torch_module, self.keep_torch)

    def _module(self, torch_module: str) -> ast.Call:
        return self._call("module", ast.Constant(torch_module))

    def visit_Import(self, node: ast.Import) -> list[ast.stmt]:
        statements: list[ast.stmt] = []
        kept: list[ast.alias] = []

        def flush() -> None:
            if kept:
                statements.append(ast.Import(names=list(kept)))
                kept.clear()

        for alias in node.names:
            kind = self._kind(alias.name)
            if kind is None or (alias.asname is None and alias.name in TORCH_FALLBACK):
                kept.append(alias)  # torch's own module; attribute chains into it are rewritten below
                continue
            flush()
            if alias.asname is not None:
                target = ast.Name(id=alias.asname, ctx=ast.Store())
                statements.append(ast.Assign(targets=[target], value=self._module(alias.name)))
            else:
                # `import a.b.c` binds `a` and loads every package on the way: import the torch ones,
                # then resolve the redirected one (so a module spmd lacks fails here, as the import would).
                parts = alias.name.split(".")
                ancestor = next(
                    ".".join(parts[:i])
                    for i in range(len(parts) - 1, 0, -1)
                    if self._kind(".".join(parts[:i])) is None or ".".join(parts[:i]) in TORCH_FALLBACK
                )
                statements.append(ast.Import(names=[ast.alias(name=ancestor)]))
                statements.append(ast.Expr(value=self._module(alias.name)))
        flush()
        return [ast.copy_location(statement, node) for statement in statements]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.stmt | list[ast.stmt]:
        if node.level != 0 or node.module is None:
            return node
        if self._kind(node.module) is not None:
            statements = self._from_redirected_module(node, node.module)
        else:
            statements = self._from_torch_package(node, node.module)
        return [ast.copy_location(statement, node) for statement in statements]

    def _from_redirected_module(self, node: ast.ImportFrom, module: str) -> list[ast.stmt]:
        """``from torch.distributed.tensor import DTensor, Shard as S``: every name resolves to spmd's,
        except a submodule the caller keeps torch's, imported as written."""
        if [alias.name for alias in node.names] == ["*"]:
            namespace = ast.Call(func=ast.Name(id="globals", ctx=ast.Load()), args=[], keywords=[])
            return [ast.Expr(value=self._call("star", namespace, ast.Constant(module)))]
        kept = [a for a in node.names if self._kept(f"{module}.{a.name}")]
        taken = [a for a in node.names if a not in kept]
        statements: list[ast.stmt] = [ast.ImportFrom(module=module, names=kept, level=0)] if kept else []
        if taken:
            targets: list[ast.expr] = [ast.Name(id=a.asname or a.name, ctx=ast.Store()) for a in taken]
            wanted = ast.Tuple(elts=[ast.Constant(a.name) for a in taken], ctx=ast.Load())
            value = self._call("names", ast.Constant(module), wanted)
            statements.append(ast.Assign(targets=[ast.Tuple(elts=targets, ctx=ast.Store())], value=value))
        return statements

    def _from_torch_package(self, node: ast.ImportFrom, module: str) -> list[ast.stmt]:
        """``from torch.distributed import tensor, DeviceMesh, ProcessGroup``: only the redirected submodules
        and re-exported DTensor names change."""
        reexported = [a for a in node.names if reexport(module, a.name) is not None]
        redirected = [
            a
            for a in node.names
            if a.name != "*" and a not in reexported and self._kind(f"{module}.{a.name}") is not None
        ]
        if not redirected and not reexported:
            return [node]
        kept = [a for a in node.names if a not in redirected and a not in reexported]
        statements: list[ast.stmt] = [ast.ImportFrom(module=module, names=kept, level=0)] if kept else []
        for alias in redirected:
            target = ast.Name(id=alias.asname or alias.name, ctx=ast.Store())
            statements.append(ast.Assign(targets=[target], value=self._module(f"{module}.{alias.name}")))
        for alias in reexported:
            target = ast.Name(id=alias.asname or alias.name, ctx=ast.Store())
            statements.append(ast.Assign(targets=[target], value=self._reexported(module, alias.name)))
        return statements

    def _reexported(self, package: str, name: str) -> ast.Call:
        return self._call("reexported", ast.Constant(package), ast.Constant(name))

    def visit_Attribute(self, node: ast.Attribute) -> ast.expr:
        parts = _dotted(node)
        if parts is None or parts[0] not in self.aliases:
            return self.generic_visit(node)  # type: ignore[return-value]
        bound = self.aliases[parts[0]].split(".")
        full = [*bound, *parts[1:]]
        # The longest prefix that is a module of the map; the rest are attributes of what it resolves to.
        # It reaches past what the name is bound to: an alias of a torch object inside a mapped module
        # (FSDP1's class in torch.distributed.fsdp) was imported as torch's, and so are its attributes.
        for end in range(len(full), len(bound), -1):
            prefix = ".".join(full[:end])
            if prefix in SHADOWED:
                continue  # torch's package has an attribute of that name, not the module
            if (prefix in MODULES or prefix in NAMES) and self._kind(prefix) is not None:
                resolved = self._module(prefix)
                break
            if reexport(".".join(full[: end - 1]), full[end - 1]) is not None:  # dist.init_device_mesh
                resolved = self._reexported(".".join(full[: end - 1]), full[end - 1])
                break
        else:
            return node
        rest = parts[len(parts) - (len(full) - end) :]
        if not rest and not isinstance(node.ctx, ast.Load):
            return node  # `torch.distributed.tensor = ...` rebinds torch's attribute; nothing to resolve
        replacement: ast.expr = ast.copy_location(resolved, node)
        for attr in rest:
            replacement = ast.copy_location(ast.Attribute(value=replacement, attr=attr, ctx=ast.Load()), node)
        if isinstance(replacement, ast.Attribute):
            replacement.ctx = node.ctx
        return replacement


def _prologue_index(body: list[ast.stmt]) -> int:
    """Where the added import goes: after the docstring and ``from __future__`` imports."""
    index = 0
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        index = 1
    while index < len(body):
        statement = body[index]
        if not (isinstance(statement, ast.ImportFrom) and statement.module == "__future__"):
            break
        index += 1
    return index


def rewrite_imports(tree: ast.Module, importer: str, keep_torch: frozenset[str] = frozenset()) -> bool:
    """Rewrite ``tree`` (the module ``importer``) in place; True when it named a redirected torch module.

    Imports of modules at or under ``keep_torch`` stay as written (torch's)."""
    rewriter = _ImportRewriter(importer, keep_torch, _torch_aliases(tree, keep_torch))
    rewriter.visit(tree)
    if not rewriter.changed:
        return False
    index = _prologue_index(tree.body)
    prologue = ast.Import(names=[ast.alias(name="spmd.compat.resolve", asname=RESOLVER)])
    anchor = tree.body[index] if index < len(tree.body) else tree.body[-1]
    tree.body.insert(index, ast.copy_location(prologue, anchor))
    ast.fix_missing_locations(tree)
    return True
