"""What a redirected package's rewritten imports call at run time: torch's module names in, spmd's objects out.

A redirected module binds this module as ``__spmd_compat__``; its import statements of torch's
DTensor modules become calls of ``module``, ``names`` and ``star`` (see ``spmd.compat.rewrite``).
Lookups happen when the statement runs, not when the package is redirected, so a name spmd lacks
fails where it is imported, with an ``ImportError`` naming it (and ``try: ... except ImportError``
around the import still works).
"""

from __future__ import annotations

import importlib
import types
from collections.abc import MutableMapping
from typing import Any

from spmd.compat.module_map import MODULES, NAMES, SHADOWED, TORCH_FALLBACK, classify, reexport

__all__ = ["NoSpmdEquivalentError", "RedirectedNames", "module", "names", "reexported", "star"]


class NoSpmdEquivalentError(ImportError):
    """A redirected package imports a torch DTensor module or name that spmd has no equivalent for."""


def _no_equivalent(what: str, importer: str, detail: str = "") -> str:
    return (
        f"spmd has no equivalent of {what}{f' ({detail})' if detail else ''}, imported by {importer}, whose "
        f"imports of torch's DTensor modules spmd.compat.redirect sends to spmd; torch's DTensor internals do not "
        f"work on spmd's DTensors. Avoid the code path that needs it, or run without the redirect "
        f"(docs/compat.md lists what is mapped)"
    )


class RedirectedNames(types.ModuleType):
    """A torch module whose names are taken one by one: the listed ones are spmd's, the rest torch's
    (``torch.distributed.fsdp``: FSDP2 -> spmd.fsdp, FSDP1 stays torch's) or missing (private modules)."""

    def __init__(self, torch_module: str) -> None:
        super().__init__(torch_module, f"{torch_module}, names redirected to spmd: {sorted(NAMES[torch_module])}")
        self.__torch_module = torch_module

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        torch_module = self.__torch_module
        spmd_module = NAMES[torch_module].get(name)
        if spmd_module is not None:
            target = importlib.import_module(spmd_module)
            if not hasattr(target, name):
                raise AttributeError(
                    f"{torch_module}.{name} is redirected to {spmd_module}.{name}, which this version of spmd does not have"
                )
            return getattr(target, name)
        if torch_module in TORCH_FALLBACK:
            original = importlib.import_module(torch_module)
            if hasattr(original, name):
                return getattr(original, name)
            return importlib.import_module(f"{torch_module}.{name}")
        raise AttributeError(
            f"{torch_module}.{name} has no spmd equivalent (spmd maps only {sorted(NAMES[torch_module])})"
        )

    def __dir__(self) -> list[str]:
        listed = set(NAMES[self.__torch_module])
        if self.__torch_module in TORCH_FALLBACK:
            listed |= set(dir(importlib.import_module(self.__torch_module)))
        return sorted(listed)

    def __repr__(self) -> str:
        return f"<module {self.__torch_module!r}, names redirected to spmd>"


_resolved: dict[str, types.ModuleType] = {}
"""torch module name -> what it resolved to: attribute chains in a hot loop pay one dict lookup."""


def module(torch_module: str, importer: str) -> types.ModuleType:
    """What ``import torch_module`` means in the redirected module ``importer``."""
    found = _resolved.get(torch_module)
    if found is not None:
        return found
    kind = classify(torch_module)
    if kind == "spmd":
        found = importlib.import_module(MODULES[torch_module])
    elif kind == "names":
        found = RedirectedNames(torch_module)
    elif kind is None:  # not DTensor code: torch's own module (the rewrite never asks for one)
        found = importlib.import_module(torch_module)
    else:
        raise NoSpmdEquivalentError(_no_equivalent(torch_module, importer), name=torch_module)
    return _resolved.setdefault(torch_module, found)  # one proxy per module, whichever thread came first


_reexported: dict[tuple[str, str], Any] = {}


def reexported(torch_package: str, name: str, importer: str) -> Any:
    """What ``torch_package.name`` means in ``importer`` when it is a re-exported DTensor name
    (``torch.distributed.init_device_mesh``): spmd's object of that name."""
    found = _reexported.get((torch_package, name))
    if found is None:
        spmd_module = reexport(torch_package, name)
        if spmd_module is None:  # the rewrite asks only for listed names; anything else stays torch's
            return getattr(importlib.import_module(torch_package), name)
        found = _reexported.setdefault((torch_package, name), getattr(importlib.import_module(spmd_module), name))
    return found


def names(torch_module: str, wanted: tuple[str, ...], importer: str) -> tuple[Any, ...]:
    """What ``from torch_module import *wanted`` binds in the redirected module ``importer``."""
    found = []
    for name in wanted:
        if reexport(torch_module, name) is not None:
            found.append(reexported(torch_module, name, importer))
            continue
        submodule = f"{torch_module}.{name}"
        listed = name in NAMES.get(torch_module, {})
        if not listed and submodule not in SHADOWED and (submodule in MODULES or submodule in NAMES):
            found.append(module(submodule, importer))
            continue
        source = module(torch_module, importer)
        try:
            found.append(getattr(source, name))
        except AttributeError as error:
            if listed:  # a name spmd maps but does not have (yet): say which
                raise ImportError(
                    f"cannot import name {name!r} from {torch_module!r} in {importer}: {error.args[0]}",
                    name=torch_module,
                ) from None
            where = MODULES.get(torch_module)
            detail = f"{where} has no {name!r}" if where else ""
            raise NoSpmdEquivalentError(_no_equivalent(submodule, importer, detail), name=submodule) from None
    return tuple(found)


def star(namespace: MutableMapping[str, Any], torch_module: str, importer: str) -> None:
    """What ``from torch_module import *`` binds in ``namespace``: the public names of its redirect."""
    source = module(torch_module, importer)
    if isinstance(source, RedirectedNames):
        public = list(NAMES[torch_module])
        if torch_module in TORCH_FALLBACK:
            original = importlib.import_module(torch_module)
            public += [n for n in getattr(original, "__all__", dir(original)) if not n.startswith("_")]
    else:
        public = list(getattr(source, "__all__", [n for n in dir(source) if not n.startswith("_")]))
    unique = tuple(dict.fromkeys(public))
    namespace.update(zip(unique, names(torch_module, unique, importer)))
