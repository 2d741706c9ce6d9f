"""Debug switches from the environment: ``SPMD_DEBUG`` and ``SPMD_DEBUG_RANKS``.

The switches themselves live in ``spmd.tensor.trace`` (read by the hot path); this module only
parses the environment and turns the user-level tools on.
"""

from __future__ import annotations

import os

from spmd.tensor.trace import STATE, current_op, current_rank_or_none, op_scope

__all__ = ["parse_ranks", "configure_from_environment", "STATE", "current_op", "current_rank_or_none", "op_scope"]


def parse_ranks(text: str) -> frozenset[int] | None:
    """``"all"`` -> None (every rank); ``"0,1"`` -> {0, 1}."""
    text = text.strip().lower()
    if text in ("all", "*"):
        return None
    try:
        return frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise ValueError(f"SPMD_DEBUG_RANKS={text!r}: use 'all' or a comma-separated list like '0,1'") from error


def configure_from_environment() -> None:
    """``SPMD_DEBUG=verbose`` turns verbose logging on, ``SPMD_DEBUG=check`` the collective check
    (``SPMD_DEBUG=verbose,check`` both); ``SPMD_DEBUG_RANKS`` picks the ranks that log."""
    ranks = os.environ.get("SPMD_DEBUG_RANKS")
    if ranks is not None:
        STATE.ranks = parse_ranks(ranks)
    modes = {part.strip() for part in os.environ.get("SPMD_DEBUG", "").lower().replace(",", " ").split()}
    if "verbose" in modes:
        from spmd.tensor.debug.verbose import set_verbose

        set_verbose(True, ranks=STATE.ranks)
    if "check" in modes:
        from spmd.tensor.debug.check import set_check_collectives

        set_check_collectives(True)
