"""Which ops ran on the replicate fallback in this process, how often, and what it gathered.

The dispatcher counts a call only on the fallback path (``spmd.tensor.trace.FALLBACKS``). ``fallback_report()`` returns a
snapshot; ``reset_fallback_report()`` starts counting afresh (for one training step, say)::

    reset_fallback_report()
    train_step()
    print(fallback_report())   # one row per op: calls and bytes gathered, per rank

The warning that an op fell back is logged once per op and process (not once per rank thread),
however often the op runs; the report is where the rest is counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from spmd.tensor.trace import FALLBACKS, human_bytes

__all__ = [
    "FallbackRecord",
    "FallbackReport",
    "fallback_report",
    "reset_fallback_report",
]


@dataclass(frozen=True, slots=True)
class FallbackRecord:
    """One op that ran on the replicate fallback."""

    op: str
    """The aten overload, e.g. ``"aten.sin.default"``."""
    calls: int
    """Calls on one rank (ranks of an SPMD program make the same calls; the busiest rank of this
    process counts)."""
    bytes_gathered: int
    """Bytes one rank received as whole tensors over those calls: the full size of every input the
    fallback had to replicate (an input already replicated adds nothing)."""
    ranks: int
    """Ranks of this process that fell back: 1 under torchrun, the world size under run_threaded."""


@dataclass(frozen=True, slots=True)
class FallbackReport:
    """Every op that fell back since the process started or ``reset_fallback_report()``, most bytes first."""

    records: tuple[FallbackRecord, ...]

    def __iter__(self) -> Iterator[FallbackRecord]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __contains__(self, op: object) -> bool:
        return any(r.op == str(op) for r in self.records)

    def __getitem__(self, op: object) -> FallbackRecord:
        """The record of ``op`` (an aten overload or its name)."""
        for record in self.records:
            if record.op == str(op):
                return record
        raise KeyError(f"{op} did not fall back; ops that did: {[r.op for r in self.records] or 'none'}")

    @property
    def bytes_gathered(self) -> int:
        """Bytes gathered by every fallback, per rank."""
        return sum(r.bytes_gathered for r in self.records)

    def __str__(self) -> str:
        if not self.records:
            return "no op fell back"
        width = max(len("op"), *(len(r.op) for r in self.records))
        lines = [f"{'op':<{width}}  {'calls/rank':>10}  {'gathered/rank':>13}  {'ranks':>5}"]
        lines += [
            f"{r.op:<{width}}  {r.calls:>10}  {human_bytes(r.bytes_gathered):>13}  {r.ranks:>5}" for r in self.records
        ]
        lines.append(
            f"{'total':<{width}}  {sum(r.calls for r in self.records):>10}  {human_bytes(self.bytes_gathered):>13}"
        )
        return "\n".join(lines)


def fallback_report() -> FallbackReport:
    """Every op that ran on the replicate fallback, with its calls and bytes gathered per rank."""
    with FALLBACKS.lock:
        rows = [(op, rank, calls, gathered) for (op, rank), (calls, gathered) in FALLBACKS.counts.items()]
    per_op: dict[str, list[int]] = {}
    for op, _, calls, gathered in rows:
        row = per_op.setdefault(op, [0, 0, 0])
        row[0] = max(row[0], calls)
        row[1] = max(row[1], gathered)
        row[2] += 1
    records = [FallbackRecord(op, calls, gathered, ranks) for op, (calls, gathered, ranks) in per_op.items()]
    records.sort(key=lambda r: (-r.bytes_gathered, -r.calls, r.op))
    return FallbackReport(tuple(records))


def reset_fallback_report() -> None:
    """Forget the counts so far (the once-per-process warnings stay given)."""
    with FALLBACKS.lock:
        FALLBACKS.counts.clear()


def _forget_warnings() -> None:
    """Warn again for every op (tests only)."""
    with FALLBACKS.lock:
        FALLBACKS.warned.clear()
