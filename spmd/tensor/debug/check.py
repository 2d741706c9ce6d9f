"""Collective check: before a collective, the ranks of its group compare what they are about to do.

Two levels. The **warm-up check** is on by default: the first ``WARMUP_RUNS`` (2) times a rank
issues a given collective (same kind, group, mesh dim, shape, dtype, reduce op or source, and the
redistribute step with the tensor's spec) it is checked, after that it runs unchecked, so a steady
training loop pays one dict lookup per collective. ``SPMD_DEBUG=nocheck``,
``set_warmup_check(False)`` or ``with warmup_check(False):`` turn it off. The **full check**,
``SPMD_DEBUG=check`` for the whole process or ``with check_collectives():`` for the calling rank
(every rank must enter it at the same point of its program), checks every collective.

Each collective gets a ``CheckTicket`` (what ranks must agree on, as values) and goes to its
communicator's ``_verify``. The threaded world carries the ticket in the collective's own round and
compares the tickets' keys before anyone reads the data (no extra exchange; compiled code carries
none). Over c10d the full check all-gathers an 8-byte digest of each rank's
``CollectiveFingerprint`` first, and the warm-up check exchanges fingerprints through the job's
store (spmd/comm/store_check.py). If they differ, every rank of the group raises
``CollectiveMismatchError`` naming the ranks that differ and showing each side's fingerprint and
call site, instead of exchanging data that would silently mix two different computations (or hang).
Ranks count what they compare, not call sites, so ranks that agree check the same collectives;
ranks that disagree at a collective one of them has issued twice (a rank-dependent branch) meet a
check on one side and an unchecked collective on the other, which both backends report as above
instead of hanging.

The call site is shown but not compared: the same collective may legally be issued from two lines
(two branches of an ``if`` that do the same thing). A rank that never arrives at the exchange is
released by the group's timeout, as any collective is.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from spmd.comm.base import (
    CheckTicket,
    CollectiveMismatchError,
    Communicator,
)
from spmd.comm.replicas import call_site, user_frame
from spmd.tensor.spec import DTENSOR_DTYPE_SHORT
from spmd.tensor.trace import STATE, current_op

__all__ = [
    "COLLECTIVE_CHECK",
    "CollectiveFingerprint",
    "CollectiveMismatchError",
    "check_collectives",
    "set_check_collectives",
    "warmup_check",
    "set_warmup_check",
    "is_warmup_check",
    "WARMUP_RUNS",
]

WARMUP_RUNS = 2
"""How many times each rank checks each distinct collective before it runs it unchecked."""
WARMUP_KEYS_LIMIT = 100_000
"""Distinct collectives remembered per group; beyond it (shapes that never repeat) new ones run
unchecked, on every rank alike since ranks that agree remember the same ones."""


@dataclass(frozen=True, slots=True)
class CollectiveFingerprint:
    """What one rank is about to issue; ranks compare everything but ``rank``, ``op`` and ``call_site``.

    ``op`` is shown, not compared: ops name themselves only while a debug tool listens, which one
    rank may do alone (a CommDebugMode on rank 0); the redistribute step in ``placements`` says the rest.
    """

    rank: int
    collective: str
    mesh_dim: str | None
    ranks: tuple[int, ...]
    shape: tuple[int, ...] | None
    dtype: str | None
    detail: str
    """The reduce op, or ``src=i`` for broadcast and scatter."""
    placements: str
    """The redistribute that issued it: the tensor's spec and the step, when known."""
    op: str | None
    """The aten op (or "redistribute") being run, when known (shown, not compared)."""
    call_site: str
    """The first frame outside spmd and torch: ``file.py:42 in step``."""
    checked: bool = True
    """False for a rank that issued it unchecked (it had checked it before): shown, not compared."""

    def compared(self) -> tuple[Any, ...]:
        """The fields ranks must agree on."""
        return (
            self.collective,
            self.mesh_dim,
            self.ranks,
            self.shape,
            self.dtype,
            self.detail,
            self.placements,
        )

    def digest(self) -> int:
        """The compared fields as a signed 64-bit number, equal on every process for equal fields."""
        raw = hashlib.blake2b(repr(self.compared()).encode(), digest_size=8).digest()
        return int.from_bytes(raw, "little", signed=True)

    def __str__(self) -> str:
        detail = f"({self.detail})" if self.detail else ""
        label = self.mesh_dim if self.mesh_dim is None or self.mesh_dim.isdigit() else repr(self.mesh_dim)
        where = f" on mesh dim {label}" if label is not None else ""
        tensor = f" {self.dtype}[{','.join(map(str, self.shape))}]" if self.shape is not None else ""
        op = f" in {self.op}" if self.op else ""
        placements = f" [{self.placements}]" if self.placements else ""
        unchecked = "" if self.checked else " (not checked: this rank had issued it before)"
        return f"{self.collective}{detail}{where}{tensor}{op}{placements} at {self.call_site}{unchecked}"


_local = threading.local()
_lock = threading.Lock()
_users = 0
"""Threads inside check_collectives (plus one while SPMD_DEBUG=check): ops name themselves while > 0."""
_everywhere = False
_warmup = True
"""The warm-up check's process-wide switch (``set_warmup_check``); ``warmup_check`` overrides it per thread."""


def _enabled_here() -> bool:
    return _everywhere or getattr(_local, "depth", 0) > 0


def _warmup_here() -> bool:
    override: bool | None = getattr(_local, "warmup", None)
    return _warmup if override is None else override


def _retain() -> None:
    global _users
    with _lock:
        _users += 1
        STATE.checks = _users
        STATE.refresh()


def _release() -> None:
    global _users
    with _lock:
        _users -= 1
        STATE.checks = _users
        STATE.refresh()


@contextlib.contextmanager
def check_collectives() -> Iterator[None]:
    """Compare every collective the calling rank issues inside the block with its group's ranks.

    >>> with check_collectives():  # doctest: +SKIP
    ...     loss = model(batch).sum()
    """
    _local.depth = getattr(_local, "depth", 0) + 1
    _retain()
    try:
        yield
    finally:
        _local.depth -= 1
        _release()


def set_check_collectives(enabled: bool) -> None:
    """Turn the full check on or off for every rank of this process (what ``SPMD_DEBUG=check`` does)."""
    global _everywhere
    if enabled == _everywhere:
        return
    _everywhere = enabled
    if enabled:
        _retain()
    else:
        _release()


def set_warmup_check(enabled: bool) -> None:
    """Turn the warm-up check on (the default) or off for every rank of this process.

    ``SPMD_DEBUG=nocheck`` turns it off. Every rank of a group must use the same setting: a rank
    that checks while its peers do not waits for them at the check.
    """
    global _warmup
    _warmup = enabled


def is_warmup_check() -> bool:
    """Whether the calling thread's collectives are warm-up checked."""
    return _warmup_here()


@contextlib.contextmanager
def warmup_check(enabled: bool) -> Iterator[None]:
    """Turn the warm-up check on or off for the calling rank inside the block (every rank alike).

    >>> with warmup_check(False):  # doctest: +SKIP
    ...     train_step(model, batch)
    """
    outer = getattr(_local, "warmup", None)
    _local.warmup = enabled
    try:
        yield
    finally:
        _local.warmup = outer


def _call_site() -> str:
    """Where the user's code issued the collective: ``file.py:42 in step``."""
    return call_site(user_frame())


def fingerprint(
    comm: Communicator, kind: str, shape: tuple[int, ...] | None, dtype: torch.dtype | None, detail: str
) -> CollectiveFingerprint:
    """The calling rank's fingerprint of the collective ``kind`` it is about to issue on ``comm``."""
    return CollectiveFingerprint(
        rank=comm.ranks[comm.local_rank],
        collective=kind,
        mesh_dim=comm.mesh_dim,
        ranks=comm.ranks,
        shape=shape,
        dtype=DTENSOR_DTYPE_SHORT.get(dtype, str(dtype)) if dtype is not None else None,
        detail=detail,
        placements=", step ".join(str(part) for part in comm.context),
        op=current_op(),
        call_site=_call_site(),
    )


def _side_of(ticket: CheckTicket) -> CollectiveFingerprint:
    """This rank's fingerprint of ``ticket``'s collective, marked when the rank did not check it."""
    mine = fingerprint(ticket.comm, ticket.kind, ticket.shape, ticket.dtype, ticket.detail)
    return mine if ticket.checked else replace(mine, checked=False)


def _check_before_collective(comm: Communicator, kind: str, tensor: torch.Tensor | None, detail: str) -> None:
    """The hook every collective calls first: decide whether this one is checked, then hand it over."""
    full = _enabled_here()
    if not full and not _warmup_here():
        return
    shape = tensor.shape if tensor is not None else None
    dtype = tensor.dtype if tensor is not None else None
    # What ranks must agree on, as values (cheap to build); counted per rank, so ranks that agree
    # count alike and check the same collectives.
    key = (kind, comm.mesh_dim, comm.ranks, shape, dtype, detail, comm.context)
    checked = full
    if not full:
        counts = comm._warmup_counts
        counted = (comm.local_rank, key)
        seen = counts.get(counted, 0)
        if seen < WARMUP_RUNS and (seen > 0 or len(counts) < WARMUP_KEYS_LIMIT):
            counts[counted] = seen + 1
            checked = True
    ticket = CheckTicket(comm, kind, tuple(shape) if shape is not None else None, dtype, detail, key, checked)
    comm._verify(ticket)


def _mismatch_error(comm: Communicator, seq: int, sides: list[Any]) -> CollectiveMismatchError:
    """The error every member of ``comm``'s group raises: who differs from the majority, and each side."""
    compared = [side.compared() if isinstance(side, CollectiveFingerprint) else side for side in sides]
    votes = Counter(compared)
    majority = max(votes.values())
    # The odd ones out are named: the most common side (the lowest rank's, on a tie) is the reference.
    reference = next(i for i, c in enumerate(compared) if votes[c] == majority)
    differing = [comm.ranks[i] for i, c in enumerate(compared) if c != compared[reference]]
    groups: dict[Any, list[int]] = {}
    shown: dict[Any, Any] = {}
    for rank, side in zip(comm.ranks, sides):
        key = (*side.compared(), side.call_site, side.checked) if isinstance(side, CollectiveFingerprint) else side
        groups.setdefault(key, []).append(rank)
        shown.setdefault(key, side)
    lines = "\n".join(f"  ranks {ranks}: {shown[key]}" for key, ranks in groups.items())
    group = comm.describe("").strip()  # "on mesh dim 'tp' (ranks [0, 1])"
    which = "a collective" if seq < 0 else f"a collective (their #{seq} on this group)"
    return CollectiveMismatchError(
        f"rank {comm.ranks[comm.local_rank]}: collective check: the ranks {group} disagree on {which}; "
        f"ranks {differing} differ from rank {comm.ranks[reference]}:\n{lines}\n"
        "Every rank must issue the same collectives, with the same shapes, dtypes, placements and reduce "
        "ops, in the same order; make the ranks above take the same path (their call sites show where)."
    )


class _CollectiveCheck:
    """The check as ``spmd.comm`` calls it (``spmd.hooks.CollectiveCheck``); installed by spmd/tensor/__init__.py."""

    before = staticmethod(_check_before_collective)
    full_check_here = staticmethod(_enabled_here)
    side_of = staticmethod(_side_of)
    mismatch_error = staticmethod(_mismatch_error)


COLLECTIVE_CHECK = _CollectiveCheck()
