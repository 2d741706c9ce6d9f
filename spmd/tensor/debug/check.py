"""Collective check: before each collective, the ranks of its group compare what they are about to do.

Off by default. ``SPMD_DEBUG=check`` turns it on for the whole process; ``with check_collectives():``
turns it on for the calling rank (every rank must enter it at the same point of its program, as
with any collective). Each collective is then preceded by one 8-byte all_gather over the same
group, of a digest of the rank's ``CollectiveFingerprint``: the collective, its mesh dim and ranks,
the tensor's shape and dtype, the reduce op (or source), the op and redistribute step that issued
it, and the user's call site. If the digests differ, the ranks exchange the fingerprints
themselves and every rank of the group raises
``CollectiveMismatchError`` naming the ranks that differ and showing both fingerprints, instead of
exchanging data that would silently mix two different computations (or hang).

The call site is shown but not compared: the same collective may legally be issued from two lines
(two branches of an ``if`` that do the same thing). A rank that never arrives at the exchange is
released by the group's timeout, as any collective is.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from spmd.tensor.comm.base import CollectiveMismatchError, Communicator, set_collective_check
from spmd.tensor.spec import DTENSOR_DTYPE_SHORT
from spmd.tensor.trace import STATE, current_op

__all__ = ["CollectiveFingerprint", "CollectiveMismatchError", "check_collectives", "set_check_collectives"]


@dataclass(frozen=True, slots=True)
class CollectiveFingerprint:
    """What one rank is about to issue; ranks compare everything but ``rank`` and ``call_site``."""

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
    """The aten op (or "redistribute") being run, when known."""
    call_site: str
    """The first frame outside spmd and torch: ``file.py:42 in step``."""

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
            self.op,
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
        return f"{self.collective}{detail}{where}{tensor}{op}{placements} at {self.call_site}"


_local = threading.local()
_lock = threading.Lock()
_users = 0
"""Threads inside check_collectives (plus one while SPMD_DEBUG=check): the hook is installed while > 0."""
_everywhere = False


def _enabled_here() -> bool:
    return _everywhere or getattr(_local, "depth", 0) > 0


def _retain() -> None:
    global _users
    with _lock:
        _users += 1
        if _users == 1:
            set_collective_check(_check_before_collective)
        STATE.checks = _users
        STATE.refresh()


def _release() -> None:
    global _users
    with _lock:
        _users -= 1
        if _users == 0:
            set_collective_check(None)
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
    """Turn the check on or off for every rank of this process (what ``SPMD_DEBUG=check`` does)."""
    global _everywhere
    if enabled == _everywhere:
        return
    _everywhere = enabled
    if enabled:
        _retain()
    else:
        _release()


_SPMD_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The spmd package's folder (this file is spmd/tensor/debug/check.py)."""
_LIBRARY_DIRS = (
    _SPMD_DIR + os.sep,
    *(os.path.dirname(module.__file__ or "") + os.sep for module in (torch, contextlib, threading)),
)


def _call_site() -> str:
    """The innermost frame outside spmd, torch and the standard library: where the user's code is."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    path = frame.f_code.co_filename
    with contextlib.suppress(ValueError):
        relative = os.path.relpath(path)
        path = path if relative.startswith("..") else relative
    return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"


def fingerprint(comm: Communicator, kind: str, tensor: torch.Tensor | None, detail: str) -> CollectiveFingerprint:
    """The calling rank's fingerprint of the collective ``kind`` it is about to issue on ``comm``."""
    return CollectiveFingerprint(
        rank=comm.ranks[comm.local_rank],
        collective=kind,
        mesh_dim=comm.mesh_dim,
        ranks=comm.ranks,
        shape=tuple(tensor.shape) if tensor is not None else None,
        dtype=DTENSOR_DTYPE_SHORT.get(tensor.dtype, str(tensor.dtype)) if tensor is not None else None,
        detail=detail,
        placements=", step ".join(str(part) for part in comm.context),
        op=current_op(),
        call_site=_call_site(),
    )


def _check_before_collective(comm: Communicator, kind: str, tensor: torch.Tensor | None, detail: str) -> None:
    if not _enabled_here():
        return
    mine = fingerprint(comm, kind, tensor, detail)
    # The backend's own collectives (not recorded, not checked again): first an 8-byte digest of the
    # compared fields, and only when the digests differ the fingerprints themselves, for the message.
    digests = comm._all_gather(torch.tensor([mine.digest()], dtype=torch.int64))
    if bool((digests == digests[0]).all()):
        return
    everyone: list[CollectiveFingerprint] = comm._all_gather_object(mine)
    votes = Counter(fp.compared() for fp in everyone)
    if len(votes) == 1:
        return
    # The odd ones out are named: the most common fingerprint (the lowest rank's, on a tie) is the reference.
    majority = max(votes.values())
    reference = next(fp for fp in everyone if votes[fp.compared()] == majority)
    differing = [fp.rank for fp in everyone if fp.compared() != reference.compared()]
    raise CollectiveMismatchError(_mismatch_message(comm, kind, everyone, reference, differing))


def _mismatch_message(
    comm: Communicator,
    kind: str,
    everyone: list[CollectiveFingerprint],
    reference: CollectiveFingerprint,
    differing: list[int],
) -> str:
    groups: dict[tuple[Any, ...], list[int]] = {}
    shown: dict[tuple[Any, ...], CollectiveFingerprint] = {}
    for fp in everyone:
        key = (*fp.compared(), fp.call_site)
        groups.setdefault(key, []).append(fp.rank)
        shown.setdefault(key, fp)
    lines = "\n".join(f"  ranks {ranks}: {shown[key]}" for key, ranks in groups.items())
    group = comm.describe("").strip()  # "on mesh dim 'tp' (ranks [0, 1])"
    return (
        f"rank {comm.ranks[comm.local_rank]}: collective check: the ranks {group} disagree on their next "
        f"collective; ranks {differing} differ from rank {reference.rank}:\n{lines}\n"
        "Every rank must issue the same collectives, with the same shapes, dtypes, placements and reduce "
        "ops, in the same order; make the ranks above take the same path (their call sites show where)."
    )
