"""The one board of late-bound hooks: calls a lower layer makes into a higher one, filled in one place.

spmd's layers import one way (comm <- mesh, placements, specs <- redistribute <- sharding <- DTensor
<- dispatch). Four calls go the other way, and each finds its callee here instead of importing it:

- ``dispatch``: ``DTensor.__torch_dispatch__`` hands every aten call to the dispatcher, which builds
  DTensors, so the class cannot import it (spmd/tensor/dispatch/dispatcher.py);
- ``collective_check``: every collective asks the collective check first (spmd/tensor/debug/check.py),
  which reads the op being dispatched and the redistribute step, both above ``spmd.comm``;
- ``from_local_in_graph``: ``DTensor.from_local`` inside torch.compile records one opaque call, made
  by spmd/compile/from_local.py, which wraps DTensor's eager body and imports ``torch._dynamo``
  (loaded on the first compile, through spmd/compile/lazy.py);
- ``refuse_implicit``: set while explicit redistribution is on (spmd/tensor/debug/explicit.py); the
  dispatcher calls it for a decided move that sends data.

``spmd/tensor/__init__.py`` installs the first three (``install``) once its modules are loaded; the
last is switched on and off at run time. The board imports nothing of spmd, so any layer may read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["CollectiveCheck", "HookBoard", "HOOKS", "install"]


class CollectiveCheck(Protocol):
    """What ``spmd.comm`` asks of the collective check (spmd/tensor/debug/check.py's ``COLLECTIVE_CHECK``)."""

    def before(self, comm: Any, kind: str, tensor: torch.Tensor | None, detail: str) -> None:
        """Runs before each collective on ``comm`` (a ``spmd.comm.base.Communicator``)."""

    def full_check_here(self) -> bool:
        """Whether the calling rank checks every collective (``SPMD_DEBUG=check``; replica checks too)."""

    def side_of(self, ticket: Any) -> Any:
        """This rank's fingerprint of the collective a ``CheckTicket`` describes."""

    def mismatch_error(self, comm: Any, seq: int, sides: list[Any]) -> Exception:
        """The error every member raises when the sides (one per member, in group order) disagree."""


def _not_installed(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("spmd's hooks are not installed; import spmd.tensor to use DTensors")


@dataclass(slots=True)
class HookBoard:
    """The late-bound calls, read per use (one attribute read each)."""

    dispatch: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] = _not_installed
    collective_check: CollectiveCheck | None = None
    from_local_in_graph: Callable[..., Any] = _not_installed
    refuse_implicit: Callable[..., None] | None = None


HOOKS = HookBoard()
"""Late by design: the calls listed above go up the import stack, so their callees cannot be imported;
``install`` (spmd/tensor/__init__.py) and explicit mode fill them, each in one place."""


def install(
    *,
    dispatch: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any],
    collective_check: CollectiveCheck,
    from_local_in_graph: Callable[..., Any],
) -> None:
    """Fill the board (spmd/tensor/__init__.py, once its modules are loaded)."""
    HOOKS.dispatch = dispatch
    HOOKS.collective_check = collective_check
    HOOKS.from_local_in_graph = from_local_in_graph
