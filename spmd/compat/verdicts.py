"""What the import redirect gives for one use of a torch DTensor name: spmd's object, torch's, or an error.

Found by calling what the rewritten code calls, ``spmd.compat.resolve``'s ``module``, ``names``,
``reexported`` and ``star`` (then ``getattr`` along an attribute chain), with the using module's name
as the importer. So "spmd has it" means what it means to the redirect (spmd's module, imported, has
the name) and the audit cannot disagree with it. This imports spmd's modules and, for the names torch
keeps, torch's; nothing of the audited package.
"""

from __future__ import annotations

import importlib
import types
from dataclasses import dataclass
from typing import Literal

import spmd.compat.resolve as resolve
from spmd.compat.module_map import NAMES, TORCH_FALLBACK, reexport
from spmd.compat.uses import Use

__all__ = ["Outcome", "Verdict", "judge"]

Outcome = Literal["spmd", "torch", "kept", "missing"]
"""``spmd``: spmd's object; ``torch``: torch's own, on purpose (FSDP1's names of
``torch.distributed.fsdp``); ``kept``: torch's because the caller keeps it (``keep_torch``);
``missing``: the redirect raises (``NoSpmdEquivalentError``, ``ImportError`` or ``AttributeError``)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """The torch name a use reaches and what the redirect gives for it."""

    name: str
    """torch's dotted name: a module, ``module.name``, or ``module.*``."""
    outcome: Outcome
    target: str
    """What the name is under the redirect: spmd's dotted name (``spmd.tensor.DTensor``), torch's
    (``torch`` and ``kept``), or, when ``missing``, a short reason."""
    error: str = ""
    """``missing`` only: the error the redirect raises, as ``Type: message``."""


def _is_spmd(module_name: str) -> bool:
    return module_name == "spmd" or module_name.startswith("spmd.")


def _describe_module(found: types.ModuleType) -> tuple[Outcome, str]:
    if isinstance(found, resolve.RedirectedNames):
        torch_module = found.__name__
        sources = ", ".join(sorted(set(NAMES[torch_module].values())))
        rest = "the rest torch's" if torch_module in TORCH_FALLBACK else "no others"
        return "spmd", f"name by name: {sources} ({rest})"
    return ("spmd" if _is_spmd(found.__name__) else "torch"), found.__name__


def _describe(found: object, via: types.ModuleType, name: str) -> tuple[Outcome, str]:
    """Whose ``found`` is and its dotted name, when it is attribute ``name`` of ``via``."""
    if isinstance(found, types.ModuleType):
        return _describe_module(found)
    if isinstance(via, resolve.RedirectedNames):
        listed = NAMES[via.__name__].get(name)
        return ("spmd", f"{listed}.{name}") if listed else ("torch", f"{via.__name__}.{name}")
    return ("spmd" if _is_spmd(via.__name__) else "torch"), f"{via.__name__}.{name}"


def _missing(name: str, reason: str, error: Exception) -> Verdict:
    return Verdict(name, "missing", reason, f"{type(error).__name__}: {error}")


def judge(use: Use, importer: str) -> Verdict:
    """What the redirect gives for ``use`` in the module ``importer``."""
    module = use.torch_module
    if use.kind == "kept":
        name = f"{module}.{use.name}" if use.name else module
        return Verdict(name, "kept", name)
    if use.kind == "star":
        try:
            resolve.star({}, module, importer)
        except ImportError as error:
            return _missing(f"{module}.*", "a name of its redirect is missing", error)
        outcome, target = _describe_module(resolve.module(module, importer))
        return Verdict(f"{module}.*", outcome, f"{target}.*")
    found: object
    if use.kind == "module":
        try:
            found = resolve.module(module, importer)
        except ImportError as error:
            return _missing(module, "no spmd equivalent", error)
        name = module
        outcome, target = _describe_module(found)
    else:
        name = f"{module}.{use.name}"
        spmd_module = reexport(module, use.name)
        try:
            if use.kind == "reexported":
                found = resolve.reexported(module, use.name, importer)
            else:
                (found,) = resolve.names(module, (use.name,), importer)
        except (ImportError, AttributeError) as error:
            mapped = spmd_module or NAMES.get(module, {}).get(use.name)
            reason = f"mapped to {mapped}, which lacks it" if mapped else "no spmd equivalent"
            return _missing(name, reason, error)
        via = importlib.import_module(spmd_module) if spmd_module else resolve.module(module, importer)
        outcome, target = _describe(found, via, use.name)
    return _follow(Verdict(name, outcome, target), found, use.attributes)


def _follow(verdict: Verdict, found: object, attributes: tuple[str, ...]) -> Verdict:
    """The verdict for an attribute chain's rest: looked up while the object reached is a module (the
    chain's name stops at the first non-module, ``torch.distributed.tensor.DTensor`` of
    ``....DTensor.from_local``)."""
    for attribute in attributes:
        if not isinstance(found, types.ModuleType):
            break
        name = f"{verdict.name}.{attribute}"
        try:
            reached = getattr(found, attribute)
        except (AttributeError, ImportError) as error:  # a name torch keeps is imported as a submodule
            return _missing(name, f"{found.__name__} has no {attribute!r}", error)
        outcome, target = _describe(reached, found, attribute)
        verdict, found = Verdict(name, outcome, target), reached
    return verdict
