"""Collective backends behind one interface: c10d (torch.distributed) and the threaded world."""

from __future__ import annotations

import threading

import torch.distributed

from spmd.comm.base import (
    CollectiveAbortedError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveRecord,
    CollectiveTimeoutError,
    Communicator,
    World,
    active_world,
    add_comm_observer,
    remove_comm_observer,
    use_world,
)
from spmd.comm.run import run_threaded
from spmd.comm.threaded import ThreadedWorld

__all__ = [
    "CollectiveAbortedError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveRecord",
    "CollectiveTimeoutError",
    "Communicator",
    "ThreadedWorld",
    "World",
    "active_world",
    "add_comm_observer",
    "current_world",
    "remove_comm_observer",
    "run_threaded",
    "use_world",
]

_c10d_world_lock = threading.Lock()
_c10d_world: World | None = None


def current_world(device_type: str = "cpu", *, timeout_s: float | None = None) -> World:
    """The world the caller is a rank of: the one ``use_world`` set (threads), else the c10d default group.

    Under torchrun the default group is created on first use (gloo for cpu, nccl for cuda), with
    ``timeout_s`` as its collective timeout when given.
    """
    global _c10d_world
    world = active_world()
    if world is not None:
        return world
    from spmd.comm.c10d import C10dWorld

    with _c10d_world_lock:
        C10dWorld.ensure_initialized(device_type, timeout_s)
        # A torchrun job may tear the default group down and start a new one (tests do).
        if _c10d_world is None or _c10d_world.size != torch.distributed.get_world_size():
            _c10d_world = C10dWorld(device_type)
        return _c10d_world
