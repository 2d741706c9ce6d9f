"""A plan's report: per-rank memory, the step's collectives by kind and mesh dim, and their ring-model time.

Time of one collective on a ring of ``n`` ranks: ``steps * latency + moved_bytes / bandwidth``,
with ``moved_bytes`` what each rank receives (``CollectiveRecord.moved_bytes``: ``2(n-1)/n`` of the
buffer for all_reduce, ``(n-1)/n`` for all_gather, reduce_scatter, all_to_all and scatter, all of it
for broadcast) and ``steps`` the ring's rounds (``2(n-1)`` for all_reduce, ``n-1`` otherwise). The
link is the intra-node one when the group's ranks share a node, else the inter-node one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from spmd.comm import CollectiveRecord
from spmd.simulate.memory import StateBytes
from spmd.simulate.plan import Link, Links
from spmd.tensor import DeviceMesh
from spmd.tensor.redistribute.cost import RING_KINDS, collective_seconds

__all__ = [
    "CollectiveStat",
    "PlanReport",
    "collective_stats",
    "ring_seconds",
    "format_report",
    "format_comparison",
    "human_bytes",
]


@dataclass(frozen=True, slots=True)
class CollectiveStat:
    """The collectives of one kind on one mesh dim in a step, as the simulated rank issues them."""

    kind: str
    mesh_dim: str
    group_size: int
    count: int
    bytes: int
    """Bytes this rank receives, summed (CommDebugMode's accounting)."""
    seconds: float
    """Ring-model time, summed."""


@dataclass(frozen=True, slots=True)
class PlanReport:
    """What one rank needs and moves for one training step under a plan."""

    plan: str
    world_size: int
    rank: int
    state: StateBytes
    """Parameters, gradients and optimizer state held by the rank (local shards)."""
    activations_peak: int
    """Most bytes of everything else live at once in the step: activations, gathered parameters, buffers."""
    peak: int
    """Most bytes live at once in the step, everything included."""
    collectives: tuple[CollectiveStat, ...]
    simulate_seconds: float
    """How long the simulation itself took."""
    notes: tuple[str, ...] = ()
    """Things about the plan the numbers alone do not say (printed under the table)."""

    @property
    def comm_count(self) -> int:
        return sum(c.count for c in self.collectives)

    @property
    def comm_bytes(self) -> int:
        return sum(c.bytes for c in self.collectives)

    @property
    def comm_seconds(self) -> float:
        return sum(c.seconds for c in self.collectives)


def ring_seconds(record: CollectiveRecord, link: Link) -> float:
    """The ring model's time for one collective on ``link`` (see the module docstring)."""
    if record.kind not in RING_KINDS:
        return 0.0
    return collective_seconds(record.kind, record.group_size, record.tensor_bytes, link.bandwidth, link.latency)


def mesh_dim_names_by_group(mesh: DeviceMesh) -> dict[tuple[int, ...], str]:
    """The calling rank's group along each mesh dim, named as the dim (its index if unnamed)."""
    names = mesh.mesh_dim_names or tuple(str(d) for d in range(mesh.ndim))
    return {tuple(mesh.get_communicator(d).ranks): names[d] for d in range(mesh.ndim)}


def collective_stats(records: Iterable[CollectiveRecord], mesh: DeviceMesh, links: Links) -> tuple[CollectiveStat, ...]:
    """``records`` summed by (kind, mesh dim), ordered by mesh dim then kind; a group on no mesh dim is "other".

    Collectives over one rank (a mesh dim of size 1) move nothing and are left out.
    """
    dims = mesh_dim_names_by_group(mesh)
    totals: dict[tuple[str, str], list[float]] = {}
    sizes: dict[tuple[str, str], int] = {}
    for record in records:
        if record.group_size == 1:
            continue
        key = (dims.get(record.ranks, "other"), record.kind)
        cell = totals.setdefault(key, [0, 0, 0.0])
        cell[0] += 1
        cell[1] += record.moved_bytes
        cell[2] += ring_seconds(record, links.link_for(record.ranks))
        sizes[key] = record.group_size
    order = list(dims.values())
    return tuple(
        CollectiveStat(kind, dim, sizes[(dim, kind)], int(count), int(nbytes), seconds)
        for (dim, kind), (count, nbytes, seconds) in sorted(
            totals.items(),
            key=lambda item: (order.index(item[0][0]) if item[0][0] in order else len(order), item[0][1]),
        )
    )


def human_bytes(n: float) -> str:
    """``1.5 GiB``: bytes in binary units, for tables."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def format_report(report: PlanReport) -> str:
    """The table for one plan: memory per rank, then the step's collectives by mesh dim and kind."""
    s = report.state
    lines = [
        f"plan {report.plan} on {report.world_size} ranks (rank {report.rank} simulated in {report.simulate_seconds:.1f} s)",
        "",
        "memory per rank",
        f"  {'parameters':<28}{human_bytes(s.params):>12}",
        f"  {'gradients':<28}{human_bytes(s.grads):>12}",
        f"  {'optimizer state':<28}{human_bytes(s.optimizer):>12}",
        f"  {'activations (peak)':<28}{human_bytes(report.activations_peak):>12}",
        f"  {'peak, all together':<28}{human_bytes(report.peak):>12}",
        "",
        "collectives per training step",
        f"  {'mesh dim':<10}{'collective':<16}{'group':>7}{'count':>8}{'bytes':>14}{'time (ring)':>14}",
    ]
    lines += [
        f"  {c.mesh_dim:<10}{c.kind:<16}{c.group_size:>7}{c.count:>8}{human_bytes(c.bytes):>14}{human_seconds(c.seconds):>14}"
        for c in report.collectives
    ]
    lines.append(
        f"  {'total':<10}{'':<16}{'':>7}{report.comm_count:>8}{human_bytes(report.comm_bytes):>14}"
        f"{human_seconds(report.comm_seconds):>14}"
    )
    lines += [f"\nnote: {note}" for note in report.notes]
    return "\n".join(lines)


def format_comparison(reports: Sequence[PlanReport], *, by_rank: bool = False) -> str:
    """One row per plan (per plan and rank with ``by_rank``): memory per rank and the step's communication."""
    if by_rank:
        reports = [replace(r, plan=f"{r.plan} rank {r.rank}") for r in reports]
    width = max(len("plan"), *(len(r.plan) for r in reports))
    header = (
        f"{'plan':<{width}}{'ranks':>7}{'params':>12}{'grads':>12}{'optimizer':>12}{'activations':>13}"
        f"{'peak':>12}{'collectives':>13}{'comm bytes':>13}{'comm time':>12}"
    )
    rows = [
        f"{r.plan:<{width}}{r.world_size:>7}{human_bytes(r.state.params):>12}{human_bytes(r.state.grads):>12}"
        f"{human_bytes(r.state.optimizer):>12}{human_bytes(r.activations_peak):>13}{human_bytes(r.peak):>12}"
        f"{r.comm_count:>13}{human_bytes(r.comm_bytes):>13}{human_seconds(r.comm_seconds):>12}"
        for r in reports
    ]
    notes = [f"note ({r.plan}): {note}" for r in reports for note in r.notes]
    return "\n".join([header, *rows, *notes])
