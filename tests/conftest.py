"""The ``world`` fixture: a test that takes it runs once on rank threads and once on gloo processes.

The threads are fast and run everywhere; the gloo processes go through c10d's real process groups.
The gloo run is marked ``multiprocess``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from spmd.testing import run_multiprocess, run_threaded


@dataclass(frozen=True)
class World:
    """``world(fn, world_size, *args)`` runs ``fn(*args)`` on ``world_size`` ranks and returns each
    rank's result, in rank order.

    On ``"gloo"`` each rank is a process: ``fn`` must be a module-level function, and its arguments
    and results must pickle. ``timeout`` bounds the run (the defaults of ``run_threaded`` and
    ``run_multiprocess`` otherwise).
    """

    name: str
    run: Callable[..., list[Any]]

    def __call__(self, fn: Callable[..., Any], world_size: int, *args: Any, timeout: float | None = None) -> list[Any]:
        return self.run(fn, world_size, *args, **({} if timeout is None else {"timeout": timeout}))


WORLDS = {"threads": World("threads", run_threaded), "gloo": World("gloo", run_multiprocess)}


@pytest.fixture(params=["threads", pytest.param("gloo", marks=pytest.mark.multiprocess)])
def world(request: pytest.FixtureRequest) -> World:
    """Rank threads (``spmd.testing.run_threaded``), then gloo processes (``spmd.testing.run_multiprocess``)."""
    return WORLDS[request.param]
