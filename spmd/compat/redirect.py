"""Which packages are redirected, and the import hook that rewrites their modules as they load.

The hook is one ``sys.meta_path`` finder. For a module of a redirected package it asks the other
finders for the module's usual spec and, when the module is Python source, swaps in a loader that
compiles the rewritten tree (``spmd.compat.rewrite``) instead of the file as written. The spec keeps
its name, origin and search locations, so ``__file__``, ``__spec__``, ``__path__``, the package's
relative imports, ``importlib.resources`` and pickling by module name behave as without the hook.
Nothing of torch's is touched, and modules outside the redirected packages load as usual.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import sys
import threading
import types
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from spmd.compat.module_map import classify
from spmd.compat.rewrite import rewrite_imports

__all__ = ["RedirectError", "redirect", "redirected", "redirecting", "undo"]


class RedirectError(RuntimeError):
    """A package cannot be redirected (already imported, or not a package name that may be)."""


_lock = threading.Lock()
_packages: tuple[str, ...] = ()  # replaced whole under _lock, read without it
_keep_torch: dict[str, frozenset[str]] = {}  # package -> torch DTensor modules it keeps torch's


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _owner(fullname: str) -> str | None:
    return next((package for package in _packages if _under(fullname, package)), None)


class _RewritingLoader(importlib.machinery.SourceFileLoader):
    """Loads a source module with its torch DTensor imports rewritten; no bytecode cache is read or
    written (the file's cached bytecode is the unrewritten module)."""

    def __init__(self, fullname: str, path: str, keep_torch: frozenset[str]) -> None:
        super().__init__(fullname, path)
        self.keep_torch = keep_torch

    def get_code(self, fullname: str) -> types.CodeType:
        path = self.get_filename(fullname)
        tree = ast.parse(self.get_data(path), filename=path)  # bytes: the coding cookie is honoured
        rewrite_imports(tree, fullname, self.keep_torch)
        return compile(tree, path, "exec", dont_inherit=True)


class _RedirectFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        package = _owner(fullname)
        if package is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if isinstance(spec.loader, importlib.machinery.SourceFileLoader) and spec.origin:
            spec.loader = _RewritingLoader(fullname, spec.origin, _keep_torch.get(package, frozenset()))
        return spec


_FINDER = _RedirectFinder()


def _check_name(package: str) -> None:
    if not package or not all(part.isidentifier() for part in package.split(".")):
        raise RedirectError(f"{package!r} is not a package name; give a dotted name such as 'torchtitan'")
    for own in ("torch", "spmd"):
        if _under(package, own):
            raise RedirectError(
                f"{package!r} cannot be redirected: only third-party packages that import torch's DTensor are"
            )


def redirect(*packages: str, keep_torch: Iterable[str] = ()) -> None:
    """From now on, imports of torch's DTensor modules inside ``packages`` (their modules and
    subpackages) resolve to spmd's; code outside them is untouched.

    Call it before anything imports the packages (``python -m spmd.run --redirect PKG`` does).
    Redirecting a package again is a no-op; redirecting one that is already imported raises
    ``RedirectError``, since its modules already hold torch's objects.

    ``keep_torch`` names torch DTensor modules that spmd has no equivalent for and that the packages
    import without needing them (torchtitan imports context parallelism's
    ``torch.distributed.tensor.experimental._attention`` whether or not it is enabled): imports of
    them stay torch's instead of raising ``NoSpmdEquivalentError``. Using them on spmd's DTensors
    does not work.
    """
    global _packages
    kept = frozenset(keep_torch)
    for package in packages:
        _check_name(package)
    for module in sorted(kept):
        if classify(module) is None:
            raise RedirectError(f"keep_torch={module!r}: not a torch DTensor module the redirect changes; drop it")
    with _lock:
        for package in packages:
            owner = _owner(package)
            if owner is not None:
                if not kept <= _keep_torch.get(owner, frozenset()):
                    raise RedirectError(
                        f"{package!r} is already redirected (as part of {owner!r}) without keep_torch={sorted(kept)}; "
                        f"pass keep_torch in the first spmd.compat.redirect call"
                    )
                continue
            imported = sorted(name for name in sys.modules if _under(name, package))
            if imported:
                raise RedirectError(
                    f"{package!r} is already imported ({', '.join(imported[:3])}{', ...' if len(imported) > 3 else ''}), "
                    f"so it already holds torch's DTensor objects. Call spmd.compat.redirect({package!r}) before "
                    f"anything imports it (the first lines of the entry script), or launch with "
                    f"`python -m spmd.run --redirect {package} ...`"
                )
            _packages = (*_packages, package)
            _keep_torch[package] = kept
        if _packages and _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)


def redirected() -> tuple[str, ...]:
    """The redirected packages, in the order they were redirected."""
    return _packages


def undo(*packages: str) -> None:
    """Stop redirecting ``packages`` (all when none are given) and forget their imported modules,
    so that the next import of them loads them as written, with torch's DTensor."""
    global _packages
    with _lock:
        dropped = set(packages or _packages)
        _packages = tuple(p for p in _packages if p not in dropped)
        for package in dropped:
            _keep_torch.pop(package, None)
        for name in [name for name in sys.modules if any(_under(name, p) for p in dropped)]:
            del sys.modules[name]
        if not _packages and _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)


@contextmanager
def redirecting(*packages: str, keep_torch: Iterable[str] = ()) -> Iterator[None]:
    """``redirect(*packages, keep_torch=...)`` for the ``with`` block, then ``undo`` of the ones it added (for tests)."""
    added = [p for p in packages if _owner(p) is None]
    redirect(*packages, keep_torch=keep_torch)
    try:
        yield
    finally:
        if added:
            undo(*added)
