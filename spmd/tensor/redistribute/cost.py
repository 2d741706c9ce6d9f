"""The ring model: what one collective costs, in bytes a rank receives and in seconds.

The one cost model of the library: the redistribute planner, the op propagator (through
``redistribute_cost``), ``CollectiveRecord.moved_bytes`` and the simulator's report all read it.

A collective over ``n`` ranks works on a buffer of ``B`` bytes per rank: the full, unsplit buffer
(the gathered output of an all_gather, the stacked input of a reduce_scatter or all_to_all). Under
ring algorithms a rank receives

* ``(n-1)/n * B`` for all_gather, reduce_scatter, all_to_all and scatter;
* ``2(n-1)/n * B`` for all_reduce (a reduce_scatter, then an all_gather);
* ``B`` for broadcast.

Its time is ``rounds * latency + received / bandwidth``, with ``2(n-1)`` rounds for all_reduce and
``n-1`` for the others. A group of one rank moves nothing and takes no time.

This module imports nothing of the library, so any layer may read it.
"""

from __future__ import annotations

__all__ = [
    "RING_KINDS",
    "collective_bytes",
    "collective_rounds",
    "collective_seconds",
    "received_bytes",
]

_RING_MULTIPLE = {"all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "scatter": 1, "all_reduce": 2}
"""kind -> how many times ``(n-1)/n`` of the buffer a rank receives (broadcast, all of it, is apart)."""

RING_KINDS = frozenset({*_RING_MULTIPLE, "broadcast"})
"""The collectives the ring model prices."""


def _share(kind: str, group_size: int) -> tuple[int, int]:
    """The fraction ``(numerator, denominator)`` of the buffer a rank receives."""
    if kind not in RING_KINDS:
        raise ValueError(f"the ring model has no cost for collective {kind!r}; use one of {sorted(RING_KINDS)}")
    n = group_size
    if n <= 1:
        return 0, 1
    if kind == "broadcast":
        return 1, 1
    return _RING_MULTIPLE[kind] * (n - 1), n


def collective_bytes(kind: str, group_size: int, buffer_bytes: int) -> float:
    """Bytes one rank receives when ``kind`` runs over ``group_size`` ranks on a ``buffer_bytes`` buffer.

    ``collective_bytes("all_reduce", 4, 1000) == 1500.0``; see the module docstring for the buffer.
    """
    num, den = _share(kind, group_size)
    return num * buffer_bytes / den


def received_bytes(kind: str, group_size: int, buffer_bytes: int) -> int:
    """``collective_bytes`` rounded down to whole bytes (what a record of one collective reports)."""
    num, den = _share(kind, group_size)
    return num * buffer_bytes // den


def collective_rounds(kind: str, group_size: int) -> int:
    """Rounds of the ring: ``2(n-1)`` for all_reduce, ``n-1`` for the others, 0 on one rank."""
    _share(kind, group_size)
    n = group_size
    if n <= 1:
        return 0
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def collective_seconds(kind: str, group_size: int, buffer_bytes: int, bandwidth: float, latency: float) -> float:
    """Seconds ``kind`` takes over ``group_size`` ranks on a link of ``bandwidth`` bytes/s and
    ``latency`` seconds per round: ``rounds * latency + collective_bytes / bandwidth``.

    ``collective_seconds("all_reduce", 8, 10**6, 100e9, 1e-6) == 14e-6 + 1.75e6 / 100e9``.
    """
    rounds = collective_rounds(kind, group_size)
    if rounds == 0:
        return 0.0
    return rounds * latency + collective_bytes(kind, group_size, buffer_bytes) / bandwidth
