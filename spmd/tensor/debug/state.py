"""What the debug tools need from the hot path, kept cheap when nobody is listening.

The dispatcher and the redistribute executor read ``STATE.listening`` (one attribute) and only
then pay for op attribution or log lines.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

__all__ = ["STATE", "DebugState", "current_op", "op_scope", "current_rank_or_none"]

_local = threading.local()


class DebugState:
    """Process-wide switches: verbose logging, which ranks log, and active comm-counting modes."""

    def __init__(self) -> None:
        self.verbose = False
        self.ranks: frozenset[int] | None = frozenset({0})
        """Ranks whose decisions are logged; None logs every rank."""
        self.comm_modes = 0
        self.checks = 0
        """Users of the collective check (see debug/check.py); while > 0, ops name themselves."""
        self.listening = False

    def refresh(self) -> None:
        self.listening = self.verbose or self.comm_modes > 0 or self.checks > 0

    def rank_selected(self) -> bool:
        if self.ranks is None:
            return True
        rank = current_rank_or_none()
        return rank is None or rank in self.ranks


STATE = DebugState()


def current_rank_or_none() -> int | None:
    """The caller's global rank in its in-process world or c10d job; None outside any world."""
    from spmd.tensor.comm.base import active_world

    world = active_world()
    if world is not None:
        return world.current_rank()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


def current_op() -> str | None:
    """The op (or "redistribute") whose collectives are running on this thread, if known."""
    return getattr(_local, "op", None)


@contextlib.contextmanager
def op_scope(name: str) -> Iterator[None]:
    """Attribute the collectives issued inside the block to ``name`` (outermost scope wins)."""
    outer = getattr(_local, "op", None)
    if outer is None:
        _local.op = name
    try:
        yield
    finally:
        if outer is None:
            _local.op = None


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
