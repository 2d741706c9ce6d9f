"""Debug switches from the environment: ``SPMD_DEBUG`` and ``SPMD_DEBUG_RANKS``.

The switches themselves live in ``spmd.tensor.trace`` (read by the hot path); this module only
parses the environment and turns the user-level tools on.
"""

from __future__ import annotations

import os

from spmd.tensor.debug.check import set_check_collectives, set_warmup_check
from spmd.tensor.debug.explicit import set_explicit_redistribution
from spmd.tensor.debug.verbose import set_verbose
from spmd.tensor.trace import STATE, parse_ranks

__all__ = ["configure_from_environment"]


def configure_from_environment() -> None:
    """``SPMD_DEBUG=verbose`` turns verbose logging on, ``SPMD_DEBUG=check`` the full collective check,
    ``SPMD_DEBUG=nocheck`` the default warm-up check off
    (``SPMD_DEBUG=verbose,check`` both), ``SPMD_DEBUG=explicit`` forbids implicit redistribution;
    ``SPMD_DEBUG_RANKS`` picks the ranks that log."""
    ranks = os.environ.get("SPMD_DEBUG_RANKS")
    if ranks is not None:
        STATE.ranks = parse_ranks(ranks)
    modes = {part.strip() for part in os.environ.get("SPMD_DEBUG", "").lower().replace(",", " ").split()}
    if "verbose" in modes:
        set_verbose(True, ranks=STATE.ranks)
    if "check" in modes:
        set_check_collectives(True)
    if "nocheck" in modes:
        set_warmup_check(False)
    if "explicit" in modes:
        set_explicit_redistribution(True)
