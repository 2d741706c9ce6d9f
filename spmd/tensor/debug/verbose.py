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
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from spmd.tensor.comm import CollectiveRecord, add_comm_observer, remove_comm_observer
from spmd.tensor.debug.state import STATE, current_rank_or_none, parse_ranks
from spmd.tensor.placement import Placement, Replicate, Shard, format_placements
from spmd.tensor.spec import DTENSOR_DTYPE_SHORT, DTensorSpec, TensorMeta, local_shape_and_offset

if TYPE_CHECKING:
    from spmd.tensor.propagation import Decision

__all__ = [
    "set_verbose",
    "verbose",
    "is_verbose",
    "human_bytes",
    "log_line",
    "capture_collectives",
    "log_decision",
    "replication_note",
]

LOGGER = logging.getLogger("spmd.tensor")
_handler: logging.Handler | None = None
_local = threading.local()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _observe(record: CollectiveRecord) -> None:
    captured = getattr(_local, "captured", None)
    if captured is not None:
        captured.append(record)


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
        add_comm_observer(_observe)
    elif not enabled and STATE.verbose:
        LOGGER.setLevel(logging.NOTSET)
        if _handler is not None:
            LOGGER.removeHandler(_handler)
            _handler = None
        remove_comm_observer(_observe)
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


def log_line(text: str, *args: Any) -> None:
    """One verbose line, prefixed with the rank, if this rank is selected."""
    if not STATE.rank_selected():
        return
    rank = current_rank_or_none()
    prefix = "" if rank is None else f"[rank {rank}] "
    # text is already a %-format string for args; escape the prefix so it is never read as one
    line_format = prefix.replace("%", "%%") + text
    LOGGER.info(line_format, *args)


@contextlib.contextmanager
def capture_collectives() -> Iterator[list[CollectiveRecord]]:
    """The collectives this thread issues inside the block (verbose mode only)."""
    outer = getattr(_local, "captured", None)
    records: list[CollectiveRecord] = []
    _local.captured = records
    try:
        yield records
    finally:
        _local.captured = outer
        if outer is not None:
            outer.extend(records)


def log_decision(op: Any, specs: list[DTensorSpec], decision: Decision, hit: bool) -> None:
    inputs = ", ".join(f"{format_placements(s.placements)} {_short_meta(s.tensor_meta)}" for s in specs)
    outputs = ", ".join(
        f"{format_placements(p)} {_short_meta(m)}"
        for p, m in zip(decision.output_placements, decision.output_metas)
        if p is not None and m is not None
    )
    if decision.fallback:
        log_line("%-30s %s  ->  FALLBACK: inputs replicated   [%s]", op, inputs, "HIT" if hit else "MISS")
        return
    chosen = " | ".join(str(s) for s in decision.strategies)
    log_line("%-30s %s  ->  %s   via %s   [%s]", op, inputs, outputs or "-", chosen, "HIT" if hit else "MISS")


def replication_note(spec: DTensorSpec, want: Sequence[Placement]) -> str:
    """``"  gathers 3.0 KiB"`` when moving ``spec`` to ``want`` replicates a sharded mesh dim
    (``"  reduces ..."`` for a partial one): the bytes this rank then holds. Else ``""``."""
    mesh_shape = spec.mesh.shape
    gathers = reduces = False
    for size, old, new in zip(mesh_shape, spec.placements, want):
        if size > 1 and isinstance(new, Replicate):
            gathers = gathers or isinstance(old, Shard)
            reduces = reduces or not isinstance(old, (Shard, Replicate))
    if not (gathers or reduces):
        return ""
    coordinate = spec.mesh.get_coordinate()
    if coordinate is None:  # not a rank of the mesh: the first rank's share
        coordinate = (0,) * len(mesh_shape)
    shape, _ = local_shape_and_offset(spec.shape, spec.mesh, want, coordinate)
    nbytes = spec.tensor_meta.dtype.itemsize
    for size in shape:
        nbytes *= size
    return f"  {'gathers' if gathers else 'reduces'} {human_bytes(nbytes)}"


def _short_meta(meta: TensorMeta) -> str:
    dtype = DTENSOR_DTYPE_SHORT.get(meta.dtype, str(meta.dtype).replace("torch.", ""))
    return dtype + "[" + ",".join(str(s) for s in meta.shape) + "]"
