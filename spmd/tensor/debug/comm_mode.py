"""CommDebugMode: count the collectives (and bytes) that DTensor issues inside a ``with`` block."""

from __future__ import annotations

from collections import Counter
from types import TracebackType

from spmd.tensor.comm import CollectiveRecord, add_comm_observer, remove_comm_observer
from spmd.tensor.comm.threaded import current_threaded_world

__all__ = ["CommDebugMode"]


class CommDebugMode:
    """Records every collective the calling rank issues while active.

    In a threaded world each rank enters its own mode and sees only its own collectives.

    >>> with CommDebugMode() as comm_mode:  # doctest: +SKIP
    ...     y = x.redistribute(mesh, [Replicate()])
    >>> comm_mode.get_comm_counts()  # doctest: +SKIP
    {'all_gather': 1}
    """

    def __init__(self) -> None:
        self.records: list[CollectiveRecord] = []
        self._rank: int | None = None

    def __enter__(self) -> CommDebugMode:
        self.records = []
        world = current_threaded_world()
        self._rank = world.current_rank() if world is not None else None
        add_comm_observer(self._observe)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        remove_comm_observer(self._observe)

    def _observe(self, record: CollectiveRecord) -> None:
        if self._rank is None or record.rank == self._rank:
            self.records.append(record)

    def get_total_counts(self) -> int:
        """Number of collectives issued."""
        return len(self.records)

    def get_comm_counts(self) -> dict[str, int]:
        """Collectives issued, by kind (``all_gather``, ``all_reduce``, ``reduce_scatter``, ...)."""
        return dict(Counter(r.kind for r in self.records))

    def get_comm_bytes(self) -> dict[str, int]:
        """Bytes this rank received, by kind (ring-algorithm accounting, see ``CollectiveRecord``)."""
        totals: Counter[str] = Counter()
        for r in self.records:
            totals[r.kind] += r.moved_bytes
        return dict(totals)

    def get_total_bytes(self) -> int:
        return sum(r.moved_bytes for r in self.records)

    def __str__(self) -> str:
        lines = [f"{'collective':<16}{'count':>7}{'bytes':>14}"]
        byte_counts = self.get_comm_bytes()
        for kind, count in sorted(self.get_comm_counts().items()):
            lines.append(f"{kind:<16}{count:>7}{byte_counts.get(kind, 0):>14,}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CommDebugMode(counts={self.get_comm_counts()})"
