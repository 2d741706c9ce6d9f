"""run_multiprocess: run a function on N real gloo processes, one rank each, bounded in time.

The threaded world covers most tests; this harness is for what only real process groups show
(c10d sub-groups, torch.distributed.checkpoint's own collectives, a rank that dies). The
rendezvous store lives in the parent on a port the OS picks, so parallel runs never race for a
port; every rank meets at a barrier before tearing its group down; a failing rank fails the run
with every failing rank's traceback; per-rank return values come back through the store.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]
from torch.multiprocessing.spawn import ProcessException, start_processes

__all__ = ["RankFailed", "run_multiprocess"]

DEFAULT_TIMEOUT_S = 60.0
"""Longest a whole run (and any one gloo collective in it) may take unless the caller says otherwise."""
GRACE_S = 2.0
"""After one rank fails, how long the others get to report their own errors before being killed."""


class RankFailed(AssertionError):
    """A rank of a multi-process run raised or died; the message holds every failing rank's traceback."""


def _rank_entry(
    rank: int, fn: Callable[..., Any], world_size: int, port: int, timeout_s: float, args: tuple[Any, ...]
) -> None:
    # Keep gloo's own connections on loopback, whatever the host name resolves to.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # small tensors; several ranks share the machine's cores
    timeout = timedelta(seconds=timeout_s)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        result = fn(*args)
        store.set(f"dtensor/result/{rank}", pickle.dumps(result))  # type: ignore[arg-type]
        # No rank tears the group down while a peer still has gloo work in flight (that aborts
        # the process with "terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Nor does a rank exit (closing its gloo sockets) while a peer is still tearing down: the same
    # abort, seen now and then on a loaded machine. The store outlives the group.
    store.add("dtensor/torn_down", 1)
    deadline = time.monotonic() + timeout_s
    while store.add("dtensor/torn_down", 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.01)
    # Leave without running interpreter-exit destructors of leftover c10d objects (gloo's threads
    # can abort there); the result is already in the store and output is flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_multiprocess(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S
) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` spawned processes joined in one gloo default group.

    Returns each rank's return value, in rank order (values must pickle). ``fn`` must be importable
    by the children (a module-level function). Raises ``RankFailed`` if any rank fails and
    ``TimeoutError`` if the run takes longer than ``timeout`` seconds.
    """
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = start_processes(  # type: ignore[no-untyped-call]
        _rank_entry,
        args=(fn, world_size, store.port, timeout, args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic()), grace_period=GRACE_S):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{fn.__name__} on {world_size} gloo processes did not finish in {timeout:g}s")
    except ProcessException as error:
        raise RankFailed(_failure_report(context, error)) from None
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()
    return [pickle.loads(store.get(f"dtensor/result/{rank}")) for rank in range(world_size)]


def _failure_report(context: Any, error: ProcessException) -> str:
    """The error join() raised, plus the tracebacks of any other rank that failed in the grace period."""
    report = [str(error)]
    for rank, path in enumerate(context.error_files):
        if rank != error.error_index and os.path.exists(path) and os.path.getsize(path):
            with open(path, "rb") as file:
                report.append(f"\n-- Process {rank} also failed:\n{pickle.load(file)}")
    return "".join(report)
