"""``python -m spmd.compat.audit PKG_OR_DIR [...]``: which torch DTensor names a package uses, and what
``spmd.compat.redirect`` would do with each, before switching it to spmd.

::

    python -m spmd.compat.audit accelerate                 # an installed package (read, not imported)
    python -m spmd.compat.audit /tmp/src/trl --markdown    # a folder (an unpacked wheel); a table for docs
    python -m spmd.compat.audit torchtitan --json --keep-torch torch.distributed.tensor.experimental._attention

Exit status 0 when every name used would resolve, 1 when some would fail (``NoSpmdEquivalentError``,
``ImportError`` or ``AttributeError`` under the redirect, guarded or not), 2 for a target not found.

In Python, ``spmd.compat.audit(...)`` is the function (``spmd.compat.audit_report.audit``). This module
is only the command; should something import it as ``spmd.compat.audit`` (which rebinds that
attribute of ``spmd.compat`` to the module), calling the module calls the function all the same.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from collections.abc import Iterable, Sequence

from spmd.compat.audit_report import Audit, audit
from spmd.compat.sources import SourceNotFoundError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m spmd.compat.audit",
        description="List the torch DTensor names a package uses and what spmd.compat.redirect does with each.",
    )
    parser.add_argument("targets", nargs="+", metavar="PKG_OR_DIR", help="installed package name or source folder")
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="every use, as JSON, for tools")
    form.add_argument("--markdown", action="store_true", help="a Markdown table, for docs")
    parser.add_argument(
        "--keep-torch",
        action="append",
        default=[],
        metavar="MODULE[,MODULE]",
        help="torch modules kept torch's, as redirect(keep_torch=...) keeps them",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the audit command; returns the exit status."""
    parser = _parser()
    options = parser.parse_args(argv)
    keep_torch = [module for value in options.keep_torch for module in value.split(",") if module]
    try:
        report = audit(*options.targets, keep_torch=keep_torch)
    except (SourceNotFoundError, ValueError) as error:
        parser.error(str(error))
    if options.json:
        print(json.dumps(report.as_json(), indent=2))
    elif options.markdown:
        print(report.markdown())
    else:
        print(report.table())
    return 1 if report.fails else 0


class _CallableModule(types.ModuleType):
    """This module, callable as the function ``spmd.compat.audit``."""

    def __call__(self, *targets: str | os.PathLike[str], keep_torch: Iterable[str] = ()) -> Audit:
        return audit(*targets, keep_torch=keep_torch)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
