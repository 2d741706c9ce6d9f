"""Run a module or script with packages redirected to spmd: the launcher for code you cannot edit.

    python -m spmd.run --redirect torchtitan -m torchtitan.train --job.config_file cfg.toml
    python -m spmd.run --redirect pkg,otherpkg path/to/script.py ARGS...
    torchrun --nproc-per-node 2 -m spmd.run --redirect pkg -m pkg.main ARGS...

``--redirect`` may be repeated or take a comma-separated list; so may ``--keep-torch MODULE``, a torch
DTensor module spmd has no equivalent for that the packages import but will not use (see
``spmd.compat.redirect``). The target runs as ``__main__`` (as
``python -m MODULE`` or ``python SCRIPT`` would run it), with ``sys.argv`` set to what it would see
then: its own name followed by ARGS. A module target inside a redirected package is rewritten like
the rest of it; a script file is the caller's own code and runs as written.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import spmd.compat

__all__ = ["Launch", "main", "parse_args"]

USAGE = (
    "usage: python -m spmd.run --redirect PKG[,PKG...] [--redirect PKG ...] [--keep-torch MODULE[,MODULE...]] "
    "(-m MODULE | SCRIPT) [ARGS ...]"
)


@dataclass(frozen=True)
class Launch:
    """What one ``spmd.run`` command line asks for."""

    packages: tuple[str, ...]
    """The packages to redirect, in order."""
    target: str
    """A module name (``is_module``) or a script path."""
    is_module: bool
    args: tuple[str, ...]
    """The target's own arguments."""
    keep_torch: tuple[str, ...] = ()
    """Torch DTensor modules whose imports stay torch's."""


def parse_args(argv: Sequence[str]) -> Launch:
    """Split ``argv`` (without the program name) at the target: options before it are ours, the rest its."""
    lists: dict[str, list[str]] = {"--redirect": [], "--keep-torch": []}
    index = 0
    while index < len(argv):
        arg = argv[index]
        option, equals, value = arg.partition("=")
        if arg in ("-h", "--help"):
            print(f"{USAGE}\n\n{__doc__}")
            raise SystemExit(0)
        if option in lists:
            if not equals:
                index += 1
                if index == len(argv):
                    raise SystemExit(f"{option} needs a name\n{USAGE}")
                value = argv[index]
            lists[option] += [name.strip() for name in value.split(",") if name.strip()]
        elif arg.startswith("-m"):
            module = arg[2:] or (argv[index + 1] if index + 1 < len(argv) else "")
            if not module:
                raise SystemExit(f"-m needs a module name\n{USAGE}")
            rest = argv[index + (1 if arg[2:] else 2) :]
            return Launch(tuple(lists["--redirect"]), module, True, tuple(rest), tuple(lists["--keep-torch"]))
        elif arg.startswith("-"):
            raise SystemExit(f"unknown option {arg!r} (options for the target go after it)\n{USAGE}")
        else:
            rest = argv[index + 1 :]
            return Launch(tuple(lists["--redirect"]), arg, False, tuple(rest), tuple(lists["--keep-torch"]))
        index += 1
    raise SystemExit(f"no module (-m MODULE) or script to run\n{USAGE}")


def main(argv: Sequence[str] | None = None) -> None:
    """Redirect the packages, then run the target as ``__main__``."""
    launch = parse_args(sys.argv[1:] if argv is None else argv)
    if not launch.packages:
        print("spmd.run: no --redirect given; running the target with torch's DTensor", file=sys.stderr)
    spmd.compat.redirect(*launch.packages, keep_torch=launch.keep_torch)
    if launch.is_module:
        sys.argv = [launch.target, *launch.args]  # runpy puts the module's file in sys.argv[0]
        runpy.run_module(launch.target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [launch.target, *launch.args]
        sys.path[0] = os.path.dirname(os.path.abspath(launch.target))  # as `python SCRIPT` would
        runpy.run_path(launch.target, run_name="__main__")


if __name__ == "__main__":
    main()
