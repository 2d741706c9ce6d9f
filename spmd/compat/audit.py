"""``python -m spmd.compat.audit PKG_OR_DIR [...]``: which torch DTensor names a package uses, and what
``spmd.compat.redirect`` would do with each, before switching it to spmd.

::

    python -m spmd.compat.audit accelerate                 # an installed package (read, not imported)
    python -m spmd.compat.audit /tmp/src/trl --markdown    # a folder (an unpacked wheel); a table for docs
    python -m spmd.compat.audit torchtitan --json --keep-torch torch.distributed.tensor.experimental._attention

Exit status 0 when every name used would resolve, 1 when some would fail (``NoSpmdEquivalentError``,
``ImportError`` or ``AttributeError`` under the redirect, guarded or not), 2 for a target not found.

In Python, ``spmd.compat.audit(...)`` is the function ``spmd.compat.audit_report.audit`` (that module
also holds the command's ``main``); this module only runs the command, so ``spmd.compat`` never imports
it and ``-m`` runs it without runpy's "found in sys.modules" warning. Should something import it as
``spmd.compat.audit`` (which rebinds that attribute of ``spmd.compat`` to the module), calling the
module calls the function all the same.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterable

from spmd.compat.audit_report import Audit, audit, main

__all__ = ["main"]


class _CallableModule(types.ModuleType):
    """This module, callable as the function ``spmd.compat.audit``."""

    def __call__(self, *targets: str | os.PathLike[str], keep_torch: Iterable[str] = ()) -> Audit:
        return audit(*targets, keep_torch=keep_torch)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
