"""The warm-up check over c10d: checks through the job's key-value store, so a disagreement never hangs.

A rank checks the first runs of each distinct collective. Ranks that agree check the same ones, but
ranks that disagree may not: at a rank-dependent branch, one rank reaches a collective it has
checked twice (so it issues it at once) while its peer reaches one it never issued (so it checks).
Had the check been a gloo collective, the two would wait in two different collectives forever.

So here a check is an exchange through the store, in a slot named by the group and the collective's
position on it (``collective_check/<group>/<n>/<rank>``): each checking rank writes its fingerprint and
waits for every member's. A member that went on unchecked into collective ``n`` does not write, but
its process's watchdog thread does, once the collective has waited ``STALL_S``: its fingerprint,
marked unchecked, with the call site read from the waiting thread's stack. The checking rank then
sees the disagreement, writes the verdict to the slot and raises; the unchecked member raises the
same ``CollectiveMismatchError`` when its collective ends (its peer's process exits, or the group's
timeout), from the verdict in the store. The full check (``SPMD_DEBUG=check``) checks every
collective on every rank, so it keeps its 8-byte all_gather over the group itself.
"""

from __future__ import annotations

import dataclasses
import pickle
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from spmd.comm.base import (
    CheckTicket,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    Communicator,
    mismatch_error,
    mismatch_side,
)
from spmd.comm.replicas import call_site, user_frame

__all__ = ["STALL_S", "check_through_store", "issue_unchecked", "done_unchecked", "verdict_for"]

STALL_S = 1.0
"""How long an unchecked collective waits before the watchdog writes its fingerprint to the store."""
_WATCH_EVERY_S = 0.25

_in_flight: dict[int, tuple[CheckTicket, Communicator, int, float]] = {}
"""Thread id -> (ticket, communicator, position, start) of the unchecked collective that thread is in."""
_posted: set[str] = set()
_watchdog: threading.Thread | None = None
_watchdog_lock = threading.Lock()


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def slot_prefix(comm: Communicator, n: int) -> str:
    return f"collective_check/{comm.group_name}/{n}/"


def check_through_store(comm: Communicator, ticket: CheckTicket, n: int) -> None:
    """Compare ``ticket`` with every member's side of collective ``n`` on ``comm``'s group; raise if any differs."""
    prefix = slot_prefix(comm, n)
    me = dist.get_rank()
    store = _store()
    store.set(prefix + str(me), pickle.dumps(mismatch_side(ticket, ticket.kind)))
    keys = [prefix + str(rank) for rank in comm.ranks]
    timeout = comm.timeout_s if comm.timeout_s is not None else 1800.0
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except RuntimeError as error:
        missing = [rank for rank, key in zip(comm.ranks, keys) if not store.check([key])]
        raise CollectiveTimeoutError(
            f"rank {me}: {comm.describe(ticket.kind)} timed out after {timeout:g}s at its warm-up check, waiting "
            f"for ranks {missing}, which never arrived at it (stuck in their own code, or dead)"
        ) from error
    sides = [pickle.loads(value) for value in store.multi_get(keys)]
    compared = [side.compared() if hasattr(side, "compared") else side for side in sides]
    if all(c == compared[0] for c in compared):
        return  # (a member that issued it unchecked had counted it more often: nothing wrong)
    mismatch = mismatch_error(comm, -1, sides)
    store.set(prefix + "verdict", str(mismatch).split(": ", 1)[1])
    raise mismatch


def issue_unchecked(ticket: CheckTicket, comm: Communicator, n: int) -> None:
    """Note that the calling thread issues collective ``n`` unchecked, for the watchdog."""
    _in_flight[threading.get_ident()] = (ticket, comm, n, time.monotonic())
    if _watchdog is None:
        _start_watchdog()


def done_unchecked() -> tuple[CheckTicket, Communicator, int, float] | None:
    """The calling thread left its unchecked collective; return what was noted of it."""
    return _in_flight.pop(threading.get_ident(), None)


def verdict_for(noted: tuple[CheckTicket, Communicator, int, float] | None) -> CollectiveMismatchError | None:
    """The mismatch a peer found at the noted collective (its verdict in the store), if any."""
    if noted is None or slot_prefix(noted[1], noted[2]) not in _posted:
        return None
    try:
        store = _store()
        key = slot_prefix(noted[1], noted[2]) + "verdict"
        if not store.check([key]):
            return None
        return CollectiveMismatchError(f"rank {dist.get_rank()}: {store.get(key).decode()}")
    except Exception:  # the store may be gone with the rank that hosted it
        return None


def _start_watchdog() -> None:
    global _watchdog
    with _watchdog_lock:
        if _watchdog is None:
            _watchdog = threading.Thread(target=_watch, name="spmd-check-watchdog", daemon=True)
            _watchdog.start()


def _watch() -> None:
    """Write the fingerprint of every unchecked collective that has waited STALL_S into its slot."""
    while True:
        time.sleep(_WATCH_EVERY_S)
        now = time.monotonic()
        for thread_id, (ticket, comm, n, start) in list(_in_flight.items()):
            prefix = slot_prefix(comm, n)
            if now - start < STALL_S or prefix in _posted:
                continue
            _posted.add(prefix)
            try:
                frame = sys._current_frames().get(thread_id)
                side = mismatch_side(ticket, ticket.kind)
                if dataclasses.is_dataclass(side) and hasattr(side, "call_site"):
                    side = dataclasses.replace(side, call_site=call_site(user_frame(frame)))  # type: ignore[type-var]
                _store().set(prefix + str(dist.get_rank()), pickle.dumps(side))
            except Exception:  # a failing store only loses the early report; the timeout still ends the wait
                continue
