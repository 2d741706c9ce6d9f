"""run_torchrun: run a script on N local processes under torchrun, as a user launches it.

run_multiprocess covers most multi-process tests; this is for what only the launcher shows: the
script's own ``init_process_group``, torchrun's environment, and its exit code when a rank fails.
``--standalone`` lets torchrun pick a free port, so parallel runs never race for one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["run_torchrun"]

DEFAULT_TIMEOUT_S = 300.0
"""Longest a run may take unless the caller says otherwise: every rank imports torch, on a loaded machine too."""

IMPORT_ROOT = str(Path(__file__).resolve().parents[__name__.count(".")])
"""The directory holding this module's top-level package: the ranks import this copy, not another installed one."""


def run_torchrun(
    script_path: str | os.PathLike[str],
    nproc: int,
    *,
    args: Sequence[str] = (),
    timeout: float = DEFAULT_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    module: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``script_path`` with ``args`` on ``nproc`` processes under ``torchrun --standalone``; return
    the finished process, its output captured as text. The exit code is the caller's to check.

    Each rank finds this package first on ``PYTHONPATH``, keeps gloo on loopback and runs one OpenMP
    thread (several ranks share the machine's cores). ``env`` adds or overrides variables on top of
    this process's; a ``PYTHONPATH`` in it goes before that root. ``module=True`` runs
    ``script_path`` as a module name, as ``python -m`` does. Raises ``subprocess.TimeoutExpired``
    if the run takes longer than ``timeout`` seconds.
    """
    extra = dict(env or {})
    pythonpath = [path for path in (extra.pop("PYTHONPATH", ""), IMPORT_ROOT, os.environ.get("PYTHONPATH", "")) if path]
    run_env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo0" if sys.platform == "darwin" else "lo",
        "OMP_NUM_THREADS": "1",
        **extra,
        "PYTHONPATH": os.pathsep.join(pythonpath),
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    command += ["-m", str(script_path)] if module else [str(script_path)]
    return subprocess.run([*command, *args], env=run_env, capture_output=True, text=True, timeout=timeout, check=False)
