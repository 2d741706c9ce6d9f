"""The hot path's side of the debug tools: switches read on every op, and the lines they write.

The dispatcher and the redistribute executor read ``STATE.listening`` (one attribute) and only
then pay for op attribution, log lines or fallback counts. The user-facing tools that flip these
switches and read the counts (``spmd.tensor.debug``: verbose, CommDebugMode, fallback_report,
check_collectives) sit above this module; nothing here imports them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from spmd.comm.base import CollectiveRecord, active_world
from spmd.tensor.placement import Placement, Replicate, Shard, format_placements
from spmd.tensor.spec import DTENSOR_DTYPE_SHORT, DTensorSpec, TensorMeta, local_shape_and_offset

if TYPE_CHECKING:
    from spmd.tensor.sharding.vocabulary import Decision

__all__ = [
    "STATE",
    "DebugState",
    "LOGGER",
    "current_op",
    "parse_ranks",
    "op_scope",
    "current_rank_or_none",
    "human_bytes",
    "log_line",
    "observe_collective",
    "capture_collectives",
    "log_decision",
    "log_decomposition",
    "replication_note",
    "FALLBACKS",
    "FallbackCounts",
]

LOGGER = logging.getLogger("spmd.tensor")
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
    world = active_world()
    if world is not None:
        return world.current_rank()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


def parse_ranks(text: str) -> frozenset[int] | None:
    """``"all"`` -> None (every rank); ``"0,1"`` -> {0, 1}."""
    text = text.strip().lower()
    if text in ("all", "*"):
        return None
    try:
        return frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise ValueError(f"SPMD_DEBUG_RANKS={text!r}: use 'all' or a comma-separated list like '0,1'") from error


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


# ----- verbose lines ---------------------------------------------------------------------------------
def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def log_line(text: str, *args: Any) -> None:
    """One verbose line, prefixed with the rank, if this rank is selected."""
    if not STATE.rank_selected():
        return
    rank = current_rank_or_none()
    prefix = "" if rank is None else f"[rank {rank}] "
    # text is already a %-format string for args; escape the prefix so it is never read as one
    line_format = prefix.replace("%", "%%") + text
    LOGGER.info(line_format, *args)


def observe_collective(record: CollectiveRecord) -> None:
    """Comm observer installed while verbose: hands each record to the innermost ``capture_collectives``."""
    captured = getattr(_local, "captured", None)
    if captured is not None:
        captured.append(record)


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


def log_decision(op: Any, specs: Sequence[DTensorSpec], decision: Decision, hit: bool) -> None:
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


def log_decomposition(op: Any, specs: Sequence[DTensorSpec], decision: Decision, hit: bool) -> None:
    """The verbose line of a call that runs as other ops (their own lines follow it)."""
    inputs = ", ".join(format_placements(s.placements) for s in specs)
    expansion = decision.decomposition
    name = getattr(getattr(expansion, "func", expansion), "__name__", repr(expansion))
    log_line("%-30s %s  ->  runs as other ops (%s)   [%s]", op, inputs, name, "HIT" if hit else "MISS")


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


# ----- fallback counts -------------------------------------------------------------------------------
class FallbackCounts:
    """Calls and bytes gathered per (op, rank) on the replicate fallback; read by ``fallback_report()``.

    Only the fallback path writes here (it gathers every input, so it is slow anyway): one dict
    update under a lock, safe when ranks are threads.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[tuple[str, int | None], list[int]] = {}
        """(op name, global rank or None outside a world) -> [calls, bytes gathered]."""
        self.warned: set[str] = set()

    def record(self, op: Any, replicated: Sequence[Any]) -> None:
        """Count one fallback call of ``op`` on this rank; ``replicated``: the DTensors it gathered
        (one passed twice is gathered once)."""
        seen: set[int] = set()
        gathered = 0
        for dtensor in replicated:
            if id(dtensor) not in seen:
                seen.add(id(dtensor))
                gathered += dtensor._spec.tensor_meta.nbytes
        key = (str(op), current_rank_or_none())
        with self.lock:
            counts = self.counts.get(key)
            if counts is None:
                self.counts[key] = [1, gathered]
            else:
                counts[0] += 1
                counts[1] += gathered
        if STATE.verbose:
            log_line(
                "  fallback gathered %s into replicated inputs (see spmd.tensor.debug.fallback_report())",
                human_bytes(gathered),
            )

    def warn_once(self, op: Any) -> bool:
        """True the first time ``op`` falls back in this process, on whichever rank gets there first."""
        name = str(op)
        with self.lock:
            if name in self.warned:
                return False
            self.warned.add(name)
            return True


FALLBACKS = FallbackCounts()
