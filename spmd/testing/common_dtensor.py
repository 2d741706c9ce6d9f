"""DTensorTestBase and with_comms: PyTorch's DTensor test surface, on the threaded world.

A test method decorated with ``@with_comms`` runs once per rank, each rank a thread of one
in-process world created for that test; ``run_subtests`` loops over many cases inside that one
world, so the world is not rebuilt for every case.
"""

from __future__ import annotations

import functools
import itertools
import unittest
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from spmd.comm import active_world, current_world, run_threaded
from spmd.tensor.device_mesh.init import init_device_mesh
from spmd.tensor.device_mesh.mesh import DeviceMesh

__all__ = ["DTensorTestBase", "with_comms", "run_subtests", "NUM_DEVICES", "DEVICE_TYPE"]

F = TypeVar("F", bound=Callable[..., Any])
NUM_DEVICES = 4
DEVICE_TYPE = "cpu"


def run_subtests(
    cases: dict[str, Sequence[Any]], test_fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> None:
    """Call ``test_fn(*args, **kwargs, **case)`` for every combination of the values in ``cases``.

    A failure says which case failed (in a note on the exception) and stops the loop on every rank.
    """
    names = list(cases)
    for values in itertools.product(*(cases[name] for name in names)):
        case = dict(zip(names, values))
        try:
            test_fn(*args, **kwargs, **case)
        except Exception as error:
            if hasattr(error, "add_note"):
                error.add_note("subtest " + ", ".join(f"{k}={v!r}" for k, v in case.items()))
            raise


def with_comms(func: F | None = None, *, timeout: float | None = None) -> Any:
    """Run a ``DTensorTestBase`` test method on every rank of a fresh threaded world."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def wrapper(self: DTensorTestBase, *args: Any, **kwargs: Any) -> Any:
            if active_world() is not None:  # already inside a world (nested helper)
                return method(self, *args, **kwargs)
            limit = timeout if timeout is not None else self.timeout
            run_threaded(lambda: method(self, *args, **kwargs), self.world_size, timeout=limit)
            return None

        return wrapper  # type: ignore[return-value]

    return decorate(func) if func is not None else decorate


class DTensorTestBase(unittest.TestCase):
    """Base class for DTensor tests: ``self.rank``, ``self.world_size``, ``build_device_mesh()``."""

    timeout: float = 60.0
    """Seconds a collective may wait before the test fails instead of hanging."""

    world_size: int = NUM_DEVICES
    """Ranks of the world each test runs on; a test class sets ``world_size = 2`` to change it
    (a ``world_size`` property, as in PyTorch's tests, works too)."""

    @property
    def device_type(self) -> str:
        return DEVICE_TYPE

    @property
    def backend(self) -> str:
        return "threaded"

    @property
    def rank(self) -> int:
        return current_world(self.device_type).current_rank()

    def build_device_mesh(self) -> DeviceMesh:
        return init_device_mesh(self.device_type, (self.world_size,))

    def run_subtests(
        self, subtest_config: dict[str, Sequence[Any]], test_fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> None:
        """Loop ``test_fn`` over every combination of ``subtest_config`` (see ``run_subtests``)."""
        run_subtests(subtest_config, test_fn, *args, **kwargs)

    def assert_dtensor_equal(self, actual: Any, expected: torch.Tensor, **tolerances: Any) -> None:
        """``actual.full_tensor()`` equals the plain-torch ``expected``."""
        torch.testing.assert_close(actual.full_tensor(), expected, **tolerances)
