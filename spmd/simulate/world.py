"""A world of N ranks that runs one rank's program: collectives return correctly shaped results, move nothing.

The simulated rank is fixed when the world is made, so ``current_rank()`` needs no thread lookup.
Only the groups the simulated rank calls on get a communicator (created on first use), so a world of
65,536 ranks costs no more than one of 8. Every public collective still goes through
``Communicator._record``, which is what CommDebugMode counts: the records equal a real run's.
"""

from __future__ import annotations

from typing import Any

import torch

from spmd.comm.base import Communicator, World
from spmd.compile.properties import traceable_property

__all__ = ["SimulatedWorld", "SimulatedCommunicator"]


class SimulatedCommunicator(Communicator):
    """Collectives over ``ranks`` as seen by the simulated rank: fresh tensors of the result's shape.

    The results are uninitialised (meta tensors hold no values at all); ``all_gather_object`` says
    every member sent what the simulated rank sent, as in an SPMD program.
    """

    def __init__(self, ranks: tuple[int, ...], rank: int) -> None:
        super().__init__(ranks)
        self._local_rank = ranks.index(rank)

    @traceable_property
    def local_rank(self) -> int:
        return self._local_rank

    # Meta tensors (the model's data) get empty results. A real tensor (a seed, a small flag)
    # gets the values it would have if every member held what the simulated rank holds.
    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_meta:
            return tensor.new_empty((self.size, *tensor.shape))
        return tensor.unsqueeze(0).expand(self.size, *tensor.shape).clone()

    def _all_reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        if tensor.is_meta:
            return torch.empty_like(tensor)
        return tensor * self.size if reduce_op == "sum" else tensor.clone()

    def _reduce_scatter(self, stacked: torch.Tensor, reduce_op: str) -> torch.Tensor:
        if stacked.is_meta:
            return stacked.new_empty(stacked.shape[1:])
        block = stacked[self._local_rank]
        return block * self.size if reduce_op == "sum" else block.clone()

    def _all_to_all(self, stacked: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(stacked) if stacked.is_meta else stacked.clone()

    def _broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return torch.empty_like(tensor) if tensor.is_meta else tensor.clone()

    def _scatter(self, stacked: torch.Tensor, src: int) -> torch.Tensor:
        return stacked.new_empty(stacked.shape[1:]) if stacked.is_meta else stacked[self._local_rank].clone()

    def _all_gather_object(self, obj: Any) -> list[Any]:
        return [obj] * self.size


class SimulatedWorld(World):
    """``size`` ranks of which only ``rank`` runs; enter it with ``spmd.comm.use_world``.

    >>> with use_world(SimulatedWorld(4096, rank=0)):  # doctest: +SKIP
    ...     mesh = init_device_mesh("meta", (512, 8), mesh_dim_names=("dp", "tp"))
    """

    backend_name = "simulated"

    def __init__(self, size: int, *, rank: int = 0) -> None:
        if size < 1:
            raise ValueError(f"a simulated world needs at least one rank, got size={size}")
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a world of {size} ranks; pick a rank in [0, {size - 1}]")
        self.size = size
        self.rank = rank
        self._communicators: dict[tuple[int, ...], SimulatedCommunicator] = {}

    def current_rank(self) -> int:
        return self.rank

    def communicator(self, ranks: tuple[int, ...]) -> SimulatedCommunicator:
        comm = self._communicators.get(ranks)
        if comm is None:
            if self.rank not in ranks:
                raise RuntimeError(f"the simulated rank {self.rank} is not in the group {list(ranks)}")
            comm = self._communicators[ranks] = SimulatedCommunicator(ranks, self.rank)
        return comm

    def create_groups(self, groups: list[tuple[int, ...]], *, timeout_s: float | None = None) -> None:
        """Nothing to create: a group's communicator is made when the simulated rank first uses it."""

    @property
    def communicator_count(self) -> int:
        """How many groups the simulated rank has used (a handful, whatever the world's size)."""
        return len(self._communicators)
