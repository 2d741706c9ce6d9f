"""Legacy path of ``spmd.comm.threaded`` and ``run_threaded``."""

from spmd.comm.run import run_threaded
from spmd.comm.threaded import (
    DEFAULT_TIMEOUT_S,
    CollectiveAbortedError,
    CollectiveTimeoutError,
    ThreadedWorld,
    current_threaded_world,
    thread_rank,
)

__all__ = [
    "ThreadedWorld",
    "run_threaded",
    "current_threaded_world",
    "thread_rank",
    "CollectiveTimeoutError",
    "CollectiveAbortedError",
    "DEFAULT_TIMEOUT_S",
]
