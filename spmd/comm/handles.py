"""The one table from ints to live group objects, for code that can pass only ints.

A ``torch.library`` op takes simple arguments, and torch.compile refuses a c10d ``ProcessGroup``
returned from traced code. Both name their group by an int instead, looked up here when they run:

- ``group_handle(comm)`` / ``communicator_for(handle)``: spmd communicators inside the ``spmd::``
  collective ops. The handle is assigned on first use and cached on the communicator; the table
  holds communicators weakly, so a torn-down world's groups go away with it;
- ``process_group_key(group)`` / ``PROCESS_GROUPS``: the c10d groups ``DeviceMesh.get_group`` has
  returned in traced code, read from this module-level dict (Dynamo takes it as a graph input).
  Held for good, so a key never names a dead group; only traced calls add one.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Protocol

__all__ = ["Named", "group_handle", "communicator_for", "process_group_key", "PROCESS_GROUPS"]


class Named(Protocol):
    """What the table needs of a communicator: a slot for its handle."""

    _handle: int | None


_lock = threading.Lock()
_next_handle = itertools.count()
_communicators: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()

PROCESS_GROUPS: dict[int, Any] = {}
"""c10d groups handed to traced code, by ``id``."""


def group_handle(comm: Named) -> int:
    """The int that names ``comm`` inside a collective op (assigned on first use, then cached on it)."""
    handle = comm._handle
    if handle is None:
        with _lock:
            handle = comm._handle
            if handle is None:
                handle = next(_next_handle)
                _communicators[handle] = comm
                comm._handle = handle
    return handle


def communicator_for(handle: int) -> Any:
    """The communicator ``handle`` names; it must still be alive (its world not torn down)."""
    comm = _communicators.get(handle)
    if comm is None:
        raise RuntimeError(
            f"collective group #{handle} no longer exists: its world was torn down (a finished run_threaded, "
            "a destroyed process group); a function compiled in one world must be compiled again in the next"
        )
    return comm


def process_group_key(group: Any) -> int:
    """Enter ``group`` in ``PROCESS_GROUPS``; its key there."""
    PROCESS_GROUPS.setdefault(id(group), group)
    return id(group)
