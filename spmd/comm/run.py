"""``run_threaded``: start one thread per rank of a ``ThreadedWorld``, run a function on each, join them.

While the ranks run, the world is the current world of each rank thread (``use_world``) and, when the
process has none, c10d's default group (spmd/comm/threaded_c10d.py), so ``init_device_mesh`` and
``torch.distributed`` calls inside the function work as under torchrun.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from spmd.comm.base import use_world
from spmd.comm.threaded import DEFAULT_TIMEOUT_S, ThreadedWorld
from spmd.comm.threaded_c10d import default_group_of

__all__ = ["run_threaded"]

T = TypeVar("T")


def run_threaded(
    fn: Callable[..., T], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` threads, each a rank; return results in rank order.

    Inside ``fn``, ``init_device_mesh("cpu", ...)`` builds meshes over this world exactly as it would
    under torchrun. If a rank raises, the others are released and the first error is re-raised here
    with the failing rank in a note (``CollectiveAbortedError`` on the bystanders is not reported).
    """
    world = ThreadedWorld(world_size, timeout=timeout)
    results: list[Any] = [None] * world_size
    _run_ranks(world, fn, args, kwargs, results, timeout)
    return results


def _run_ranks(
    world: ThreadedWorld,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    results: list[Any],
    timeout: float,
) -> None:
    """Start one thread per rank running ``fn`` and wait for them; re-raise the first rank's error."""
    world_size = world.size

    def rank_main(rank: int) -> None:
        try:
            # For CUDA tensors autograd would run backward on its own per-device worker thread,
            # which is no rank of the world; keep it on the rank thread (a thread-local setting).
            with world.as_rank(rank), use_world(world), torch.autograd.set_multithreading_enabled(False):
                results[rank] = fn(*args, **kwargs)
        except BaseException as error:
            world.abort(rank, error)

    with default_group_of(world) as world.is_default_group:
        _start_and_join(world, rank_main, timeout)
    if world.failure is not None:
        rank, error = world.failure
        if hasattr(error, "add_note"):
            error.add_note(f"raised on rank {rank} of a threaded world of {world_size}")
        raise error


def _start_and_join(world: ThreadedWorld, rank_main: Callable[[int], None], timeout: float) -> None:
    """One thread per rank; wait while they make progress, and at most ``timeout`` after one fails."""
    threads = [
        threading.Thread(target=rank_main, args=(rank,), name=f"spmd-rank-{rank}", daemon=True)
        for rank in range(world.size)
    ]
    for thread in threads:
        thread.start()
    # Wait as long as the ranks make progress. Once one fails, the others get ``timeout`` seconds
    # to notice; a rank stuck outside any collective cannot be interrupted, so it is abandoned.
    give_up_at: float | None = None
    for thread in threads:
        while thread.is_alive():
            thread.join(0.05)
            if world.failure is not None and give_up_at is None:
                give_up_at = time.monotonic() + timeout
            if give_up_at is not None and time.monotonic() > give_up_at:
                break
