"""Deprecated path: ``spmd.tensor.parallel`` holds the same objects as ``spmd.tensor_parallel``.

Every name is looked up in ``spmd.tensor_parallel`` on access (so both paths give the very same
objects) and each access warns with ``DeprecationWarning`` naming the new path.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # type checkers see the names; at run time __getattr__ serves them
    from spmd.tensor_parallel import *  # noqa: F403

NEW_PATH = "spmd.tensor_parallel"

# The same public names as the new package, read from it rather than listed twice.
__all__ = list(importlib.import_module(NEW_PATH).__all__)


def __getattr__(name: str) -> object:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}; the new path is {NEW_PATH}")
    warnings.warn(
        f"{__name__}.{name} is deprecated; import it from {NEW_PATH} instead (the same object)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(NEW_PATH), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
