"""The world of a DTensor loaded where no world runs: its own rank, and no one to talk to.

``torch.load`` of a saved DTensor in a plain process (a notebook inspecting a checkpoint, a
conversion script) rebuilds its mesh on a ``DetachedWorld`` that answers "which rank am I" with the
rank that saved it. Everything local works (``to_local()``, placements, shape, ``.grad``); the
first collective raises, saying how to load it where it can compute.
"""

from __future__ import annotations

from spmd.comm.base import Communicator, World

__all__ = ["DetachedWorld", "DetachedWorldError"]


class DetachedWorldError(RuntimeError):
    """A DTensor loaded outside a running world was asked to communicate."""


class DetachedWorld(World):
    """``size`` ranks of which the caller is ``rank``; no communicator exists."""

    backend_name = "detached"

    def __init__(self, size: int, rank: int) -> None:
        self.size = size
        self.rank = rank

    def current_rank(self) -> int:
        return self.rank

    def communicator(self, ranks: tuple[int, ...]) -> Communicator:
        raise DetachedWorldError(
            f"this DTensor was loaded outside a running world (as rank {self.rank} of {self.size}), so it cannot "
            f"communicate with ranks {list(ranks)}; read it with .to_local(), or load it inside "
            "spmd.testing.run_threaded or after torch.distributed.init_process_group to compute with it"
        )

    def create_groups(self, groups: list[tuple[int, ...]], *, timeout_s: float | None = None) -> None:
        if groups:
            self.communicator(groups[0])

    def __repr__(self) -> str:
        return f"DetachedWorld(rank {self.rank} of {self.size})"
