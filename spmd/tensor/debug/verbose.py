"""Verbose mode: one log line per op with its placements, strategy, redistributes and cache result.

Turn it on with ``SPMD_DEBUG=verbose`` in the environment (``SPMD_DEBUG_RANKS=all`` or ``0,1`` picks
the ranks; rank 0 by default), with ``set_verbose(True)``, or for a block with ``with verbose():``.
Lines go to the ``spmd.tensor`` logger tree at INFO; when nothing else handles them they are
printed to stderr. Off by default, and then the hot path only reads one flag.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator, Sequence

from spmd.comm import add_comm_observer, remove_comm_observer
from spmd.tensor.trace import LOGGER, STATE, observe_collective, parse_ranks

__all__ = ["set_verbose", "verbose", "is_verbose"]

_handler: logging.Handler | None = None


def set_verbose(enabled: bool = True, *, ranks: str | Sequence[int] | frozenset[int] | None = frozenset({0})) -> None:
    """Log every DTensor decision (``ranks``: the ranks that log; "all" or None for every rank)."""
    global _handler
    if isinstance(ranks, str):
        STATE.ranks = parse_ranks(ranks)
    else:
        STATE.ranks = None if ranks is None else frozenset(ranks)
    if enabled and not STATE.verbose:
        LOGGER.setLevel(logging.INFO)
        if not logging.getLogger().handlers and not LOGGER.handlers:
            _handler = logging.StreamHandler(sys.stderr)
            _handler.setFormatter(logging.Formatter("%(message)s"))
            LOGGER.addHandler(_handler)
        add_comm_observer(observe_collective)
    elif not enabled and STATE.verbose:
        LOGGER.setLevel(logging.NOTSET)
        if _handler is not None:
            LOGGER.removeHandler(_handler)
            _handler = None
        remove_comm_observer(observe_collective)
    STATE.verbose = enabled
    STATE.refresh()


def is_verbose() -> bool:
    """Whether verbose logging is on."""
    return STATE.verbose


@contextlib.contextmanager
def verbose(ranks: str | Sequence[int] | None = (0,)) -> Iterator[None]:
    """Verbose logging inside the block only."""
    was, old_ranks = STATE.verbose, STATE.ranks
    set_verbose(True, ranks=ranks)
    try:
        yield
    finally:
        set_verbose(was, ranks=old_ranks)
